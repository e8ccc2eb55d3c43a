"""Embedded transport: this process writes its own shards (no daemon).

One reusable staging buffer per client; a writer thread writes from it with a bounded
I/O pool, releases it, then runs the commit protocol.  The training process must stay
alive until the save commits (use the daemon to make a save survive the trainer).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptd.errors import CkptdError, SaveFailedError
from ckptd.format.commit import mark_failed, try_commit, wait_committed
from ckptd.format.plan import RankPlan
from ckptd.format.writer import SaveIdentity, write_rank
from ckptd.storage import open_storage, open_write_storage
from ckptd.storage.base import StorageBackend
from ckptd_client.staging import StagingBuffer
from ckptd_client.transport.base import Lease, Transport

log = logging.getLogger("ckptd.client")


class EmbeddedTransport(Transport):
    def __init__(self, uri: str, *, storage_options: dict[str, Any], write_concurrency: int = 8,
                 commit_timeout: float | None = 1800.0) -> None:
        self._storage = open_storage(uri, **storage_options)
        # the writer thread holds the staged bytes: it rides out an object-store outage
        self._wstorage = open_write_storage(uri, self._storage, **storage_options)
        self.url = self._storage.url
        self._staging = StagingBuffer()
        self._free = threading.Semaphore(1)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-writer")
        self._waiters = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ckptd-commit")
        self._io = ThreadPoolExecutor(max_workers=max(1, write_concurrency),
                                      thread_name_prefix="ckptd-io")
        self._commit_timeout = commit_timeout
        self._cancel = threading.Event()

    def storage(self) -> StorageBackend:
        return self._storage

    def acquire(self, nbytes: int, block: bool) -> Lease | None:
        if not self._free.acquire(blocking=block):
            return None
        try:
            buf = self._staging.ensure(nbytes)
        except BaseException:
            self._free.release()
            raise
        return Lease(buf, self._free.release)

    def submit(self, ident: SaveIdentity, plan: RankPlan, lease: Lease, extra: Any,
               param_groups: list[dict]) -> Future:
        from ckptd_client.client import CheckpointInfo

        out: Future = Future()

        def fail(exc: BaseException) -> BaseException:
            if isinstance(exc, CkptdError):  # typed errors reach the caller as they are
                out.set_exception(exc)
                return exc
            err = SaveFailedError(
                f"save of step {ident.step} (job {ident.job!r}, rank {ident.rank}) failed and "
                f"was not committed: {type(exc).__name__}: {exc}. Earlier checkpoints are "
                "untouched."
            )
            err.__cause__ = exc
            out.set_exception(err)
            return err

        def info(nbytes: int) -> Any:
            return CheckpointInfo(ident.job, ident.step, ident.attempt, ident.world_size,
                                  ident.framework, self.url, nbytes)

        def wait(nbytes: int) -> None:
            try:
                wait_committed(self._wstorage, ident.job, ident.step, ident.attempt,
                               ident.world_size, self._commit_timeout, self._cancel)
            except BaseException as exc:  # noqa: BLE001
                fail(exc)
                return
            out.set_result(info(nbytes))

        def write() -> None:
            written = False
            try:
                try:
                    manifest = write_rank(self._wstorage, ident, plan, lease.buffer.numpy(),
                                          extra=extra, param_groups=param_groups,
                                          executor=self._io)
                    written = True
                finally:
                    lease.release()
                nbytes = sum(c.nbytes for a in manifest.arrays.values() for c in a.chunks.values())
                try:
                    committed = try_commit(self._wstorage, ident.job, ident.step, ident.attempt,
                                           ident.world_size) is not None
                except Exception as exc:  # noqa: BLE001 - wait() below decides
                    # The COMMITTED put may have landed although it reported an error (a
                    # 5xx or a lost answer): wait() reads it back, and commits again or
                    # fails with the error if it is not there.
                    log.warning("ckptd: commit of step %d reported an error (%s); checking "
                                "whether it is committed", ident.step, exc)
                    committed = False
                if committed:
                    log.info("ckptd: committed step %d of job %s", ident.step, ident.job)
                    out.set_result(info(nbytes))
                    return
            except BaseException as exc:  # noqa: BLE001 - delivered through the future
                log.error("ckptd: save of step %d failed: %s", ident.step, exc)
                err = fail(exc)
                if not written and ident.world_size > 1:  # the other ranks stop waiting
                    self._waiters.submit(mark_failed, self._storage, ident.job, ident.step,
                                         ident.attempt, ident.rank, str(err))
                return
            self._waiters.submit(wait, nbytes)

        self._writer.submit(write)
        return out

    def abandon(self, ident: SaveIdentity, error: str) -> None:
        mark_failed(self._storage, ident.job, ident.step, ident.attempt, ident.rank, error)

    def finish_at_exit(self) -> None:
        self.close()  # writes this rank's part and tries the commit; stops commit waits

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._cancel.set()
        self._waiters.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self._storage.close()
        if self._wstorage is not self._storage:
            self._wstorage.close()
