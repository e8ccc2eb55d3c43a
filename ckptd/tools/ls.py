"""``ckptd ls URI[/JOB]``: jobs of a storage root, or the steps of one job.

A step is listed with its status (``committed``, or ``uncommitted`` when no attempt of it
committed), the committed attempt, world size, framework, the bytes stored under the step
(all attempts) and its age (since ``COMMITTED`` was written, or since the newest object of
an uncommitted step).  Reads only listings, ``COMMITTED`` records and the small zarr group
documents, never the index or the data.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ckptd.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckptd.format import paths
from ckptd.format.commit import list_jobs, read_commit
from ckptd.storage import open_storage
from ckptd.storage.base import StorageBackend
from ckptd.tools.common import (
    human_age,
    human_bytes,
    print_json,
    print_table,
    split_job_uri,
    strip_slashes,
)


def _framework(storage: StorageBackend, job: str, step: int, attempt: str) -> str | None:
    key = f"{paths.attempt_prefix(job, step, attempt)}/zarr.json"
    try:
        doc = json.loads(storage.get(key))
        return str(doc["attributes"]["ckptd"]["framework"])
    except (FileNotFoundError, KeyError, TypeError, ValueError):
        return None


def step_rows(storage: StorageBackend, job: str, now: float | None = None) -> list[dict[str, Any]]:
    """One dict per step directory of ``job``, oldest first."""
    now = time.time() if now is None else now
    steps = sorted(s for s in map(paths.parse_step_dir, storage.list_dir(job)) if s is not None)

    def one(step: int) -> dict[str, Any]:
        sdir = paths.step_dir(job, step)
        objs = storage.list_objects(sdir)
        damaged = None
        try:
            rec = read_commit(storage, job, step)
        except CorruptCheckpointError as exc:  # shown as damaged; the other steps still list
            rec, damaged = None, str(exc)
        attempts: dict[str, int] = {}
        newest: float | None = None
        for key, info in objs.items():
            rel = key[len(sdir) + 1:]
            name = rel.split("/", 1)[0]
            if name != "COMMITTED":
                attempts[name] = attempts.get(name, 0) + info.size
            if info.mtime is not None:
                newest = info.mtime if newest is None else max(newest, info.mtime)
        committed_mtime = objs.get(f"{sdir}/COMMITTED")
        ref = committed_mtime.mtime if committed_mtime is not None else newest
        return {
            "step": step,
            "committed": rec is not None,
            "damaged": damaged,
            "attempt": rec.attempt if rec else None,
            "world_size": rec.world_size if rec else None,
            "framework": _framework(storage, job, step, rec.attempt) if rec else None,
            "bytes": attempts.get(rec.attempt, 0) if rec else 0,
            "bytes_all_attempts": sum(attempts.values()),
            "other_attempts": sorted(a for a in attempts if not rec or a != rec.attempt),
            "age_s": None if ref is None else round(now - ref, 3),
        }

    with ThreadPoolExecutor(max_workers=8) as pool:
        rows = list(pool.map(one, steps))
    # object stores list no directories, but some (SeaweedFS) keep empty ones: a step
    # without any object does not exist
    return [r for r in rows if r["committed"] or r["damaged"] or r["bytes_all_attempts"]
            or r["other_attempts"]]


def job_rows(storage: StorageBackend, now: float | None = None) -> list[dict[str, Any]]:
    out = []
    for job in list_jobs(storage):
        steps = step_rows(storage, job, now)
        if not steps:
            continue
        committed = [s for s in steps if s["committed"]]
        latest = committed[-1] if committed else None
        out.append({
            "job": job,
            "steps": len(steps),
            "committed_steps": len(committed),
            "latest_step": latest["step"] if latest else None,
            "world_size": latest["world_size"] if latest else None,
            "framework": latest["framework"] if latest else None,
            "bytes": sum(s["bytes_all_attempts"] for s in steps),
            "age_s": (latest or steps[-1])["age_s"],
        })
    return out


def _status(row: dict[str, Any]) -> str:
    if row["committed"]:
        return "committed"
    return "damaged COMMITTED" if row["damaged"] else "uncommitted"


def run(args: argparse.Namespace) -> int:
    uri = strip_slashes(args.uri)
    storage = None
    job = None
    try:
        root, cand = split_job_uri(uri)
        s = open_storage(root)
        if any(paths.parse_step_dir(n) is not None for n in s.list_dir(cand)):
            storage, job = s, cand
        else:
            s.close()
    except Exception:  # noqa: BLE001 - not URI/JOB: a storage root
        storage = None
    if storage is None:
        storage = open_storage(uri)
    try:
        if job is not None:
            rows = step_rows(storage, job)
            if args.json:
                print_json({"storage": storage.url, "job": job, "steps": rows})
                return 0
            print_table(f"{storage.url}/{job}",
                        ["STEP", "STATUS", "WORLD", "FRAMEWORK", "SIZE", "AGE", "ATTEMPT",
                         "OTHER ATTEMPTS"],
                        [[r["step"], _status(r),
                          r["world_size"] or "", r["framework"] or "",
                          human_bytes(r["bytes"] if r["committed"] else r["bytes_all_attempts"]),
                          human_age(r["age_s"]), r["attempt"] or "",
                          len(r["other_attempts"]) or ""] for r in rows],
                        right=["STEP", "WORLD", "SIZE", "AGE", "OTHER ATTEMPTS"])
            for r in rows:
                if r["damaged"]:
                    print(f"step {r['step']} is not loadable: {r['damaged']}")
            return 0
        rows = job_rows(storage)
        if not rows and not args.json:
            raise CheckpointNotFoundError(
                f"no checkpoints under {storage.url}: expected a storage root holding jobs, or "
                "URI/JOB. Check the URI."
            )
        if args.json:
            print_json({"storage": storage.url, "jobs": rows})
            return 0
        print_table(storage.url,
                    ["JOB", "STEPS", "COMMITTED", "LATEST", "WORLD", "FRAMEWORK", "SIZE", "AGE"],
                    [[r["job"], r["steps"], r["committed_steps"],
                      "" if r["latest_step"] is None else r["latest_step"],
                      r["world_size"] or "", r["framework"] or "", human_bytes(r["bytes"]),
                      human_age(r["age_s"])] for r in rows],
                    right=["STEPS", "COMMITTED", "LATEST", "WORLD", "SIZE", "AGE"])
        return 0
    finally:
        storage.close()


def add_parser(sub: Any) -> None:
    p = sub.add_parser("ls", help="list jobs, or the steps of a job",
                       description="List the jobs of a storage root (URI), or the steps of one "
                       "job (URI/JOB): committed or not, world size, framework, size, age.")
    p.add_argument("uri", metavar="URI[/JOB]", help="e.g. file:///ckpt, s3://bucket/prefix/myjob")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
