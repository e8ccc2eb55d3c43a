"""The storage-based commit protocol, and reading what is committed.

Every rank's writer, after its chunks and ``_ranks/<rank>.json`` are durable, calls
:func:`try_commit`.  It lists ``_ranks/`` of its attempt; whoever sees all ``world_size``
manifests consolidates them into ``index.json``, writes the zarr group documents, and
finally writes ``<job>/<step>/COMMITTED`` naming the attempt.  Every writer that gets there
writes the same bytes, so no leader is needed: with a linearizable store (local FS with
fsync, S3) the last rank to write its manifest always sees all of them.

A step without ``COMMITTED`` does not exist for readers.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptd import FORMAT_VERSION
from ckptd.errors import CheckpointNotFoundError, CorruptCheckpointError, SaveFailedError
from ckptd.format import paths
from ckptd.format.manifest import (
    COMMIT_KIND,
    FAILURE_KIND,
    Index,
    RankManifest,
    check_version,
    dumps,
    loads,
)
from ckptd.format.zarr_meta import group_doc, parent_groups
from ckptd.storage.base import StorageBackend

log = logging.getLogger("ckptd.format")


@dataclass(frozen=True, slots=True)
class CommitRecord:
    job: str
    step: int
    attempt: str
    world_size: int

    def to_json(self) -> dict:
        return {"kind": COMMIT_KIND, "format_version": FORMAT_VERSION, "job": self.job,
                "step": self.step, "attempt": self.attempt, "world_size": self.world_size}


def present_ranks(storage: StorageBackend, prefix: str) -> set[int]:
    return rank_files(storage, prefix)[0]


def rank_files(storage: StorageBackend, prefix: str) -> tuple[set[int], set[int]]:
    """The ranks of the attempt under ``prefix`` whose manifest is present, and those that
    recorded a failed save (:func:`mark_failed`) and have no manifest."""
    names = storage.list_dir(f"{prefix}/_ranks")

    def ranks(suffix: str) -> set[int]:
        n = len(suffix)
        return {int(x[:-n]) for x in names if x.endswith(suffix) and x[:-n].isdigit()}

    present = ranks(".json")
    return present, ranks(".failed") - present


def mark_failed(storage: StorageBackend, job: str, step: int, attempt: str, rank: int,
                error: str) -> None:
    """Record that ``rank``'s save of the attempt failed before its manifest was written,
    so the other ranks, which wait for the commit, fail now instead of at their commit
    timeout.  Best effort: the storage may be what failed (they then time out)."""
    key = paths.rank_failure_key(paths.attempt_prefix(job, step, attempt), rank)
    try:
        storage.put(key, dumps({"kind": FAILURE_KIND, "format_version": FORMAT_VERSION,
                                "job": job, "step": step, "attempt": attempt, "rank": rank,
                                "error": error[:4000]}))
    except Exception as exc:  # noqa: BLE001 - best effort, see above
        log.warning("ckptd: could not record the failure of rank %d's save of step %d of job "
                    "%s (the other ranks wait for their commit timeout): %s", rank, step, job,
                    exc)


def rank_failure(storage: StorageBackend, prefix: str, rank: int) -> str:
    """What rank ``rank`` recorded about its failed save (best effort)."""
    key = paths.rank_failure_key(prefix, rank)
    try:
        return str(loads(storage.get(key), key).get("error") or "no error recorded")
    except Exception as exc:  # noqa: BLE001 - the marker itself says enough
        return f"its failure record {key} cannot be read ({exc})"


def read_manifests(storage: StorageBackend, prefix: str, ranks: list[int]) -> list[RankManifest]:
    def one(r: int) -> RankManifest:
        key = paths.rank_manifest_key(prefix, r)
        return RankManifest.from_json(loads(storage.get(key), key), key)

    with ThreadPoolExecutor(max_workers=min(16, max(1, len(ranks)))) as pool:
        return list(pool.map(one, ranks))


def try_commit(storage: StorageBackend, job: str, step: int, attempt: str,
               world_size: int) -> Index | None:
    """Commit the attempt if every rank's manifest is present; return the index if so."""
    prefix = paths.attempt_prefix(job, step, attempt)
    if not set(range(world_size)) <= present_ranks(storage, prefix):
        return None
    index = Index.merge(read_manifests(storage, prefix, list(range(world_size))))
    if index.world_size != world_size:
        raise CorruptCheckpointError(
            f"{prefix}: manifests record world size {index.world_size}, expected {world_size}"
        )
    storage.put(paths.index_key(prefix), dumps(index.to_json()))
    for g in parent_groups(list(index.arrays)):
        storage.put(f"{prefix}/{g}/zarr.json", dumps(group_doc()))
    storage.put(f"{prefix}/zarr.json", dumps(group_doc({"ckptd": {
        "format_version": FORMAT_VERSION, "job": job, "step": step, "attempt": attempt,
        "world_size": world_size, "framework": index.framework, "index": "index.json",
    }})))
    rec = CommitRecord(job, step, attempt, world_size)
    storage.put(paths.committed_key(job, step), dumps(rec.to_json()))
    return index


def read_commit(storage: StorageBackend, job: str, step: int) -> CommitRecord | None:
    """The commit record of ``step``, or None if the step is not committed.

    The record names the attempt under *this* job's step directory: the ``job`` the marker
    records is not used, so a job directory copied or renamed to another job name (a fork
    of a run) loads from its own objects, never from the directory it was copied from.
    A marker that records another step is damaged (a step directory copied to another
    step number): the step's attempt holds another step's state."""
    key = paths.committed_key(job, step)
    try:
        data = storage.get(key)
    except FileNotFoundError:
        return None
    doc = loads(data, key)
    check_version(doc, key)
    try:
        rec = CommitRecord(job, step, paths.check_attempt(doc["attempt"]),
                           int(doc["world_size"]))
        recorded = int(doc["step"])
    except (KeyError, TypeError, ValueError) as exc:  # ConfigError is a ValueError
        raise CorruptCheckpointError(f"{key} is malformed ({exc})") from exc
    if recorded != step:
        raise CorruptCheckpointError(
            f"{key} records step {recorded}, expected {step}: the step directory was copied "
            f"or renamed from step {recorded}, so it does not hold step {step}'s state. Load "
            f"another step, or move the directory back to step {recorded}."
        )
    return rec


def wait_committed(
    storage: StorageBackend,
    job: str,
    step: int,
    attempt: str,
    world_size: int,
    timeout: float | None,
    cancel: threading.Event | None = None,
) -> CommitRecord:
    """Block until the attempt is committed (by any rank) or ``timeout`` seconds pass.

    Polls with backoff (50 ms up to 1 s).  Raises SaveFailedError as soon as a rank
    recorded that its save failed (:func:`mark_failed`), or on timeout, naming the ranks
    whose manifests are missing.
    """
    prefix = paths.attempt_prefix(job, step, attempt)
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.05
    while True:
        rec = read_commit(storage, job, step)
        if rec is not None and rec.attempt == attempt:
            return rec
        if rec is not None and storage.exists(paths.index_key(prefix)):
            return CommitRecord(job, step, attempt, world_size)  # committed, then superseded
        present, failed = rank_files(storage, prefix)
        if rec is None and set(range(world_size)) <= present:
            # every manifest is there but nobody committed (a committer died): do it
            try_commit(storage, job, step, attempt, world_size)
            continue
        if failed:
            r = min(failed)
            raise SaveFailedError(
                f"step {step} of job {job!r} will not commit: rank {r}'s save failed: "
                f"{rank_failure(storage, prefix, r)}"
            )
        if cancel is not None and cancel.is_set():
            raise SaveFailedError(f"save of step {step} was cancelled before it committed")
        if deadline is not None and time.monotonic() >= deadline:
            missing = sorted(set(range(world_size)) - present_ranks(storage, prefix))
            raise SaveFailedError(
                f"step {step} of job {job!r} did not commit within {timeout:.0f}s: rank "
                f"manifests missing for ranks {missing} of {world_size}. Those ranks' saves "
                "failed or are still running; earlier checkpoints are untouched."
            )
        time.sleep(delay)
        delay = min(1.0, delay * 1.5)


@dataclass(frozen=True, slots=True)
class StepInfo:
    step: int
    committed: bool
    attempt: str | None
    world_size: int | None
    attempts: tuple[str, ...]


def list_jobs(storage: StorageBackend) -> list[str]:
    out = []
    for name in storage.list_dir(""):
        try:
            paths.check_job(name)
        except Exception:  # noqa: BLE001 - not a job directory
            continue
        out.append(name)
    return out


def list_steps(storage: StorageBackend, job: str) -> list[StepInfo]:
    """Every step directory of ``job``, committed or not, oldest first.  A step whose
    ``COMMITTED`` marker is damaged is listed as not committed (with a warning)."""
    paths.check_job(job)
    steps = [s for s in (paths.parse_step_dir(n) for n in storage.list_dir(job)) if s is not None]

    def info(step: int) -> StepInfo:
        names = storage.list_dir(paths.step_dir(job, step))
        rec = None
        if "COMMITTED" in names:
            try:
                rec = read_commit(storage, job, step)
            except CorruptCheckpointError as exc:  # one damaged marker must not hide the rest
                log.warning("ckptd: step %d of job %s is not loadable: %s", step, job, exc)
        attempts = tuple(n for n in names if n != "COMMITTED")
        return StepInfo(step, rec is not None, rec.attempt if rec else None,
                        rec.world_size if rec else None, attempts)

    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(info, sorted(steps)))


def committed_steps(storage: StorageBackend, job: str) -> list[int]:
    return [s.step for s in list_steps(storage, job) if s.committed]


def resolve_step(storage: StorageBackend, job: str, step: int | None) -> CommitRecord:
    """The commit record of ``step`` (the latest committed step if None)."""
    paths.check_job(job)
    if step is None:
        names = storage.list_dir(job)
        steps = sorted((x for x in map(paths.parse_step_dir, names) if x is not None),
                       reverse=True)
        damaged: list[tuple[int, CorruptCheckpointError]] = []
        for s in steps:
            try:
                rec = read_commit(storage, job, s)
            except CorruptCheckpointError as exc:  # as list_steps: not loadable, skipped
                log.warning("ckptd: skipping step %d of job %s, whose COMMITTED marker is "
                            "damaged: %s", s, job, exc)
                damaged.append((s, exc))
                continue
            if rec is not None:
                return rec
        where = f"{storage.url}/{job}"
        if damaged:
            raise CorruptCheckpointError(
                f"job {job!r} in {storage.url} has no loadable committed checkpoint: the "
                f"COMMITTED markers of steps {[s for s, _ in damaged]} are damaged (step "
                f"{damaged[0][0]}: {damaged[0][1]})"
            ) from damaged[0][1]
        if not names:
            raise CheckpointNotFoundError(
                f"no checkpoint of job {job!r} in {storage.url}: nothing is stored under "
                f"{where}. Check the job name and storage URI, or save a checkpoint first."
            )
        if not steps:
            shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
            raise CheckpointNotFoundError(
                f"{where} is not a ckptd job: expected step directories (12-digit step "
                f"numbers such as 000000000100), found {shown}. Check the job name and storage "
                "URI: URI/JOB names the job's directory under the storage root."
            )
        raise CheckpointNotFoundError(
            f"job {job!r} in {storage.url} has no committed checkpoint (found only "
            "uncommitted attempts, e.g. from saves that failed or are still running). Wait "
            "for a save to commit or check the save's error."
        )
    paths.check_step(step)
    rec = read_commit(storage, job, step)
    if rec is None:
        have = committed_steps(storage, job)
        raise CheckpointNotFoundError(
            f"step {step} of job {job!r} in {storage.url} is not committed; committed steps: "
            f"{have if have else 'none'}. Pick one of those."
        )
    return rec


def read_index(storage: StorageBackend, rec: CommitRecord) -> Index:
    prefix = paths.attempt_prefix(rec.job, rec.step, rec.attempt)
    key = paths.index_key(prefix)
    try:
        data = storage.get(key)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"step {rec.step} of job {rec.job!r} is marked committed but {key} is missing; "
            "the checkpoint was damaged after it committed. Load an earlier step."
        ) from None
    return Index.from_json(loads(data, key), key)
