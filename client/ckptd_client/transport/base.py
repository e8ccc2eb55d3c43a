"""The staging-transport seam.

Order of calls, from the training thread: ``acquire(nbytes)`` -> the caller copies the
save into ``lease.buffer`` -> ``submit(...)`` (the transport now owns the lease and
releases it once the bytes are durable) -> the returned future resolves to the committed
:class:`CheckpointInfo` or the save's error.  ``storage()`` serves reads for ``load``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from ckptd.format.plan import RankPlan
from ckptd.format.writer import SaveIdentity
from ckptd.storage.base import StorageBackend


class Lease:
    """A staging buffer lent to one save; ``release()`` returns it (idempotent)."""

    def __init__(self, buffer: torch.Tensor, release: Callable[[], None]) -> None:
        self.buffer = buffer
        self._release = release
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()


class Transport(abc.ABC):
    url: str

    @abc.abstractmethod
    def acquire(self, nbytes: int, block: bool) -> Lease | None:
        """A buffer of ``nbytes``; None if ``block`` is False and none is free now."""

    @abc.abstractmethod
    def submit(self, ident: SaveIdentity, plan: RankPlan, lease: Lease, extra: Any,
               param_groups: list[dict]) -> Future:
        """Persist the staged bytes and commit; the future yields a CheckpointInfo."""

    @abc.abstractmethod
    def storage(self) -> StorageBackend:
        """Storage to read committed checkpoints from."""

    def abandon(self, ident: SaveIdentity, error: str) -> None:
        """This rank's save ``ident`` failed before ``submit``: tell the ranks that wait for
        its commit, where this transport can (best effort).  Default: nothing (they wait for
        their commit timeout)."""

    def finish_at_exit(self) -> None:
        """The interpreter is exiting with saves of this transport in flight: do what this
        rank's part of them still needs from this process (not the commits of other ranks).
        Default: nothing (the daemon owns what was handed over)."""

    def close(self) -> None:
        """Release resources.  Idempotent."""
