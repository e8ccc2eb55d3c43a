"""``ckptd gc URI/JOB --keep-last K [--keep-every M] [--grace 1h] [--dry-run]``: retention.

:func:`apply_retention` is the policy; the CLI and the daemon (after each commit) call it.

* Committed steps: keep the newest ``keep_last`` (>= 1, so the newest committed step is
  never deleted) and, with ``keep_every`` M, every step divisible by M; delete the others.
  A deleted step loses its ``COMMITTED`` marker first (one batched delete), so a crash
  midway leaves only uncommitted leftovers, never a committed step with missing objects.
* Uncommitted leftovers (attempts that never committed, attempts superseded by a later
  commit of the same step, e.g. the old attempt after an in-place ``ckptd reshard``):
  deleted only when older than ``grace_s``.  Age is measured from the newest object of
  the attempt and, for a superseded attempt, from the step's ``COMMITTED`` too, so a
  reader that started on the old attempt just before the switch keeps it for the grace
  period.  An attempt whose age the backend cannot tell is kept.
* A step whose ``COMMITTED`` marker is damaged (unreadable) is kept whole and listed in
  ``damaged_steps``: which attempt it committed is unknown.
* Objects are deleted in parallel: prefixes on a thread pool, and on S3 each prefix in
  batches of 1000 keys per request, several requests in flight.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptd.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from ckptd.format import paths
from ckptd.format.commit import read_commit
from ckptd.storage.base import StorageBackend
from ckptd.tools.common import (
    human_age,
    human_bytes,
    open_job,
    parse_duration,
    print_json,
    print_table,
)

DEFAULT_GRACE_S = 3600.0
_DAMAGED = object()  # scan result of a step whose COMMITTED marker is damaged
log = logging.getLogger("ckptd.tools")


@dataclass(slots=True)
class Removal:
    step: int
    attempt: str | None  # None: the whole step directory (a committed step)
    reason: str  # "retention" or "leftover"
    objects: int
    bytes: int
    age_s: float | None


@dataclass(slots=True)
class GcReport:
    job: str
    dry_run: bool
    kept_steps: list[int] = field(default_factory=list)
    deleted_steps: list[int] = field(default_factory=list)
    #: steps whose COMMITTED marker is damaged: nothing of them is deleted
    damaged_steps: list[int] = field(default_factory=list)
    removals: list[Removal] = field(default_factory=list)
    protected: list[Removal] = field(default_factory=list)  # leftovers younger than grace
    objects_deleted: int = 0
    bytes_deleted: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["seconds"] = round(self.seconds, 3)
        return d


def _check(keep_last: int, keep_every: int | None, grace_s: float) -> None:
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ConfigError(
            f"--keep-last must be an integer >= 1 (the newest committed step is always kept); "
            f"got {keep_last!r}"
        )
    if keep_every is not None and (isinstance(keep_every, bool) or not isinstance(keep_every, int)
                                   or keep_every < 1):
        raise ConfigError(f"--keep-every must be an integer >= 1, got {keep_every!r}")
    if not isinstance(grace_s, (int, float)) or grace_s < 0:
        raise ConfigError(f"the grace period must be >= 0 seconds, got {grace_s!r}")


def plan_retention(committed: list[int], keep_last: int, keep_every: int | None,
                   keep_steps: Iterable[int] = ()) -> set[int]:
    """The committed steps to keep (pure)."""
    keep = set(sorted(committed)[-keep_last:]) if committed else set()
    if keep_every:
        keep |= {s for s in committed if s % keep_every == 0}
    return keep | (set(keep_steps) & set(committed))


def apply_retention(storage: StorageBackend, job: str, keep_last: int,
                    keep_every: int | None = None, grace_s: float = DEFAULT_GRACE_S,
                    dry_run: bool = False, *, now: float | None = None,
                    threads: int = 16, keep_steps: Iterable[int] = ()) -> GcReport:
    """Apply the retention policy to ``job`` (see the module docstring); returns what was
    (or, with ``dry_run``, would be) deleted.  ``now`` overrides the clock (tests).
    ``keep_steps``: committed steps kept whatever their number (the daemon passes the step
    it just committed: a job that resumed from an older step saves below the numbers of the
    steps it rolled back from, and its newest checkpoint must not go)."""
    _check(keep_last, keep_every, grace_s)
    paths.check_job(job)
    t0 = time.monotonic()
    now = time.time() if now is None else now
    report = GcReport(job, dry_run)
    steps = sorted(s for s in map(paths.parse_step_dir, storage.list_dir(job)) if s is not None)

    def scan(step: int) -> tuple[int, Any, dict[str, Any]]:
        sdir = paths.step_dir(job, step)
        try:
            rec = read_commit(storage, job, step)
        except CorruptCheckpointError as exc:
            # Whether the step was committed, and which attempt, is unknown: keep all of it
            # (an operator may repair the marker) and go on with the other steps.
            log.warning("ckptd gc: keeping step %d of job %s, whose COMMITTED marker is "
                        "damaged: %s", step, job, exc)
            return step, _DAMAGED, {}
        return step, rec, storage.list_objects(sdir)

    with ThreadPoolExecutor(max_workers=min(threads, max(1, len(steps)))) as pool:
        scanned = list(pool.map(scan, steps))
    report.damaged_steps = [s for s, rec, _ in scanned if rec is _DAMAGED]
    scanned = [x for x in scanned if x[1] is not _DAMAGED]
    committed = [s for s, rec, _ in scanned if rec is not None]
    keep = plan_retention(committed, keep_last, keep_every, keep_steps)
    report.kept_steps = sorted(keep)
    doomed_markers: list[str] = []
    prefixes: list[tuple[str, Removal]] = []
    for step, rec, objs in scanned:
        sdir = paths.step_dir(job, step)
        attempts: dict[str, list[Any]] = {}
        for key, info in objs.items():
            name = key[len(sdir) + 1:].split("/", 1)[0]
            if name != "COMMITTED":
                attempts.setdefault(name, []).append(info)
        marker = objs.get(f"{sdir}/COMMITTED")
        delete_step = rec is not None and step not in keep
        if delete_step:
            report.deleted_steps.append(step)
            doomed_markers.append(paths.committed_key(job, step))
        for name, infos in sorted(attempts.items()):
            size = sum(i.size for i in infos)
            mtimes = [i.mtime for i in infos]
            if rec is not None and name == rec.attempt:
                if delete_step:
                    r = Removal(step, name, "retention", len(infos), size, None)
                    prefixes.append((f"{sdir}/{name}", r))
                continue
            # a leftover: never committed, or superseded by the committed attempt
            if any(m is None for m in mtimes):
                age = None
            else:
                newest = max(mtimes) if mtimes else now
                if rec is not None and marker is not None and marker.mtime is not None:
                    newest = max(newest, marker.mtime)
                age = now - newest
            r = Removal(step, name, "leftover", len(infos), size,
                        None if age is None else round(age, 3))
            if age is not None and age >= grace_s:
                prefixes.append((f"{sdir}/{name}", r))
            else:
                report.protected.append(r)
    report.removals = [r for _, r in prefixes]
    report.objects_deleted = sum(r.objects for r in report.removals) + len(doomed_markers)
    report.bytes_deleted = sum(r.bytes for r in report.removals)
    if not dry_run:
        if doomed_markers:
            storage.delete(doomed_markers)  # uncommit first: no half-deleted committed step
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckptd-gc") as pool:
            list(pool.map(lambda pr: storage.delete_prefix(pr[0]), prefixes))
        _prune_empty_dirs(storage, job, [s for s, _, _ in scanned])
    report.seconds = time.monotonic() - t0
    return report


def _prune_empty_dirs(storage: StorageBackend, job: str, steps: list[int]) -> None:
    """Remove step directories left empty on a local filesystem.  ``rmdir`` only removes
    an empty directory, and only step directories of this scan are tried (never anything
    inside an attempt that may be being written)."""
    from ckptd.storage.fsspec_backend import LocalBackend

    if not isinstance(storage, LocalBackend):
        return
    for s in steps:
        try:
            os.rmdir(os.path.join(storage.root, paths.step_dir(job, s)))
        except OSError:
            pass


def run(args: argparse.Namespace) -> int:
    storage, job = open_job(args.uri)
    grace = parse_duration(args.grace)
    try:
        if not any(paths.parse_step_dir(n) is not None for n in storage.list_dir(job)):
            # a mistyped job (or a storage root given as URI/JOB) would "succeed" deleting
            # nothing, and the operator would believe the policy applied
            raise CheckpointNotFoundError(
                f"no checkpoint of job {job!r} in {storage.url}: nothing under "
                f"{storage.url}/{job} is a step directory. Check the job name and storage "
                "URI: gc takes URI/JOB, e.g. file:///ckpt/myjob (`ckptd ls URI` lists the jobs)."
            )
        report = apply_retention(storage, job, args.keep_last, args.keep_every, grace,
                                 args.dry_run)
    finally:
        storage.close()
    if args.json:
        print_json(report.to_json())
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{storage.url}/{job}: keeping steps {report.kept_steps or 'none'}; {verb} "
          f"{len(report.deleted_steps)} steps and {len([r for r in report.removals if r.reason == 'leftover'])} "
          f"leftover attempts: {report.objects_deleted} objects, "
          f"{human_bytes(report.bytes_deleted)} in {report.seconds:.1f}s")
    if report.removals:
        print_table(None, ["STEP", "ATTEMPT", "REASON", "OBJECTS", "SIZE", "AGE"],
                    [[r.step, r.attempt, r.reason, r.objects, human_bytes(r.bytes),
                      human_age(r.age_s)] for r in report.removals],
                    right=["STEP", "OBJECTS", "SIZE", "AGE"])
    if report.damaged_steps:
        print(f"kept steps {report.damaged_steps} whole: their COMMITTED markers are damaged "
              "(see `ckptd verify --all`)")
    if report.protected:
        print(f"kept {len(report.protected)} uncommitted attempts younger than the grace "
              f"period ({human_age(grace)}): " + ", ".join(
                  f"{r.step}/{r.attempt} ({human_age(r.age_s)})" for r in report.protected))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("gc", help="delete old steps and stale uncommitted attempts",
                       description="Keep the newest K committed steps (and every M-th), delete "
                       "the rest, and delete uncommitted leftovers older than the grace period. "
                       "Never deletes the newest committed step.")
    p.add_argument("uri", metavar="URI/JOB", help="e.g. file:///ckpt/myjob")
    p.add_argument("--keep-last", type=int, required=True, metavar="K",
                   help="committed steps to keep (>= 1)")
    p.add_argument("--keep-every", type=int, default=None, metavar="M",
                   help="also keep every committed step divisible by M")
    p.add_argument("--grace", default="1h",
                   help="uncommitted attempts younger than this are kept (default 1h; e.g. "
                   "90s, 30m, 2d)")
    p.add_argument("--dry-run", action="store_true", help="show what would be deleted")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)
