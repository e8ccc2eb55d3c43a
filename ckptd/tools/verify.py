"""``ckptd verify URI/JOB [--step N | --all]``: is a committed checkpoint intact?

For each committed step checked:

1. every rank manifest ``_ranks/0..W-1`` is present and parses, and ``index.json`` is what
   they consolidate to;
2. every array's ``zarr.json`` matches the index (shape, chunk grid, data type) and is the
   document ckptd writes for it (codec, chunk keys, fill value, torch dtype attribute); the
   attempt's group ``zarr.json`` names the commit and every intermediate group has one;
3. every element of every logical tensor is covered by exactly one stored piece, and every
   piece points at something that exists (a recorded chunk, a pack byte range, a flat
   array range);
4. every chunk and pack object is read whole (``threads`` at a time, one object in memory
   per thread) and its size and crc32c compared with the index; so is every packed tensor.

Problems are reported as records (step, kind, what, chunk, expected, found, key); the
command exits 1 if there is any, 0 otherwise.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from ckptd import FORMAT_VERSION
from ckptd.errors import CheckpointNotFoundError, CkptdError, CorruptCheckpointError
from ckptd.format import paths
from ckptd.format.checksum import crc32c
from ckptd.format.commit import CommitRecord, present_ranks, read_commit, resolve_step
from ckptd.format.dtypes import itemsize, zarr_data_type
from ckptd.format.layout import Region, chunks_overlapping, intersect, is_row_range
from ckptd.format.manifest import Index, Piece, RankManifest, loads
from ckptd.format.plan import chunk_id, chunk_key
from ckptd.format.zarr_meta import array_doc, parent_groups
from ckptd.storage.base import StorageBackend
from ckptd.tools.common import (
    human_bytes,
    open_job,
    print_json,
    print_table,
    progress_bar,
    thread_count,
)


@dataclass(frozen=True, slots=True)
class Problem:
    step: int
    kind: str  # commit, manifest, index, metadata, coverage, missing, size, checksum
    what: str  # array, tensor or document
    chunk: str | None = None
    expected: str | None = None
    found: str | None = None
    key: str | None = None

    def line(self) -> str:
        s = f"step {self.step}: {self.kind}: {self.what}"
        if self.chunk is not None:
            s += f" chunk {self.chunk or '(0-d)'}"
        if self.expected is not None or self.found is not None:
            s += f": expected {self.expected}, found {self.found}"
        if self.key:
            s += f" ({self.key})"
        return s


@dataclass(slots=True)
class StepReport:
    step: int
    attempt: str | None  # None: the step's COMMITTED marker is damaged
    world_size: int | None
    problems: list[Problem]
    objects: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "attempt": self.attempt, "world_size": self.world_size,
                "ok": not self.problems, "objects_read": self.objects,
                "bytes_read": self.bytes_read, "seconds": round(self.seconds, 3),
                "problems": [asdict(p) for p in self.problems]}


def _coverage(step: int, name: str, t: Any, index: Index) -> list[Problem]:
    """Pieces of tensor ``name`` cover it exactly once and point at stored data."""
    out: list[Problem] = []
    shape = tuple(t.shape)
    numel = math.prod(shape)
    isz = itemsize(t.dtype)
    total = 0
    boxes: list[Region] = []
    for p in t.pieces:
        what = f"tensor {name!r}"
        if not p.region.within(shape):
            out.append(Problem(step, "coverage", what, expected=f"pieces inside {shape}",
                               found=f"piece {p.region.to_json()}"))
            continue
        total += p.region.numel
        boxes.append(p.region)
        out += _piece_source(step, name, p, shape, isz, index)
    if total != numel:
        out.append(Problem(step, "coverage", f"tensor {name!r}",
                           expected=f"{numel} elements covered once",
                           found=f"pieces covering {total} elements"))
    elif len(boxes) > 1 and not _disjoint(boxes, shape):
        out.append(Problem(step, "coverage", f"tensor {name!r}",
                           expected="every element covered exactly once",
                           found="overlapping pieces (and hence uncovered elements)"))
    return out


def _disjoint(boxes: list[Region], shape: tuple[int, ...]) -> bool:
    if shape and all(is_row_range(b, shape) for b in boxes):
        rows = sorted((b.offsets[0], b.offsets[0] + b.shape[0]) for b in boxes if b.numel)
        return all(a[1] <= b[0] for a, b in itertools.pairwise(rows))
    nz = [b for b in boxes if b.numel]
    for i in range(len(nz)):
        for j in range(i + 1, len(nz)):
            x = intersect(nz[i], nz[j])
            if x is not None and x.numel:
                return False
    return True


def _piece_source(step: int, name: str, p: Piece, shape: tuple[int, ...], isz: int,
                  index: Index) -> list[Problem]:
    what = f"tensor {name!r}"
    if p.pack is not None:
        size = index.packs.get(p.pack)
        lo, n = p.byte_offset or 0, p.nbytes or 0
        if size is None:
            return [Problem(step, "coverage", what, expected=f"pack {p.pack!r} in the index",
                            found="no such pack")]
        if n != p.region.numel * isz or lo + n > size:
            return [Problem(step, "coverage", what, expected=f"{p.region.numel * isz} bytes "
                            f"inside pack {p.pack!r} of {size} bytes",
                            found=f"bytes [{lo}, {lo + n})")]
        return []
    a = index.arrays.get(p.array or "")
    if a is None:
        return [Problem(step, "coverage", what, expected=f"array {p.array!r} in the index",
                        found="no such array")]
    if p.flat_start is not None:
        n = math.prod(shape)
        if len(a.shape) != 1 or p.flat_start + n > a.shape[0]:
            return [Problem(step, "coverage", what,
                            expected=f"elements [{p.flat_start}, {p.flat_start + n}) of "
                            f"array {p.array!r}", found=f"array shape {a.shape}")]
        if n == 0:
            return []
        c = a.chunk_shape[0]
        need: list[tuple[int, ...]] = [(k,) for k in range(p.flat_start // c, (p.flat_start + n - 1) // c + 1)]
    else:
        if p.array_offsets is None:
            return [Problem(step, "coverage", what, expected="a stored source",
                            found="a piece with neither array offsets nor a flat start")]
        box = Region(tuple(p.array_offsets), p.region.shape)
        if not box.within(a.shape):
            return [Problem(step, "coverage", what, expected=f"a box inside {p.array!r} "
                            f"{a.shape}", found=str(box.to_json()))]
        need = list(chunks_overlapping(box, a.chunk_shape)) if box.numel else []
    out = []
    for coords in need:
        cid = chunk_id(coords)
        if cid not in a.chunks:
            out.append(Problem(step, "missing", f"array {p.array!r}", cid,
                               expected="a recorded chunk (tensor " + repr(name) + " needs it)",
                               found="never written"))
    return out


def _check_manifests(storage: StorageBackend, step: int, prefix: str, index: Index | None,
                     world: int) -> list[Problem]:
    out: list[Problem] = []
    present = present_ranks(storage, prefix)
    for r in sorted(set(range(world)) - present):
        out.append(Problem(step, "manifest", f"rank {r} manifest", expected="present",
                           found="missing", key=paths.rank_manifest_key(prefix, r)))
    for r in sorted(present - set(range(world))):
        out.append(Problem(step, "manifest", f"rank {r} manifest",
                           expected=f"ranks 0..{world - 1}", found=f"rank {r}",
                           key=paths.rank_manifest_key(prefix, r)))
    ms: list[RankManifest] = []
    for r in sorted(present & set(range(world))):
        key = paths.rank_manifest_key(prefix, r)
        try:
            ms.append(RankManifest.from_json(loads(storage.get(key), key), key))
        except FileNotFoundError:
            out.append(Problem(step, "manifest", f"rank {r} manifest", expected="present",
                               found="missing", key=key))
        except CkptdError as exc:
            out.append(Problem(step, "manifest", f"rank {r} manifest", expected="valid",
                               found=str(exc), key=key))
    if out or index is None:
        return out
    try:
        merged = Index.merge(ms).to_json()
    except CkptdError as exc:
        return [Problem(step, "manifest", "rank manifests", expected="consistent",
                        found=str(exc))]
    have = index.to_json()
    if merged != have:
        diff = sorted(k for k in set(merged) | set(have) if merged.get(k) != have.get(k))
        detail = diff
        for k in ("arrays", "tensors", "packs"):
            if k in diff:
                a, b = merged[k], have[k]
                names = sorted(n for n in set(a) | set(b) if a.get(n) != b.get(n))
                detail = [f"{k}: {', '.join(names[:5])}"]
                break
        out.append(Problem(step, "index", "index.json", expected="the consolidated rank "
                           "manifests", found=f"differences in {detail}",
                           key=paths.index_key(prefix)))
    return out


def _check_meta(storage: StorageBackend, step: int, prefix: str, name: str,
                rec: Any) -> list[Problem]:
    key = f"{prefix}/{name}/zarr.json"
    try:
        doc = json.loads(storage.get(key))
    except FileNotFoundError:
        return [Problem(step, "metadata", f"array {name!r}", expected="zarr.json",
                        found="missing", key=key)]
    except ValueError as exc:
        return [Problem(step, "metadata", f"array {name!r}", expected="valid JSON",
                        found=str(exc), key=key)]
    try:
        shape = tuple(doc["shape"])
        chunks = tuple(doc["chunk_grid"]["configuration"]["chunk_shape"])
        dt = doc["data_type"]
    except (KeyError, TypeError) as exc:
        return [Problem(step, "metadata", f"array {name!r}", expected="a zarr v3 array",
                        found=f"missing {exc}", key=key)]
    want = (tuple(rec.shape), tuple(rec.chunk_shape), zarr_data_type(rec.dtype))
    if (shape, chunks, dt) != want:
        return [Problem(step, "metadata", f"array {name!r}",
                        expected=f"shape {want[0]} chunks {want[1]} {want[2]}",
                        found=f"shape {shape} chunks {chunks} {dt}", key=key)]
    # The rest of the document decides how other zarr readers decode the chunks (byte
    # order, chunk keys, the torch dtype behind uint16/uint8 words): it must be what ckptd
    # writes for this array.
    ref = array_doc(rec.shape, rec.dtype, rec.chunk_shape)
    attrs = doc.get("attributes")
    ours = attrs.get("ckptd") if isinstance(attrs, dict) else None
    got = {k: doc.get(k) for k in ref if k != "attributes"}
    got["attributes.ckptd.torch_dtype"] = ours.get("torch_dtype") if isinstance(ours, dict) else None
    ref = {k: v for k, v in ref.items() if k != "attributes"}
    ref["attributes.ckptd.torch_dtype"] = rec.dtype
    bad = [k for k in ref if got[k] != ref[k]]
    if bad:
        return [Problem(step, "metadata", f"array {name!r}",
                        expected="; ".join(f"{k} {json.dumps(ref[k])}" for k in bad),
                        found="; ".join(f"{k} {json.dumps(got[k])}" for k in bad), key=key)]
    return []


def _check_groups(storage: StorageBackend, rec: CommitRecord, prefix: str,
                  index: Index) -> list[Problem]:
    """The attempt's group ``zarr.json`` (its ``ckptd`` attributes name the commit) and
    every intermediate group's, which zarr readers need to open the arrays."""
    out: list[Problem] = []
    want_attrs = {"format_version": FORMAT_VERSION, "job": rec.job, "step": rec.step,
                  "attempt": rec.attempt, "world_size": rec.world_size,
                  "framework": index.framework, "index": "index.json"}
    for g in [""] + parent_groups(list(index.arrays)):
        key = f"{prefix}/{g}/zarr.json" if g else f"{prefix}/zarr.json"
        what = f"group {g!r}" if g else "attempt group"
        try:
            doc = json.loads(storage.get(key))
        except FileNotFoundError:
            out.append(Problem(rec.step, "metadata", what, expected="zarr.json",
                               found="missing", key=key))
            continue
        except ValueError as exc:
            out.append(Problem(rec.step, "metadata", what, expected="valid JSON",
                               found=str(exc), key=key))
            continue
        if not isinstance(doc, dict) or (doc.get("zarr_format"), doc.get("node_type")) != (
                3, "group"):
            out.append(Problem(rec.step, "metadata", what, expected="a zarr v3 group",
                               found=f"zarr_format {doc.get('zarr_format')!r}, node_type "
                               f"{doc.get('node_type')!r}" if isinstance(doc, dict)
                               else type(doc).__name__, key=key))
            continue
        if g:
            continue
        attrs = doc.get("attributes")
        ours = attrs.get("ckptd") if isinstance(attrs, dict) else None
        ours = ours if isinstance(ours, dict) else {}
        bad = [k for k in want_attrs if ours.get(k) != want_attrs[k]]
        if bad:
            out.append(Problem(rec.step, "metadata", what,
                               expected="; ".join(f"ckptd.{k} {json.dumps(want_attrs[k])}"
                                                  for k in bad),
                               found="; ".join(f"ckptd.{k} {json.dumps(ours.get(k))}"
                                               for k in bad), key=key))
    return out


def verify_step(storage: StorageBackend, rec: CommitRecord, *, threads: int = 8,
                on_bytes: Any = None) -> StepReport:
    t0 = time.monotonic()
    step = rec.step
    prefix = paths.attempt_prefix(rec.job, step, rec.attempt)
    report = StepReport(step, rec.attempt, rec.world_size, [])
    index: Index | None = None
    key = paths.index_key(prefix)
    try:
        index = Index.from_json(loads(storage.get(key), key), key)
    except FileNotFoundError:
        report.problems.append(Problem(step, "index", "index.json", expected="present",
                                       found="missing", key=key))
    except CkptdError as exc:
        report.problems.append(Problem(step, "index", "index.json", expected="valid",
                                       found=str(exc), key=key))
    report.problems += _check_manifests(storage, step, prefix, index, rec.world_size)
    if index is None:
        report.seconds = time.monotonic() - t0
        return report
    report.problems += _check_groups(storage, rec, prefix, index)
    for name in sorted(index.tensors):
        report.problems += _coverage(step, name, index.tensors[name], index)

    pack_pieces: dict[str, list[tuple[str, Piece]]] = {}
    for name, t in index.tensors.items():
        for p in t.pieces:
            if p.pack is not None:
                pack_pieces.setdefault(p.pack, []).append((name, p))
    jobs = [(name, cid) for name in sorted(index.arrays)
            for cid in sorted(index.arrays[name].chunks)]

    def check_object(job: tuple[str, str]) -> tuple[list[Problem], int]:
        name, cid = job
        a = index.arrays[name]
        c = a.chunks[cid]
        coords = tuple(int(x) for x in cid.split(".")) if cid else ()
        k = f"{prefix}/{name}/{chunk_key(coords)}"
        try:
            data = storage.get(k)
        except FileNotFoundError:
            return [Problem(step, "missing", f"array {name!r}", cid, expected=f"{c.nbytes} bytes",
                            found="no object", key=k)], 0
        probs = []
        if len(data) != c.nbytes:
            probs.append(Problem(step, "size", f"array {name!r}", cid, expected=f"{c.nbytes} bytes",
                                 found=f"{len(data)} bytes", key=k))
        got = crc32c(data)
        if got != c.crc32c:
            probs.append(Problem(step, "checksum", f"array {name!r}", cid,
                                 expected=f"crc32c {c.crc32c:#010x}", found=f"crc32c {got:#010x}",
                                 key=k))
        mv = memoryview(data)
        for tname, p in pack_pieces.get(name, []):
            lo, n = p.byte_offset or 0, p.nbytes or 0
            if lo + n <= len(data):
                pc = crc32c(mv[lo:lo + n])
                if pc != (p.crc32c or 0):
                    probs.append(Problem(step, "checksum", f"tensor {tname!r} in pack {name!r}",
                                         None, expected=f"crc32c {p.crc32c or 0:#010x}",
                                         found=f"crc32c {pc:#010x}", key=f"{k} [{lo}, {lo + n})"))
        if on_bytes is not None:
            on_bytes(len(data))
        return probs, len(data)

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        metas = list(pool.map(lambda n: _check_meta(storage, step, prefix, n, index.arrays[n]),
                              sorted(index.arrays)))
        for probs in metas:
            report.problems += probs
        for probs, n in pool.map(check_object, jobs):
            report.problems += probs
            report.bytes_read += n
            report.objects += 1
    report.seconds = time.monotonic() - t0
    return report


def _commit_or_problem(storage: StorageBackend, job: str,
                       step: int) -> CommitRecord | StepReport | None:
    """The step's commit record; a report with one ``commit`` problem if its COMMITTED
    marker is damaged; None if it has none."""
    try:
        return read_commit(storage, job, step)
    except CorruptCheckpointError as exc:
        key = paths.committed_key(job, step)
        return StepReport(step, None, None, [Problem(
            step, "commit", "COMMITTED marker", expected="a valid commit record",
            found=str(exc), key=key)])


def verify(storage: StorageBackend, job: str, step: int | None = None, all_steps: bool = False,
           *, threads: int = 8, on_bytes: Any = None) -> list[StepReport]:
    """Verify one committed step (latest if None) or, with ``all_steps``, every one.

    A step whose ``COMMITTED`` marker is damaged is a report with a ``commit`` problem;
    without ``step``, damaged markers of steps newer than the latest loadable step are
    reported too (loading skips them)."""
    paths.check_job(job)
    found: list[CommitRecord | StepReport] = []
    if all_steps or step is None:
        steps = sorted(s for s in map(paths.parse_step_dir, storage.list_dir(job)) if s is not None)
        for s in steps if all_steps else reversed(steps):
            r = _commit_or_problem(storage, job, s)
            if r is not None:
                found.append(r)
                if not all_steps and isinstance(r, CommitRecord):
                    break  # the latest loadable step
        found.sort(key=lambda r: r.step)
        if not found:
            resolve_step(storage, job, None)  # raises the right "not found" error
            raise CheckpointNotFoundError(f"job {job!r} has no committed step")
    else:
        paths.check_step(step)
        r = _commit_or_problem(storage, job, step)
        found = [r if r is not None else resolve_step(storage, job, step)]
    return [r if isinstance(r, StepReport) else
            verify_step(storage, r, threads=threads, on_bytes=on_bytes) for r in found]


def run(args: argparse.Namespace) -> int:
    if args.all and args.step is not None:
        from ckptd.errors import ConfigError

        raise ConfigError("give either --step N or --all, not both")
    storage, job = open_job(args.uri)
    try:
        total = 0
        if not args.json:
            from ckptd.format.commit import read_index

            try:
                recs = [resolve_step(storage, job, args.step)] if not args.all else []
                total = sum(read_index(storage, r).total_bytes for r in recs)
            except CkptdError:
                total = 0
        with progress_bar("verify", total, enabled=not args.json and total > 0) as advance:
            reports = verify(storage, job, args.step, args.all, threads=args.threads,
                             on_bytes=advance)
    finally:
        storage.close()
    ok = all(not r.problems for r in reports)
    if args.json:
        print_json({"storage": storage.url, "job": job, "ok": ok,
                    "steps": [r.to_json() for r in reports]})
        return 0 if ok else 1
    for r in reports:
        status = "OK" if not r.problems else f"{len(r.problems)} PROBLEMS"
        if r.attempt is None:
            print(f"{storage.url}/{job} step {r.step}: {status}; its COMMITTED marker is "
                  "damaged, so the step is not loadable: load and the tools use an earlier "
                  "step, and `ckptd gc` keeps this step's objects.")
            print_table(None, ["KIND", "WHAT", "EXPECTED", "FOUND", "KEY"],
                        [[p.kind, p.what, p.expected, p.found, p.key] for p in r.problems])
            continue
        print(f"{storage.url}/{job} step {r.step} (attempt {r.attempt}, world size "
              f"{r.world_size}): {status}; read {r.objects} objects, {human_bytes(r.bytes_read)} "
              f"in {r.seconds:.1f}s")
        if r.problems:
            print_table(None, ["KIND", "WHAT", "CHUNK", "EXPECTED", "FOUND", "KEY"],
                        [[p.kind, p.what, p.chunk, p.expected, p.found, p.key]
                         for p in r.problems])
    return 0 if ok else 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser("verify", help="check that a checkpoint is intact (exit 0/1)",
                       description="Read every chunk of a committed checkpoint and check its "
                       "checksum, the manifests' completeness and that every element of every "
                       "logical tensor is stored exactly once. Exit code 0 if intact, 1 if not.")
    p.add_argument("uri", metavar="URI/JOB", help="e.g. file:///ckpt/myjob")
    p.add_argument("--step", type=int, default=None, help="step (default: latest committed)")
    p.add_argument("--all", action="store_true", help="verify every committed step")
    p.add_argument("--threads", type=thread_count, default=8, help="objects read in parallel (default 8)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)
