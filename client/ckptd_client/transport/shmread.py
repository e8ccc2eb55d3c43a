"""The shared-memory read path of the daemon transport (``load`` on the daemon's node).

:class:`SegmentWindow` is a :class:`ckptd.format.reader.ReadWindow` backed by a read segment:
a sealed memfd the daemon created for this session (AcquireStaging with SEGMENT_USE_READ),
mapped here read-only and in the daemon writable.  ``fill`` names a batch of ranges in one
ReadIntoSegment call; the daemon reads the objects straight into the segment (in parallel)
and answers once the bytes are there, so no object bytes travel in gRPC messages.  The
reader then checksums and copies from views into this mapping.

If the daemon cannot serve a batch that way any more (it restarted and forgot the session,
it went away, or it is a version without ReadIntoSegment), the window falls back for good to
the ReadObject stream (``DaemonStorage.get``), which waits for a restarting daemon; a load
then still completes.  Storage errors and refused keys are raised, not retried.

Threads: ``reserve``/``release`` from the reader's scheduling thread, ``fill`` from its pool
threads (the allocator is only touched by the former), ``close`` once at the end.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import threading
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from ckptd.daemon.rpcerrors import error_from_rpc
from ckptd.errors import StagingError
from ckptd.format.reader import ReadWindow, WindowRead
from ckptd.v1 import ckptd_pb2 as pb

log = logging.getLogger("ckptd.client")

ALIGN = 64                 # every range starts 64-byte aligned (any dtype view is aligned)
MAX_BATCH_ITEMS = 1024     # the daemon accepts up to 4096 ranges per call
MIN_BATCH_BYTES = 1 << 20
READ_TIMEOUT = 600.0
SMALL_WINDOW = 32 << 20    # asked for when the budget cannot give the window the reader wants
# The daemon can no longer serve this window (session or segment gone after a restart,
# daemon unreachable, or too old for ReadIntoSegment): read through the stream instead.
_FALLBACK_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNIMPLEMENTED,
                   grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                   grpc.StatusCode.CANCELLED)


class RangeAllocator:
    """First-fit allocation of ``[0, size)`` in ``align``-byte multiples.  Not thread-safe.

    ``take(n)`` returns an offset or None (no free run long enough); ``give(offset, n)``
    returns it, merging neighbouring free runs.  Giving back what is free already (a
    double release) raises RuntimeError.
    """

    def __init__(self, size: int, align: int = ALIGN) -> None:
        if size < 0 or align <= 0:
            raise ValueError(f"bad allocator size {size} or alignment {align}")
        self.size = size
        self.align = align
        self.in_use = 0
        self._free: list[tuple[int, int]] = [(0, size)] if size else []  # sorted, disjoint

    def _span(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    def take(self, nbytes: int) -> int | None:
        if nbytes < 0:
            raise ValueError(f"cannot take {nbytes} bytes")
        if nbytes == 0:
            return 0
        need = self._span(nbytes)
        for i, (lo, hi) in enumerate(self._free):
            if hi - lo >= need:
                if hi - lo == need:
                    del self._free[i]
                else:
                    self._free[i] = (lo + need, hi)
                self.in_use += need
                return lo
        return None

    def give(self, offset: int, nbytes: int) -> None:
        if nbytes == 0:
            return
        lo, hi = offset, offset + self._span(nbytes)
        if lo < 0 or hi > max(self.size, self._span(self.size)):
            raise RuntimeError(f"release of [{lo}, {hi}) outside [0, {self.size})")
        i = bisect.bisect_left(self._free, (lo, hi))
        if (i > 0 and self._free[i - 1][1] > lo) or (i < len(self._free)
                                                     and self._free[i][0] < hi):
            raise RuntimeError(f"release of [{lo}, {hi}), which is (partly) free already")
        self.in_use -= hi - lo
        if i < len(self._free) and self._free[i][0] == hi:
            hi = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == lo:
            i -= 1
            lo = self._free.pop(i)[0]
        self._free.insert(i, (lo, hi))


class SegmentWindow(ReadWindow):
    """A read window over one read segment of the session ``session_id``.

    ``call(request)`` sends ReadIntoSegment (raising grpc.RpcError); ``stream_get(key,
    start, end)`` reads through ReadObject; ``count(transfer, nbytes)`` records bytes per
    path; ``release()`` gives the segment back to the daemon.
    """

    def __init__(self, *, session_id: str, segment_id: str, mm: mmap.mmap, address: str,
                 call: Callable[[pb.ReadIntoSegmentRequest], Any],
                 stream_get: Callable[[str, int | None, int | None], bytes],
                 count: Callable[[str, int], None], release: Callable[[], None]) -> None:
        self.capacity = len(mm)
        self.max_batch_bytes = max(MIN_BATCH_BYTES, self.capacity // 4)
        self.max_batch_items = MAX_BATCH_ITEMS
        self.session_id = session_id
        self.segment_id = segment_id
        self._mm: mmap.mmap | None = mm
        self._view = memoryview(mm)
        self._address = address
        self._call = call
        self._stream_get = stream_get
        self._count = count
        self._release = release
        self._alloc = RangeAllocator(self.capacity)
        self._lock = threading.Lock()
        self.fallback: str | None = None   # why this window reads through the stream now
        self._closed = False

    # -- allocation (the reader's scheduling thread) --------------------------------------
    def reserve(self, nbytes: int) -> int | None:
        return self._alloc.take(nbytes)

    def release(self, offset: int, nbytes: int) -> None:
        self._alloc.give(offset, nbytes)

    # -- reading (pool threads) -----------------------------------------------------------
    def fill(self, reads: Sequence[WindowRead]) -> list[memoryview | int | None]:
        if self.fallback is None and not self._closed:
            req = pb.ReadIntoSegmentRequest(session_id=self.session_id,
                                            segment_id=self.segment_id, ranges=[
                pb.ReadRange(key=r.key, start=r.start, length=r.nbytes, offset=r.offset,
                             whole=r.whole) for r in reads])
            try:
                resp = self._call(req)
            except grpc.RpcError as exc:
                if exc.code() not in _FALLBACK_CODES:  # type: ignore[attr-defined]
                    raise error_from_rpc(exc, self._address) from None
                with self._lock:
                    if self.fallback is None:
                        self.fallback = f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
                        log.warning("ckptd: the daemon at %s no longer serves shared-memory "
                                    "reads for this load (%s); reading through the gRPC stream",
                                    self._address, self.fallback)
            else:
                return self._placed(reads, list(resp.nbytes))
        return [self._streamed(r) for r in reads]

    def _placed(self, reads: Sequence[WindowRead],
                sizes: list[int]) -> list[memoryview | int | None]:
        if len(sizes) != len(reads):
            raise StagingError(f"the daemon answered {len(sizes)} sizes for {len(reads)} "
                               "ranges of ReadIntoSegment; expected one per range")
        out: list[memoryview | int | None] = []
        placed = 0
        for r, n in zip(reads, sizes):
            if n < 0:
                out.append(None)
            elif r.whole and n != r.nbytes:
                out.append(int(n))
            elif n > r.nbytes:
                raise StagingError(f"the daemon placed {n} bytes of {r.key} where {r.nbytes} "
                                   "were asked; expected at most the range's length")
            else:
                out.append(self._view[r.offset:r.offset + n])
                placed += n
        self._count("shared_memory", placed)
        return out

    def _streamed(self, r: WindowRead) -> memoryview | None:
        try:
            if r.whole:
                return memoryview(self._stream_get(r.key, None, None))
            return memoryview(self._stream_get(r.key, r.start, r.start + r.nbytes))
        except FileNotFoundError:
            return None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._release()
        finally:
            try:
                self._view.release()
            except BufferError:
                pass
            mm, self._mm = self._mm, None
            if mm is not None:
                try:
                    mm.close()
                except BufferError:
                    pass  # a view is still referenced somewhere; the GC unmaps it
