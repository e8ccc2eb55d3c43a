"""The write pipeline: from an accepted Save to a committed checkpoint.

Runs on the daemon's event loop.  Each accepted rank save becomes a :class:`SaveRecord`
and a task that (1) waits for one of ``max_parallel_saves`` writer slots, (2) runs
:func:`ckptd.format.writer.write_rank` in a worker thread, whose chunk puts and checksums
go to the bounded I/O pool (``--write-concurrency`` threads), (3) hands the staging memory
back (``done`` callback), and (4) runs the storage commit protocol for the rank's attempt
(:class:`AttemptTracker`): ``try_commit`` right after the write -- so the daemon of the last
rank commits -- then, while the step is not committed, polls storage, since the committer
may be another node's daemon.

States of a rank save (the numbers are the proto's ``SaveState``)::

    ACCEPTED -> WRITTEN -> COMMITTED
        \\           \\
         '-> FAILED  '-> FAILED (another rank of the attempt failed, or no commit in time)

One structured log line is written per state change.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptd.daemon import logs
from ckptd.daemon.metrics import Metrics
from ckptd.daemon.priority import DEFAULT_IO_NICE, background_nice, set_this_thread
from ckptd.errors import CkptdError, DaemonUnavailableError, SaveFailedError
from ckptd.format import paths
from ckptd.format.commit import (
    mark_failed,
    present_ranks,
    rank_failure,
    rank_files,
    read_commit,
    try_commit,
)
from ckptd.format.plan import RankPlan
from ckptd.format.writer import SaveIdentity, write_rank
from ckptd.storage.base import Buffer, ObjectInfo, StorageBackend

log = logging.getLogger("ckptd.daemon")

ACCEPTED, WRITTEN, COMMITTED, FAILED = 1, 2, 3, 4
STATE_NAMES = {ACCEPTED: "staged", WRITTEN: "written", COMMITTED: "committed", FAILED: "failed"}
DEFAULT_COMMIT_TIMEOUT = 1800.0
MAX_COMMIT_TIMEOUT = 7 * 24 * 3600.0
KEEP_FINISHED = 4096           # finished save records kept for status queries
LOCAL_RANKS_WAIT = 2.0         # seconds a save's write waits for the node's other ranks


def save_id_of(ident: SaveIdentity) -> str:
    return f"{ident.job}/{ident.step}/{ident.attempt}/{ident.rank}"


@dataclass(eq=False)
class SaveRecord:
    save_id: str
    ident: SaveIdentity
    nbytes: int
    commit_timeout: float
    state: int = ACCEPTED
    segment_returned: bool = False
    written_bytes: int = 0
    error_class: str = ""
    error_message: str = ""
    accepted_at: float = field(default_factory=time.monotonic)
    written_at: float | None = None
    version: int = 0
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def terminal(self) -> bool:
        return self.state in (COMMITTED, FAILED)

    def _bump(self) -> None:
        self.version += 1
        ev, self._changed = self._changed, asyncio.Event()
        ev.set()

    async def changes(self) -> AsyncIterator[SaveRecord]:
        """Yield the record now and after every change, until it is terminal."""
        seen = -1
        while True:
            if self.version != seen:
                seen = self.version
                yield self
                if self.terminal:
                    return
            ev = self._changed
            if self.version == seen:
                await ev.wait()


class _GuardedStorage(StorageBackend):
    """Delegates to the daemon's backend, refusing writes once the daemon aborts saves, so
    an aborted save never writes a manifest or COMMITTED after the abort."""

    def __init__(self, inner: StorageBackend, aborted: threading.Event) -> None:
        self.inner = inner
        self.url = inner.url
        self._aborted = aborted

    def _check(self) -> None:
        if self._aborted.is_set():
            raise SaveFailedError("the ckptd daemon is shutting down and aborted this save")

    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        self._check()
        self.inner.put(key, data)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.inner.get(key, start, end)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def list_dir(self, prefix: str) -> list[str]:
        return self.inner.list_dir(prefix)

    def list_files(self, prefix: str) -> dict[str, int]:
        return self.inner.list_files(prefix)

    def list_objects(self, prefix: str) -> dict[str, ObjectInfo]:
        return self.inner.list_objects(prefix)

    def delete(self, keys: Iterable[str]) -> None:
        self._check()
        self.inner.delete(keys)


class _RankFailed(SaveFailedError):
    """Another rank of the attempt recorded that its save failed (its daemon may run on
    another node): the attempt will not commit."""


def _commit_poll(storage: StorageBackend, job: str, step: int, attempt: str,
                 world_size: int) -> str | None:
    """One look at storage: is the attempt committed ("seen"), or did this call commit it
    ("ours": every rank manifest was there but nobody had committed, e.g. the committer
    died)?  None if not committed; _RankFailed if a rank recorded a failed save.  Mirrors
    format.commit.wait_committed."""
    prefix = paths.attempt_prefix(job, step, attempt)
    rec = read_commit(storage, job, step)
    if rec is not None and rec.attempt == attempt:
        return "seen"
    if rec is not None and storage.exists(paths.index_key(prefix)):
        return "seen"  # committed, then superseded by a later attempt of the same step
    present, failed = rank_files(storage, prefix)
    if (rec is None and set(range(world_size)) <= present
            and try_commit(storage, job, step, attempt, world_size) is not None):
        return "ours"
    if failed:
        r = min(failed)
        raise _RankFailed(f"step {step} of job {job!r} will not commit: rank {r}'s save "
                          f"failed: {rank_failure(storage, prefix, r)}")
    return None


class AttemptTracker:
    """The local rank saves of one (job, step, attempt) and its commit."""

    def __init__(self, pipe: WritePipeline, job: str, step: int, attempt: str,
                 world_size: int) -> None:
        self.pipe = pipe
        self.job, self.step, self.attempt, self.world_size = job, step, attempt, world_size
        self.records: list[SaveRecord] = []
        self.committed = False
        self.failure: tuple[str, str] | None = None
        self._poll: asyncio.Task | None = None
        self.touched = time.monotonic()
        self._arrived = asyncio.Event()

    def add(self, rec: SaveRecord) -> None:
        self.records.append(rec)
        ev, self._arrived = self._arrived, asyncio.Event()
        ev.set()

    async def wait_for_ranks(self, n: int, timeout: float) -> None:
        """Wait until ``n`` rank saves of this attempt arrived here, at most ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while len({r.ident.rank for r in self.records}) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                return

    @property
    def done(self) -> bool:
        return all(r.terminal for r in self.records) and self._poll is None

    async def after_write(self, rec: SaveRecord) -> None:
        if self.failure is not None:
            self.pipe._fail(rec, *self.failure)
            return
        if self.committed:
            self.pipe._commit(rec)
            return
        try:
            committed = await self.pipe._run_blocking(
                try_commit, self.pipe.guarded, self.job, self.step, self.attempt,
                self.world_size) is not None
        except Exception as exc:  # noqa: BLE001 - polling retries it
            log.warning("commit check of %s step %d failed (will retry): %s", self.job,
                        self.step, exc)
            committed = False
        if committed:
            self.mark_committed(by_us=True)
        else:
            self.ensure_polling()

    def mark_committed(self, by_us: bool) -> None:
        """The attempt is committed; ``by_us``: this daemon wrote COMMITTED (it then runs
        the post-commit hook, i.e. retention, so that not every node's daemon does)."""
        if self.committed:
            return
        self.committed = True
        for r in self.records:
            if r.state == WRITTEN:
                self.pipe._commit(r)
        if by_us:
            self.pipe._committed(self.job, self.step)

    def fail_all(self, error_class: str, message: str) -> None:
        if self.failure is None:
            self.failure = (error_class, message)
        for r in self.records:
            if r.state == WRITTEN:
                self.pipe._fail(r, error_class, message)

    def ensure_polling(self) -> None:
        if self._poll is None and not self.committed and self.failure is None:
            self._poll = asyncio.get_running_loop().create_task(self._poll_loop())

    async def _poll_loop(self) -> None:
        delay = 0.05
        try:
            while True:
                waiting = [r for r in self.records if r.state == WRITTEN]
                if not waiting or self.committed or self.failure is not None:
                    return
                try:
                    seen = await self.pipe._run_blocking(_commit_poll, self.pipe.guarded,
                                                         self.job, self.step, self.attempt,
                                                         self.world_size)
                    if seen is not None:
                        self.mark_committed(by_us=seen == "ours")
                        return
                except _RankFailed as exc:
                    self.fail_all("SaveFailedError", str(exc))
                    return
                except Exception as exc:  # noqa: BLE001 - keep polling until the deadline
                    log.warning("commit poll of %s step %d failed: %s", self.job, self.step, exc)
                now = time.monotonic()
                if all(now >= (r.written_at or now) + r.commit_timeout for r in waiting):
                    try:
                        have = await self.pipe._run_blocking(
                            present_ranks, self.pipe.storage,
                            paths.attempt_prefix(self.job, self.step, self.attempt))
                        missing = sorted(set(range(self.world_size)) - have)
                    except Exception:  # noqa: BLE001
                        missing = []
                    self.fail_all("SaveFailedError", (
                        f"step {self.step} of job {self.job!r} did not commit within "
                        f"{waiting[0].commit_timeout:.0f}s: rank manifests missing for ranks "
                        f"{missing} of {self.world_size}. Those ranks' saves failed or are "
                        "still running; earlier checkpoints are untouched."))
                    return
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 1.5)
        finally:
            self._poll = None


class WritePipeline:
    def __init__(self, storage: StorageBackend, metrics: Metrics, *, write_concurrency: int = 8,
                 max_parallel_saves: int = 16, io_nice: int = DEFAULT_IO_NICE,
                 test_write_delay: float = 0.0,
                 test_write_gate: str | None = None,
                 on_committed: Callable[[str, int], None] | None = None) -> None:
        self.storage = storage
        self.metrics = metrics
        self._aborted = threading.Event()
        self.guarded = _GuardedStorage(storage, self._aborted)
        # Writing is background work: these threads yield the node's cores to trainers.
        lower = functools.partial(set_this_thread, background_nice(io_nice))
        self.io = ThreadPoolExecutor(max_workers=write_concurrency, thread_name_prefix="ckptd-io",
                                     initializer=lower)
        self._workers = ThreadPoolExecutor(max_workers=max_parallel_saves + 4,
                                           thread_name_prefix="ckptd-save", initializer=lower)
        self._slots = asyncio.Semaphore(max_parallel_saves)
        self.saves: collections.OrderedDict[str, SaveRecord] = collections.OrderedDict()
        self.trackers: collections.OrderedDict[tuple[str, int, str], AttemptTracker] = (
            collections.OrderedDict())
        self.accepting = True
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Task] = set()
        self.test_write_delay = test_write_delay
        self.test_write_gate = test_write_gate
        self.on_committed = on_committed

    # -- helpers -------------------------------------------------------------------------
    async def _run_blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self._workers, functools.partial(fn, *args, **kwargs))

    def _tracker(self, ident: SaveIdentity) -> AttemptTracker:
        key = (ident.job, ident.step, ident.attempt)
        t = self.trackers.get(key)
        if t is None:
            t = self.trackers[key] = AttemptTracker(self, ident.job, ident.step, ident.attempt,
                                                    ident.world_size)
        t.touched = time.monotonic()
        return t

    def _log(self, rec: SaveRecord, level: int = logging.INFO, **more: Any) -> None:
        i = rec.ident
        state = STATE_NAMES[rec.state]
        logs.event(f"checkpoint {state}: job {i.job} step {i.step} rank {i.rank}/{i.world_size}",
                   level, event="checkpoint", state=state, job=i.job, step=i.step,
                   attempt=i.attempt, rank=i.rank, world_size=i.world_size, **more)

    def _commit(self, rec: SaveRecord) -> None:
        if rec.terminal:
            return
        rec.state = COMMITTED
        rec._bump()
        latency = time.monotonic() - rec.accepted_at
        self.metrics.save_latency.observe(latency)
        self.metrics.saves.labels("committed").inc()
        self._log(rec, seconds=round(latency, 3), bytes=rec.written_bytes)
        self._evict()

    def _fail(self, rec: SaveRecord, error_class: str, message: str) -> None:
        if rec.terminal:
            return
        rec.state = FAILED
        rec.error_class, rec.error_message = error_class, message
        rec._bump()
        self.metrics.save_failures.inc()
        self.metrics.saves.labels("failed").inc()
        self._log(rec, logging.WARNING, error=error_class, reason=message)
        self._evict()

    def _committed(self, job: str, step: int) -> None:
        if self.on_committed is not None:
            try:
                self.on_committed(job, step)
            except Exception:
                log.exception("post-commit hook failed for %s step %d", job, step)

    def _evict(self) -> None:
        while len(self.saves) > KEEP_FINISHED:
            sid, rec = next(iter(self.saves.items()))
            if not rec.terminal:
                self.saves.move_to_end(sid)
                if all(not r.terminal for r in self.saves.values()):
                    break
                continue
            del self.saves[sid]
        while len(self.trackers) > KEEP_FINISHED:
            key, t = next(iter(self.trackers.items()))
            if not t.done:
                self.trackers.move_to_end(key)
                if all(not x.done for x in self.trackers.values()):
                    break
                continue
            del self.trackers[key]

    # -- API -----------------------------------------------------------------------------
    def find(self, save_id: str) -> SaveRecord | None:
        return self.saves.get(save_id)

    def submit(self, ident: SaveIdentity, plan: RankPlan, buffer: memoryview, *, extra: Any,
               param_groups: list[dict], commit_timeout: float,
               done: Callable[[], None], local_ranks: int = 1) -> SaveRecord:
        """Accept a validated save whose bytes are in ``buffer``; ``done()`` is called (on
        the loop) once the daemon no longer reads ``buffer``.

        ``local_ranks``: how many ranks of the job stage on this node.  Writing starts once
        that many rank saves of the attempt arrived (or after :data:`LOCAL_RANKS_WAIT`
        seconds), so that checksumming and writing one rank's bytes does not take the
        node's cores and memory bandwidth from ranks still copying theirs -- the part of a
        save that stalls training.
        """
        timeout = DEFAULT_COMMIT_TIMEOUT if commit_timeout <= 0 else min(commit_timeout,
                                                                          MAX_COMMIT_TIMEOUT)
        rec = SaveRecord(save_id_of(ident), ident, plan.nbytes, timeout)
        self.saves[rec.save_id] = rec
        tracker = self._tracker(ident)
        tracker.add(rec)
        self.metrics.bytes_staged.inc(plan.nbytes)
        self.metrics.queue_depth.inc()
        self._log(rec, bytes=plan.nbytes)
        self._active += 1
        self._idle.clear()
        task = asyncio.get_running_loop().create_task(
            self._run(rec, tracker, plan, buffer, extra, param_groups, done, local_ranks))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return rec

    async def _test_hooks(self) -> None:
        if self.test_write_gate:
            while not os.path.exists(self.test_write_gate):
                await asyncio.sleep(0.05)
        if self.test_write_delay:
            await asyncio.sleep(self.test_write_delay)

    async def _run(self, rec: SaveRecord, tracker: AttemptTracker, plan: RankPlan,
                   buffer: memoryview, extra: Any, param_groups: list[dict],
                   done: Callable[[], None], local_ranks: int = 1) -> None:
        ident = rec.ident
        error: tuple[str, str] | None = None
        try:
            if local_ranks > 1:
                await tracker.wait_for_ranks(local_ranks, LOCAL_RANKS_WAIT)
            async with self._slots:
                await self._test_hooks()
                t0 = time.monotonic()
                manifest = await self._run_blocking(
                    write_rank, self.guarded, ident, plan, buffer, extra=extra,
                    param_groups=param_groups, executor=self.io,
                    on_bytes=self.metrics.bytes_written.inc)
                self.metrics.write_latency.observe(time.monotonic() - t0)
                rec.written_bytes = sum(c.nbytes for a in manifest.arrays.values()
                                        for c in a.chunks.values())
                del manifest
        except asyncio.CancelledError:
            error = ("SaveFailedError", "the ckptd daemon stopped before this save was written")
        except CkptdError as exc:
            error = (type(exc).__name__, str(exc))
        except Exception as exc:
            log.exception("writing %s failed", rec.save_id)
            error = ("SaveFailedError", (f"writing step {ident.step} rank {ident.rank} failed: "
                                         f"{type(exc).__name__}: {exc}"))
        finally:
            del buffer
            done()
            rec.segment_returned = True
            self.metrics.queue_depth.dec()
        try:
            if error is not None:
                error = (error[0], (f"save of step {ident.step} (job {ident.job!r}, rank "
                                    f"{ident.rank}) failed and was not committed: "
                                    f"{error[1].rstrip('.')}. "
                                    "Earlier checkpoints are untouched."))
                self._fail(rec, *error)
                tracker.fail_all("SaveFailedError", (
                    f"step {ident.step} of job {ident.job!r} will not commit: rank "
                    f"{ident.rank}'s save failed: {error[1]}"))
                if ident.world_size > 1:  # ranks saving through other daemons stop waiting
                    # (best effort, not awaited: a failing store may retry it for minutes)
                    try:
                        asyncio.get_running_loop().run_in_executor(
                            self._workers, functools.partial(
                                mark_failed, self.guarded, ident.job, ident.step,
                                ident.attempt, ident.rank, error[1]))
                    except RuntimeError:  # the daemon is closing
                        pass
                return
            rec.state = WRITTEN
            rec.written_at = time.monotonic()
            rec._bump()
            self._log(rec, bytes=rec.written_bytes,
                      seconds=round(rec.written_at - rec.accepted_at, 3))
            await tracker.after_write(rec)
        finally:
            self._active -= 1
            if self._active == 0:
                self._idle.set()

    async def adopt(self, ident: SaveIdentity, commit_timeout: float) -> SaveRecord:
        """A record for a save this daemon does not know (it restarted), from storage."""
        sid = save_id_of(ident)
        rec = self.saves.get(sid)
        if rec is not None:
            return rec
        timeout = DEFAULT_COMMIT_TIMEOUT if commit_timeout <= 0 else min(commit_timeout,
                                                                          MAX_COMMIT_TIMEOUT)
        prefix = paths.attempt_prefix(ident.job, ident.step, ident.attempt)
        rec = SaveRecord(sid, ident, 0, timeout, segment_returned=True)
        try:
            committed = await self._run_blocking(_commit_poll, self.storage, ident.job,
                                                 ident.step, ident.attempt, ident.world_size)
        except _RankFailed:
            committed = None  # this rank's own state decides below; polling reports it
        if sid in self.saves:
            return self.saves[sid]
        self.saves[sid] = rec
        tracker = self._tracker(ident)
        tracker.add(rec)
        if committed:
            rec.state = COMMITTED
            tracker.committed = True
            return rec
        have = await self._run_blocking(self.storage.exists,
                                        paths.rank_manifest_key(prefix, ident.rank))
        if have:
            rec.state = WRITTEN
            rec.written_at = time.monotonic()
            tracker.ensure_polling()
        else:
            rec.state = FAILED
            rec.error_class = DaemonUnavailableError.__name__
            rec.error_message = (
                f"the ckptd daemon that accepted step {ident.step} of job {ident.job!r} (rank "
                f"{ident.rank}) exited before the rank's bytes were durable, so that step will "
                "not commit. Earlier checkpoints are untouched; the next save goes to this "
                "(restarted) daemon.")
        return rec

    @property
    def in_flight(self) -> int:
        return self._active

    async def drain(self, timeout: float | None) -> bool:
        """Stop accepting and wait until every accepted save was written (or failed) and
        had its commit attempt.  True if that happened within ``timeout``."""
        self.accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def abort(self) -> int:
        """Make every in-flight save fail without committing; returns how many."""
        self._aborted.set()
        n = 0
        for rec in self.saves.values():
            if rec.state == ACCEPTED:
                n += 1
        return n

    def close(self) -> None:
        for t in list(self.trackers.values()):
            if t._poll is not None:
                t._poll.cancel()
        self.io.shutdown(wait=False, cancel_futures=True)
        self._workers.shutdown(wait=False, cancel_futures=True)
