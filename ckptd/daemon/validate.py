"""Checks of everything a client sends before the daemon touches memory or storage.

A client is not trusted: its identity, plan and JSON documents are parsed defensively and
any inconsistency is a StagingError/ConfigError (INVALID_ARGUMENT) with a message naming
what is wrong.  The checks that matter for memory safety are in
:func:`ckptd.format.writer.validate_plan` (every write inside the segment, safe keys);
the rest makes sure the writer cannot fail half-way on a malformed plan.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptd.errors import CkptdError, ConfigError, StagingError
from ckptd.format import paths
from ckptd.format.dtypes import check_name, itemsize
from ckptd.format.plan import RankPlan
from ckptd.format.writer import SaveIdentity, validate_plan
from ckptd.storage.base import check_key

MAX_WORLD_SIZE = 1 << 20
_FRAMEWORK = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_RESERVED = ("_ranks", "index.json", "zarr.json", "COMMITTED")


def check_rank(rank: int, world_size: int) -> None:
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ConfigError(f"world_size {world_size} is out of range: expected 1..{MAX_WORLD_SIZE}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world size {world_size}: expected "
                          f"0 <= rank < {world_size}")


def identity(job: str, step: int, attempt: str, rank: int, world_size: int,
             framework: str) -> SaveIdentity:
    paths.check_job(job)
    paths.check_step(int(step))
    paths.check_attempt(attempt)
    check_rank(rank, world_size)
    if not _FRAMEWORK.match(framework):
        raise ConfigError(f"framework name {framework!r} is invalid: expected 1-64 letters, "
                          "digits, '.', '_' or '-'")
    return SaveIdentity(job, int(step), attempt, rank, world_size, framework)


def _array_name(name: object, what: str) -> str:
    if not isinstance(name, str):
        raise StagingError(f"{what}: array name {name!r} is not a string")
    try:
        check_key(name)
    except ConfigError:
        raise StagingError(f"{what}: array name {name!r} is not a safe relative path") from None
    if name.split("/")[0] in _RESERVED or name.endswith("/zarr.json"):
        raise StagingError(f"{what}: array name {name!r} uses a reserved name")
    return name


def _dtype(name: str, what: str) -> str:
    try:
        return check_name(name)
    except (CkptdError, TypeError):  # TypeError: not even hashable (a list from JSON)
        raise StagingError(f"{what}: unknown dtype {name!r}") from None


def _shape(shape: Any, what: str, positive: bool = False) -> None:
    if not all(isinstance(x, int) and (x > 0 if positive else x >= 0) for x in shape):
        raise StagingError(f"{what}: invalid shape {list(shape)}")


def plan(plan_json: bytes, buffer_size: int) -> RankPlan:
    """Parse and check a plan against a segment of ``buffer_size`` bytes."""
    try:
        doc = json.loads(plan_json)
        p = RankPlan.from_json(doc)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StagingError(f"save plan is malformed ({type(exc).__name__}: {exc})") from None
    if p.nbytes < 0:
        raise StagingError(f"save plan has negative size {p.nbytes}")
    validate_plan(p, buffer_size)
    for name, m in p.array_meta.items():
        what = f"array {name!r}"
        _array_name(name, what)
        _dtype(m.dtype, what)
        _shape(m.shape, what)
        _shape(m.chunk_shape, what, positive=True)
        if len(m.shape) != len(m.chunk_shape):
            raise StagingError(f"{what}: chunk shape {m.chunk_shape} does not match shape "
                               f"{m.shape}")
    chunks: dict[tuple[str, str], int] = {}
    for name, a in p.arrays.items():
        what = f"array {name!r}"
        _array_name(name, what)
        _dtype(a.dtype, what)
        _shape(a.shape, what)
        _shape(a.chunk_shape, what, positive=True)
        chunk_bytes = math.prod(a.chunk_shape) * itemsize(a.dtype)
        for cid, c in a.chunks.items():
            if name not in p.packs and c.nbytes != chunk_bytes:
                raise StagingError(f"{what} chunk {cid}: {c.nbytes} bytes, but its chunk shape "
                                   f"{a.chunk_shape} makes {chunk_bytes}")
            chunks[(name, cid)] = c.nbytes
    seen: set[tuple[str, str]] = set()
    pads = 0
    for w in p.writes:
        key = (w.array, w.chunk or "")
        if key not in chunks:
            raise StagingError(f"write {w.key!r} is not a chunk recorded in the plan's arrays")
        if key in seen:
            raise StagingError(f"write {w.key!r}: chunk written twice")
        seen.add(key)
        if chunks[key] != w.nbytes + w.pad:
            raise StagingError(f"write {w.key!r}: {w.nbytes} bytes + {w.pad} padding differ from "
                               f"the chunk's {chunks[key]} bytes")
        pads += w.pad
    if set(chunks) != seen:
        missing = sorted("/".join(k) for k in set(chunks) - seen)[:5]
        raise StagingError(f"save plan records chunks it does not write: {missing}")
    if pads > max(p.nbytes, 1 << 30):
        raise StagingError(f"save plan pads {pads} bytes for {p.nbytes} staged bytes")
    for name, size in p.packs.items():
        _array_name(name, f"pack {name!r}")
        if chunks.get((name, "0")) != size:
            raise StagingError(f"pack {name!r}: size {size} does not match its write")
    for name, t in p.tensors.items():
        if not isinstance(name, str) or not name or len(name) > 4096:
            raise StagingError(f"tensor name {name!r} is invalid")
        _dtype(t.dtype, f"tensor {name!r}")
        _shape(t.shape, f"tensor {name!r}")
        for piece in t.pieces:
            if piece.pack is not None:
                if piece.pack not in p.packs:
                    raise StagingError(f"tensor {name!r}: pack {piece.pack!r} is not written")
                lo, n = piece.byte_offset or 0, piece.nbytes or 0
                if lo < 0 or n < 0 or lo + n > p.packs[piece.pack]:
                    raise StagingError(f"tensor {name!r}: bytes [{lo}, {lo + n}) lie outside "
                                       f"pack {piece.pack!r}")
            elif piece.array is not None:
                _array_name(piece.array, f"tensor {name!r}")
            else:
                raise StagingError(f"tensor {name!r}: a piece names neither array nor pack")
    return p


class PlanCache:
    """Plans that passed :func:`plan`, keyed by everything that check depends on: the
    plan's bytes (sha256) and the segment size it was checked against.

    A training job sends the same plan with every save (its layout does not change), and
    parsing and checking it costs milliseconds of the Save round trip, which the client's
    training loop waits for.  A hit returns the plan checked earlier for exactly these
    bytes and this size; anything else -- another plan, a changed byte, another segment
    size -- is parsed and checked in full.  Failures are not cached.  The returned
    :class:`RankPlan` is shared between saves and must be treated as read-only (the write
    pipeline never changes a plan).  Bounded (LRU, ``capacity`` plans); used from the
    daemon's event loop only (not thread-safe).
    """

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._plans: collections.OrderedDict[tuple[bytes, int], RankPlan] = (
            collections.OrderedDict())
        self.hits = self.misses = 0

    def plan(self, plan_json: bytes, buffer_size: int) -> RankPlan:
        """:func:`plan` (``plan_json`` checked against ``buffer_size`` bytes), cached."""
        key = (hashlib.sha256(plan_json).digest(), buffer_size)
        p = self._plans.get(key)
        if p is not None:
            self._plans.move_to_end(key)
            self.hits += 1
            return p
        p = plan(plan_json, buffer_size)   # raises on a bad plan: nothing is cached
        self.misses += 1
        self._plans[key] = p
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        return p

    def __len__(self) -> int:
        return len(self._plans)


def json_doc(data: bytes, what: str, default: Any = None) -> Any:
    if not data:
        return default
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise StagingError(f"{what} is not valid JSON ({exc})") from None


def param_groups(data: bytes) -> list[dict]:
    groups = json_doc(data, "param_groups", [])
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise StagingError("param_groups must be a JSON list of objects")
    return groups


def job_key(job: str, key: str, allow_job_root: bool = True) -> str:
    """``key`` if it lies below ``job`` (``<job>`` itself or ``<job>/...``), else ConfigError."""
    paths.check_job(job)
    if key == job and allow_job_root:
        return key
    if not isinstance(key, str) or not key.startswith(job + "/"):
        raise ConfigError(f"key {key!r} lies outside job {job!r}: a client may only read its "
                          "own job's objects")
    return check_key(key)


MAX_READ_RANGES = 4096


@dataclass(frozen=True, slots=True)
class ReadSpec:
    """One checked range of a ReadIntoSegment request."""

    key: str
    start: int
    length: int
    offset: int
    whole: bool


def read_ranges(job: str, ranges: Sequence[Any], segment_size: int) -> list[ReadSpec]:
    """Check a ReadIntoSegment request's ranges (objects with ``key``, ``start``,
    ``length``, ``offset``, ``whole``) for a read segment of ``segment_size`` bytes: keys
    below ``job``, every range inside the segment, no two overlapping."""
    if len(ranges) > MAX_READ_RANGES:
        raise StagingError(f"ReadIntoSegment names {len(ranges)} ranges, at most "
                           f"{MAX_READ_RANGES} are allowed per call; split the batch")
    out = []
    for i, r in enumerate(ranges):
        key = job_key(job, r.key, allow_job_root=False)
        if r.whole and r.start != 0:
            raise StagingError(f"range {i} ({key}): a whole-object read must start at 0, "
                               f"got start {r.start}")
        if r.offset + r.length > segment_size:
            raise StagingError(
                f"range {i} ({key}): segment bytes [{r.offset}, {r.offset + r.length}) lie "
                f"outside the read segment of {segment_size} bytes; every range must fit "
                "offset + length <= the segment's size")
        out.append(ReadSpec(key, int(r.start), int(r.length), int(r.offset), bool(r.whole)))
    spans = sorted((r.offset, r.offset + r.length, i) for i, r in enumerate(out) if r.length)
    for (lo_a, hi_a, a), (lo_b, _hi_b, b) in itertools.pairwise(spans):
        if lo_b < hi_a:
            raise StagingError(
                f"ranges {a} and {b} overlap in the read segment (bytes [{lo_a}, {hi_a}) and "
                f"from {lo_b}); give each range its own bytes of the segment")
    return out
