"""The node-wide staging budget: a byte semaphore with FIFO waiters.

Used from the daemon's event loop only (not thread-safe).  ``acquire`` either takes bytes
now, waits (FIFO: a large request is not starved by a stream of small ones), or fails per
the caller's policy; a request larger than the whole budget fails at once, since it could
never be satisfied.  Every successful acquire must be paired with one ``release`` of the
same amount.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass

from ckptd.errors import BackpressureError, StagingError


@dataclass(eq=False)
class _Waiter:
    nbytes: int
    future: asyncio.Future


class ByteBudget:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"budget capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.in_use = 0
        self._waiters: collections.deque[_Waiter] = collections.deque()

    @property
    def free(self) -> int:
        return self.capacity - self.in_use

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _check(self, nbytes: int) -> None:
        if nbytes < 0:
            raise StagingError(f"cannot reserve a negative number of bytes ({nbytes})")
        if nbytes > self.capacity:
            raise StagingError(
                f"a staging segment of {nbytes} bytes can never fit the node's staging budget "
                f"of {self.capacity} bytes; raise `ckptd serve --staging-bytes` to at least the "
                "per-rank shard size times the ranks on this node"
            )

    def try_acquire(self, nbytes: int) -> bool:
        """Take ``nbytes`` now if they are free and nobody waits before us."""
        self._check(nbytes)
        if not self._waiters and nbytes <= self.free:
            self.in_use += nbytes
            return True
        return False

    async def acquire(self, nbytes: int, wait: bool = True, timeout: float | None = None) -> None:
        """Take ``nbytes``.

        ``wait=False``: raise BackpressureError if they are not free now.  ``wait=True``:
        wait (FIFO) up to ``timeout`` seconds, then raise BackpressureError.  Cancelling the
        waiting task leaves the budget unchanged.
        """
        if self.try_acquire(nbytes):
            return
        if not wait:
            raise BackpressureError(
                f"the node's staging budget is in use ({self.in_use} of {self.capacity} bytes "
                f"taken, {nbytes} requested)"
            )
        waiter = _Waiter(nbytes, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout)
        except TimeoutError:
            self._abandon(waiter)
            raise BackpressureError(
                f"waited {timeout:.0f}s for {nbytes} staging bytes; the node's staging budget "
                f"({self.capacity} bytes) stayed in use"
            ) from None
        except BaseException:
            self._abandon(waiter)
            raise

    def _abandon(self, waiter: _Waiter) -> None:
        if waiter.future.done() and not waiter.future.cancelled():
            self.release(waiter.nbytes)  # granted just as we gave up: hand the bytes back
            return
        waiter.future.cancel()
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        self._wake()  # a large waiter leaving may unblock smaller ones behind it

    def release(self, nbytes: int) -> None:
        if nbytes < 0 or nbytes > self.in_use:
            raise RuntimeError(f"budget release of {nbytes} bytes with {self.in_use} in use")
        self.in_use -= nbytes
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            w = self._waiters[0]
            if w.future.done():
                self._waiters.popleft()
                continue
            if w.nbytes > self.free:
                return
            self._waiters.popleft()
            self.in_use += w.nbytes
            w.future.set_result(None)

