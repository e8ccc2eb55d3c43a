"""Reshard planning: which bytes of which source objects make each object of the resharded
checkpoint.  Pure: no I/O, no tensor data (shapes only; :class:`Placeholder` s stand in for data).

:func:`plan_reshard` lays a committed checkpoint out as if it had been saved at world size
``N``, by running the save planner (:func:`ckptd.format.plan.plan_rank_save`) once per
destination rank on virtual :class:`SaveItem` s:

* a logical tensor stored dim-0 sharded (any number of pieces, in grid arrays, per-rank
  piece arrays or packs) becomes one array of its global shape with chunk
  ``ceil(d0 / N)`` along dim 0: destination rank ``r`` "writes" chunk ``r``, which is the
  shard ``r`` reads at load time (FSDP2 / DTensor ``Shard(0)``, FSDP1 sharded state dicts);
* a fairscale flat parameter array (1-D storage behind flat views) keeps its unpadded
  length and gets chunk ``ceil(numel / N)``, fairscale's shard length at ``N`` ranks; the
  views (original parameter names, shapes and offsets) are unchanged;
* a tensor the source stored whole although the source had several ranks (a replicated
  tensor: buffers, plain parameters, DDP) stays whole, written once; 0-d tensors too;
* small shards (under ``pack_threshold`` bytes, as at save time) go into the destination
  rank's pack, exactly like a native save at ``N``;
* extra state (``_extra/<rank>/<i>`` tensors and the per-rank JSON) follows the rank it
  belongs to, see :func:`dest_extras`.

Every destination object is described by an :class:`ObjectTask`: contiguous byte ranges
of source objects to fetch (:class:`Fetch`) and where their elements go in the output
buffer (:class:`Place`).  Each source byte is fetched once: a source chunk that feeds
several destination objects is read as several disjoint ranges.  Checksums are still
verified: every recorded crc32c (a chunk, or a packed tensor) is a :class:`Unit`, each
fetch says which unit-relative :class:`Segment` s it covers, the segments of a unit
partition it (gaps such as chunk padding get an extra :class:`VerifyTask`), and the
executor combines the parts' crc32c (:mod:`ckptd.reshard.crc`).  A unit whose ranges
overlap is verified by one whole read instead.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptd.errors import ConfigError, CorruptCheckpointError
from ckptd.format.dtypes import check_name, itemsize
from ckptd.format.items import FlatView, Placeholder, SaveItem
from ckptd.format.layout import (
    Region,
    Shape,
    balance_owners,
    chunk_region,
    chunks_overlapping,
    dim0_chunk_len,
    dim0_chunk_shape,
    dim0_shard,
    intersect,
    is_row_range,
    shift,
)
from ckptd.format.manifest import ArrayRecord, Index, Piece, TensorRecord
from ckptd.format.plan import DEFAULT_PACK_THRESHOLD, RankPlan, chunk_key, plan_rank_save

#: Prefix of the per-rank extra-state tensors written by ``ckptd_client`` (``_extra/<rank>/<i>``).
EXTRA_PREFIX = "_extra/"
#: Key under rank 0's extra document that keeps the extra state of source ranks >= N.
BEYOND_KEY = "ckptd_extras_beyond_world"

DEFAULT_MAX_FETCH = 32 << 20  # one fetch never exceeds this (unless one row is larger)
DEFAULT_MERGE_GAP = 256 << 10  # fetches of one object closer than this are merged

_EXTRA = re.compile(r"^_extra/(\d+)/(\d+)$")


# --------------------------------------------------------------------------- value types


@dataclass(frozen=True, slots=True)
class Unit:
    """A checksummed byte range of a source object: a whole chunk, or one packed tensor.

    ``key`` is relative to the source attempt prefix; the unit is bytes
    ``[start, start + nbytes)`` of that object and must hash to ``crc32c``.
    """

    key: str
    start: int
    nbytes: int
    crc32c: int
    what: str


@dataclass(frozen=True, slots=True)
class Segment:
    """Bytes ``[lo, hi)`` of unit ``unit`` (unit-relative) covered by a fetch."""

    unit: int
    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class Fetch:
    """One ranged read: bytes ``[lo, hi)`` of source object ``key``."""

    key: str
    lo: int
    hi: int
    segments: tuple[Segment, ...]

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True, slots=True)
class Place:
    """Copy a box of fetched elements into a box of the output buffer.

    The fetched bytes from ``src_offset`` are C-order elements of shape ``src_shape``;
    ``src_box`` of them go to ``dst_box`` of the C-order block of shape ``dst_shape`` at
    byte ``dst_offset`` of the output object.  Elements are ``itemsize`` raw bytes (no
    dtype conversion, so every dtype is copied bit-exactly).
    """

    fetch: int
    src_offset: int
    src_shape: Shape
    src_box: Region
    dst_offset: int
    dst_shape: Shape
    dst_box: Region
    itemsize: int

    @property
    def contiguous(self) -> bool:
        """Whether this is a plain byte copy (whole source block to a contiguous range)."""
        return self.src_box == Region.full(self.src_shape) and (
            self.dst_box == Region.full(self.dst_shape)
            or (len(self.dst_shape) >= 1 and is_row_range(self.dst_box, self.dst_shape))
        )

    @property
    def nbytes(self) -> int:
        return self.dst_box.numel * self.itemsize

    def dst_byte_range(self) -> tuple[int, int]:
        """For a contiguous place: the output bytes it fills."""
        row = math.prod(self.dst_shape[1:]) if self.dst_shape else 1
        start = self.dst_offset + (self.dst_box.offsets[0] * row * self.itemsize
                                   if self.dst_shape else 0)
        return start, start + self.nbytes


@dataclass(frozen=True, slots=True)
class Need:
    """A contiguous byte range of a source object and where its elements go (pre-fetch)."""

    unit: Unit
    lo: int  # object-relative
    hi: int
    src_shape: Shape
    src_box: Region
    dst_shape: Shape
    dst_box: Region
    itemsize: int
    dst_offset: int = 0


@dataclass(slots=True)
class ObjectTask:
    """Build and write one destination object (a chunk, or a pack).

    ``key`` is relative to the destination attempt prefix; the object is ``nbytes`` of
    data followed by ``pad`` zero bytes (edge chunks are stored full size).  ``rank`` is
    the destination rank whose manifest records it as chunk ``chunk`` of ``array``.
    ``piece_crcs`` lists packed tensors inside the object whose crc32c the manifest needs:
    (tensor name, piece index in the rank plan, lo, hi) in output-buffer bytes.
    """

    key: str
    nbytes: int
    pad: int
    array: str
    chunk: str
    rank: int
    fetches: list[Fetch]
    places: list[Place]
    piece_crcs: list[tuple[str, int, int, int]] = field(default_factory=list)

    @property
    def read_bytes(self) -> int:
        return sum(f.nbytes for f in self.fetches)


@dataclass(slots=True)
class VerifyTask:
    """Fetches made only to complete the checksum of units (gaps, or whole units)."""

    fetches: list[Fetch]

    @property
    def read_bytes(self) -> int:
        return sum(f.nbytes for f in self.fetches)


@dataclass(slots=True)
class ReshardPlan:
    """Everything the executor needs; identical on every torchrun worker."""

    world_size: int
    source_world_size: int
    framework: str
    created_at: float
    param_groups: list[dict]
    units: list[Unit]
    objects: list[ObjectTask]
    verify: list[VerifyTask]
    ranks: list[RankPlan]
    extras: list[Any]

    @property
    def tasks(self) -> list[ObjectTask | VerifyTask]:
        return [*self.objects, *self.verify]

    @property
    def write_bytes(self) -> int:
        return sum(o.nbytes + o.pad for o in self.objects)

    @property
    def read_bytes(self) -> int:
        return sum(t.read_bytes for t in self.tasks)

    def max_object_bytes(self) -> int:
        return max((o.nbytes + o.pad for o in self.objects), default=0)


# --------------------------------------------------------------------------- extras


def _tensor_refs(doc: Any) -> set[int]:
    """Indices of every tensor referenced by an extra-state JSON document."""
    out: set[int] = set()
    if isinstance(doc, list):
        for v in doc:
            out |= _tensor_refs(v)
    elif isinstance(doc, dict):
        if len(doc) == 1 and ("__tensor__" in doc or "__ndarray__" in doc):
            v = doc.get("__tensor__", doc.get("__ndarray__"))
            if isinstance(v, int):
                out.add(v)
            return out
        for v in doc.values():
            out |= _tensor_refs(v)
    return out


@dataclass(frozen=True, slots=True)
class ExtraTensor:
    dest: str  # destination tensor name
    source: str  # source tensor name
    rank: int  # destination rank that stores it


def dest_extras(extras: Mapping[int, Any], tensor_names: Iterable[str],
                world: int) -> tuple[list[Any], list[ExtraTensor]]:
    """Per-destination-rank extra documents and where every extra tensor goes.

    Loading at ``world`` ranks must behave exactly as loading the source at ``world``
    ranks does (``CheckpointClient.load``): rank ``r`` that the source had gets its own
    document and RNG state; a rank the source did not have gets rank 0's user extra and
    no RNG state (its document is ``{"user": ...}`` and the tensors it references are
    copied as ``_extra/<r>/<i>``).  Documents of source ranks >= ``world`` are not used by
    such a load; they are kept under ``BEYOND_KEY`` in rank 0's document (their tensors
    too), so resharding back restores them.
    """
    src: dict[int, Any] = dict(extras)
    first = src.get(0)
    if isinstance(first, dict) and BEYOND_KEY in first:
        first = {k: v for k, v in first.items() if k != BEYOND_KEY}
        beyond_in = src[0][BEYOND_KEY]
        src[0] = first
        if isinstance(beyond_in, dict):
            for k, v in beyond_in.items():
                if str(k).isdigit() and int(k) not in src:
                    src[int(k)] = v
    by_rank: dict[int, list[tuple[int, str]]] = {}
    for name in tensor_names:
        m = _EXTRA.match(name)
        if m:
            by_rank.setdefault(int(m.group(1)), []).append((int(m.group(2)), name))
    docs: list[Any] = []
    placed: list[ExtraTensor] = []
    user0 = first.get("user") if isinstance(first, dict) else None
    for r in range(world):
        if r in src:
            docs.append(src[r])
            placed += [ExtraTensor(n, n, r) for _, n in sorted(by_rank.get(r, []))]
        elif user0 is not None:
            docs.append({"user": user0})
            have = {i: n for i, n in by_rank.get(0, [])}
            for i in sorted(_tensor_refs(user0)):
                if i in have:
                    placed.append(ExtraTensor(f"{EXTRA_PREFIX}{r}/{i}", have[i], r))
        else:
            docs.append(None)
    beyond = {s: src[s] for s in sorted(src) if s >= world}
    for s in sorted(set(by_rank) - set(range(world))):
        placed += [ExtraTensor(n, n, s % world) for _, n in sorted(by_rank[s])]
    if beyond:
        d0 = dict(docs[0]) if isinstance(docs[0], dict) else {}
        d0[BEYOND_KEY] = {str(s): doc for s, doc in beyond.items()}
        docs[0] = d0
    return docs, placed


# --------------------------------------------------------------------------- regions


def _split_rows(r0: int, r1: int, rowbytes: int, max_bytes: int) -> list[tuple[int, int]]:
    step = max(1, max_bytes // max(1, rowbytes))
    return [(a, min(r1, a + step)) for a in range(r0, r1, step)]


def _chunk_unit(arrays: Mapping[str, ArrayRecord], array: str, coords: tuple[int, ...],
                isz: int) -> Unit:
    rec = arrays.get(array)
    if rec is None:
        raise CorruptCheckpointError(
            f"array {array!r} is referenced by the index but not recorded in it; the "
            "checkpoint is damaged. Run `ckptd verify`."
        )
    cid = ".".join(str(c) for c in coords)
    c = rec.chunks.get(cid)
    if c is None:
        raise CorruptCheckpointError(
            f"array {array!r} chunk {cid or '(0-d)'} was never written (no rank recorded it); "
            "the checkpoint is incomplete. Run `ckptd verify`."
        )
    want = math.prod(rec.chunk_shape) * isz
    if c.nbytes != want:
        raise CorruptCheckpointError(
            f"array {array!r} chunk {cid}: the index records {c.nbytes} bytes, a chunk of "
            f"shape {rec.chunk_shape} has {want}. Run `ckptd verify`."
        )
    return Unit(f"{array}/{chunk_key(coords)}", 0, c.nbytes, c.crc32c,
                f"array {array!r} chunk {cid or '(0-d)'}")


def _grid_needs(arrays: Mapping[str, ArrayRecord], p: Piece, want: Region, isz: int,
                max_fetch: int) -> list[Need]:
    assert p.array is not None and p.array_offsets is not None
    inter = intersect(p.region, want)
    if inter is None or inter.empty():
        return []
    rec = arrays.get(p.array)
    if rec is None:
        raise CorruptCheckpointError(f"array {p.array!r} is missing from the index")
    a_box = Region(tuple(io - po + ao for io, po, ao in zip(inter.offsets, p.region.offsets,
                                                           p.array_offsets)), inter.shape)
    if not a_box.within(rec.shape):
        raise CorruptCheckpointError(
            f"a piece of array {p.array!r} covers {a_box}, outside the array's shape {rec.shape}"
        )
    cs = rec.chunk_shape
    out = []
    for coords in chunks_overlapping(a_box, cs):
        unit = _chunk_unit(arrays, p.array, coords, isz)
        creg = chunk_region(coords, cs, rec.shape)
        sub = intersect(creg, a_box)
        if sub is None:
            continue
        local = shift(sub, creg.offsets)
        log = tuple(so - ao + po for so, ao, po in zip(sub.offsets, p.array_offsets,
                                                       p.region.offsets))
        if not cs:  # 0-d
            out.append(Need(unit, 0, isz, (), Region((), ()), want.shape, Region((), ()), isz))
            continue
        rowb = math.prod(cs[1:]) * isz
        l0 = local.offsets[0]
        for a, b in _split_rows(l0, l0 + local.shape[0], rowb, max_fetch):
            src_box = Region((0,) + local.offsets[1:], (b - a,) + local.shape[1:])
            dst_off = (log[0] + a - l0 - want.offsets[0],) + tuple(
                x - w for x, w in zip(log[1:], want.offsets[1:]))
            out.append(Need(unit, a * rowb, b * rowb, (b - a,) + cs[1:], src_box, want.shape,
                            Region(dst_off, src_box.shape), isz))
    return out


def _pack_needs(p: Piece, want: Region, isz: int, max_fetch: int) -> list[Need]:
    inter = intersect(p.region, want)
    if inter is None or inter.empty():
        return []
    bo, nb = p.byte_offset or 0, p.nbytes or 0
    if nb != p.region.numel * isz:
        raise CorruptCheckpointError(
            f"pack {p.pack!r}: a piece of region {p.region} records {nb} bytes, expected "
            f"{p.region.numel * isz}. Run `ckptd verify`."
        )
    unit = Unit(f"{p.pack}/c/0", bo, nb, p.crc32c or 0,
                f"pack {p.pack!r} bytes [{bo}, {bo + nb})")
    if not p.region.shape:
        return [Need(unit, bo, bo + isz, (), Region((), ()), want.shape, Region((), ()), isz)]
    local = shift(inter, p.region.offsets)
    rs = p.region.shape
    rowb = math.prod(rs[1:]) * isz
    l0 = local.offsets[0]
    out = []
    for a, b in _split_rows(l0, l0 + local.shape[0], rowb, max_fetch):
        src_box = Region((0,) + local.offsets[1:], (b - a,) + local.shape[1:])
        dst_off = (inter.offsets[0] + a - l0 - want.offsets[0],) + tuple(
            x - w for x, w in zip(inter.offsets[1:], want.offsets[1:]))
        out.append(Need(unit, bo + a * rowb, bo + b * rowb, (b - a,) + rs[1:], src_box,
                        want.shape, Region(dst_off, src_box.shape), isz))
    return out


def _flat_needs(arrays: Mapping[str, ArrayRecord], p: Piece, shape: Shape, want: Region,
                isz: int, max_fetch: int) -> list[Need]:
    assert p.array is not None and p.flat_start is not None
    if want.numel == 0:
        return []
    if shape and not is_row_range(want, shape):
        raise ConfigError(f"flat views can only be read in whole rows, not {want}")
    rec = arrays.get(p.array)
    if rec is None:
        raise CorruptCheckpointError(f"array {p.array!r} is missing from the index")
    row = math.prod(shape[1:]) if shape else 1
    e0 = p.flat_start + (want.offsets[0] * row if shape else 0)
    e1 = e0 + want.numel
    if len(rec.shape) != 1 or e1 > rec.shape[0]:
        raise CorruptCheckpointError(
            f"a flat view covers elements [{e0}, {e1}) of array {p.array!r} of shape {rec.shape}"
        )
    c = rec.chunk_shape[0]
    out = []
    for k in range(e0 // c, (e1 - 1) // c + 1):
        unit = _chunk_unit(arrays, p.array, (k,), isz)
        a0, b0 = max(e0, k * c), min(e1, (k + 1) * c)
        for a, b in _split_rows(a0, b0, isz, max_fetch):
            out.append(Need(unit, (a - k * c) * isz, (b - k * c) * isz, (b - a,),
                            Region((0,), (b - a,)), (want.numel,), Region((a - e0,), (b - a,)),
                            isz))
    return out


def region_needs(arrays: Mapping[str, ArrayRecord], name: str, t: TensorRecord, want: Region,
                 *, max_fetch: int = DEFAULT_MAX_FETCH) -> list[Need]:
    """Source byte ranges that make region ``want`` of logical tensor (or array) ``name``.

    ``want`` must span whole rows (all dims but 0) when ``t`` is stored as flat views.
    Raises CorruptCheckpointError if the pieces do not cover ``want`` exactly once.
    """
    if not want.within(t.shape):
        raise ConfigError(f"region {want} lies outside {name!r} of shape {t.shape}")
    isz = itemsize(t.dtype)
    out: list[Need] = []
    for p in t.pieces:
        if p.pack is not None:
            out += _pack_needs(p, want, isz, max_fetch)
        elif p.flat_start is not None:
            out += _flat_needs(arrays, p, t.shape, want, isz, max_fetch)
        elif p.array is not None and p.array_offsets is not None:
            out += _grid_needs(arrays, p, want, isz, max_fetch)
        else:
            raise CorruptCheckpointError(f"tensor {name!r} has a piece with no source: {p}")
    covered = sum(n.dst_box.numel for n in out)
    if covered != want.numel:
        raise CorruptCheckpointError(
            f"tensor {name!r}: its stored pieces cover {covered} of the {want.numel} elements "
            f"of region {want} (expected exactly once). Run `ckptd verify`."
        )
    return out


def source_record(index: Index, name: str) -> TensorRecord:
    """The logical tensor ``name``, or a storage array seen as one tensor of its shape."""
    t = index.tensors.get(name)
    if t is not None:
        return t
    a = index.arrays.get(name)
    if a is None:
        raise CorruptCheckpointError(f"{name!r} is neither a tensor nor an array of the index")
    return TensorRecord(a.shape, a.dtype, [Piece(Region.full(a.shape), array=name,
                                                 array_offsets=(0,) * len(a.shape))])


# --------------------------------------------------------------------------- fetches


class UnitTable:
    """Interns :class:`Unit` s and numbers them."""

    def __init__(self) -> None:
        self.units: list[Unit] = []
        self._ids: dict[tuple[str, int], int] = {}

    def id(self, u: Unit) -> int:
        k = (u.key, u.start)
        i = self._ids.get(k)
        if i is None:
            i = self._ids[k] = len(self.units)
            self.units.append(u)
        elif self.units[i] != u:
            raise CorruptCheckpointError(
                f"{u.what}: recorded twice with different sizes or checksums"
            )
        return i


def build_fetches(needs: list[Need], table: UnitTable, *, max_fetch: int = DEFAULT_MAX_FETCH,
                  merge_gap: int = DEFAULT_MERGE_GAP) -> tuple[list[Fetch], list[Place]]:
    """Merge needs of the same object that lie close together into few fetches."""
    order = sorted(range(len(needs)), key=lambda i: (needs[i].unit.key, needs[i].lo))
    groups: list[list[int]] = []
    for i in order:
        n = needs[i]
        if groups:
            g = groups[-1]
            first = needs[g[0]]
            hi = max(needs[j].hi for j in g)
            if (first.unit.key == n.unit.key and n.lo - hi <= merge_gap
                    and max(hi, n.hi) - first.lo <= max_fetch):
                g.append(i)
                continue
        groups.append([i])
    fetches: list[Fetch] = []
    places: list[Place] = []
    for g in groups:
        lo = needs[g[0]].lo
        hi = max(needs[j].hi for j in g)
        segs = tuple(Segment(table.id(needs[j].unit), needs[j].lo - needs[j].unit.start,
                             needs[j].hi - needs[j].unit.start) for j in g)
        fi = len(fetches)
        fetches.append(Fetch(needs[g[0]].unit.key, lo, hi, segs))
        for j in g:
            n = needs[j]
            places.append(Place(fi, n.lo - lo, n.src_shape, n.src_box, n.dst_offset,
                                n.dst_shape, n.dst_box, n.itemsize))
    return fetches, places


def verification_tasks(fetch_lists: Iterable[list[Fetch]], units: list[Unit], *,
                       max_fetch: int = DEFAULT_MAX_FETCH) -> tuple[list[VerifyTask], set[int]]:
    """Extra reads so that every unit's segments partition it exactly.

    Returns the verify tasks and the units verified by a whole read (their ranges overlap;
    the caller drops their segments from the other fetches).
    """
    segs: dict[int, list[tuple[int, int]]] = {}
    for fetches in fetch_lists:
        for f in fetches:
            for s in f.segments:
                segs.setdefault(s.unit, []).append((s.lo, s.hi))
    tasks: list[VerifyTask] = []
    whole: set[int] = set()

    def reads(u: int, lo: int, hi: int) -> list[Fetch]:
        unit = units[u]
        return [Fetch(unit.key, unit.start + a, unit.start + b, (Segment(u, a, b),))
                for a, b in _split_rows(lo, hi, 1, max_fetch)]

    for u in sorted(segs):
        ranges = sorted(segs[u])
        end = 0
        gaps = []
        overlap = False
        for lo, hi in ranges:
            if lo < end:
                overlap = True
                break
            if lo > end:
                gaps.append((end, lo))
            end = hi
        if overlap:
            whole.add(u)
            tasks.append(VerifyTask(reads(u, 0, units[u].nbytes)))
            continue
        if end < units[u].nbytes:
            gaps.append((end, units[u].nbytes))
        for lo, hi in gaps:
            tasks.append(VerifyTask(reads(u, lo, hi)))
    return tasks, whole


def drop_segments(fetches: list[Fetch], units: set[int]) -> list[Fetch]:
    if not units:
        return fetches
    return [dataclasses.replace(f, segments=tuple(s for s in f.segments if s.unit not in units))
            for f in fetches]


# --------------------------------------------------------------------------- the plan


def replicated_whole(t: TensorRecord, index: Index) -> bool:
    """Whether the source stored ``t`` whole although it had several ranks (replicated).

    A dim-0 sharded tensor with at least 2 rows at world size >= 2 always has at least 2
    non-empty shards, hence never a single whole piece.
    """
    if not t.shape:
        return True
    if index.world_size < 2 or t.shape[0] < 2 or len(t.pieces) != 1:
        return False
    p = t.pieces[0]
    if p.region != Region.full(t.shape) or p.flat_start is not None:
        return False
    if p.pack is not None:
        return True
    a = index.arrays.get(p.array or "")
    return a is not None and len(a.chunks) == 1 and all(
        c >= s for c, s in zip(a.chunk_shape, a.shape))


def dest_items(index: Index, world: int) -> tuple[list[list[SaveItem]], dict[str, str],
                                                  list[Any]]:
    """Virtual save items of every destination rank, the source of every item name, and
    the destination extra documents."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"world size must be an integer >= 1, got {world!r}")
    flat: dict[str, list[tuple[str, TensorRecord, Piece]]] = {}
    regular: list[str] = []
    for name in sorted(index.tensors):
        t = index.tensors[name]
        fl = [p for p in t.pieces if p.flat_start is not None]
        if fl:
            if len(t.pieces) != 1:
                raise CorruptCheckpointError(
                    f"tensor {name!r} is stored as a flat view and in {len(t.pieces) - 1} other "
                    "pieces; a flat view must be its only piece"
                )
            flat.setdefault(fl[0].array or "", []).append((name, t, fl[0]))
        elif not _EXTRA.match(name):
            regular.append(name)
    for a in flat:
        if a in index.tensors or a not in index.arrays:
            raise CorruptCheckpointError(
                f"flat views point into {a!r}, which is "
                + ("also a logical tensor" if a in index.tensors else "not a stored array")
            )
    docs, extra_t = dest_extras(index.extras, index.tensors, world)
    sources: dict[str, str] = {}
    items: list[list[SaveItem]] = [[] for _ in range(world)]
    for a in sorted(flat):
        rec = index.arrays[a]
        n = rec.shape[0]
        dt = check_name(rec.dtype)
        views = [FlatView(name, t.shape, check_name(t.dtype), p.flat_start or 0)
                 for name, t, p in flat[a]]
        sources[a] = a
        flat_chunk = (dim0_chunk_len(n, world),)
        for r in range(world):
            reg = dim0_shard((n,), world, r)
            items[r].append(SaveItem(a, (n,), dt, Placeholder(reg.shape, dt), reg, chunk_shape=flat_chunk,
                                     logical=False, views=list(views)))
    for name in regular:
        t = index.tensors[name]
        dt = check_name(t.dtype)
        sources[name] = name
        if replicated_whole(t, index):
            for r in range(world):
                items[r].append(SaveItem(name, t.shape, dt, Placeholder(t.shape, dt),
                                         Region.full(t.shape), replicated=True))
            continue
        chunk = dim0_chunk_shape(t.shape, world)
        for r in range(world):
            reg = dim0_shard(t.shape, world, r)
            items[r].append(SaveItem(name, t.shape, dt, Placeholder(reg.shape, dt), reg,
                                     chunk_shape=chunk))
    for e in extra_t:
        t = index.tensors[e.source]
        dt = check_name(t.dtype)
        sources[e.dest] = e.source
        items[e.rank].append(SaveItem(e.dest, t.shape, dt, Placeholder(t.shape, dt),
                                      Region.full(t.shape)))
    return items, sources, docs


def plan_reshard(index: Index, world: int, *, pack_threshold: int = DEFAULT_PACK_THRESHOLD,
                 max_fetch: int = DEFAULT_MAX_FETCH,
                 merge_gap: int = DEFAULT_MERGE_GAP) -> ReshardPlan:
    """Plan rewriting the checkpoint described by ``index`` for ``world`` ranks."""
    if pack_threshold < 0:
        raise ConfigError(f"pack threshold must be >= 0 bytes, got {pack_threshold}")
    max_fetch = max(1, max_fetch)
    items, sources, docs = dest_items(index, world)
    table = UnitTable()
    objects: list[ObjectTask] = []
    ranks: list[RankPlan] = []
    for r in range(world):
        rp = plan_rank_save(items[r], r, world, pack_threshold)
        ranks.append(rp)
        by_offset = sorted(rp.copies, key=lambda c: c.offset)
        starts = [c.offset for c in by_offset]
        pack_pieces: dict[str, list[tuple[str, int, Piece]]] = {}
        for tname, t in rp.tensors.items():
            for pi, p in enumerate(t.pieces):
                if p.pack is not None:
                    pack_pieces.setdefault(p.pack, []).append((tname, pi, p))
        for w in rp.writes:
            needs: list[Need] = []
            k = bisect.bisect_left(starts, w.offset)
            while k < len(by_offset) and by_offset[k].offset < w.offset + w.nbytes:
                c = by_offset[k]
                k += 1
                if c.chunk_shape is not None:  # reshard output is chunked along dim 0 only
                    raise AssertionError(f"reshard planned a padded edge chunk for {w.key}")
                item = items[r][c.item]
                src = sources[item.name]
                rec = source_record(index, src)
                for n in region_needs(index.arrays, src, rec, item.region, max_fetch=max_fetch):
                    needs.append(dataclasses.replace(n, dst_offset=c.offset - w.offset))
            fetches, places = build_fetches(needs, table, max_fetch=max_fetch,
                                            merge_gap=merge_gap)
            crcs = [(tname, pi, p.byte_offset or 0, (p.byte_offset or 0) + (p.nbytes or 0))
                    for tname, pi, p in pack_pieces.get(w.array, [])] if w.array in rp.packs else []
            objects.append(ObjectTask(w.key, w.nbytes, w.pad, w.array, w.chunk or "", r,
                                      fetches, places, crcs))
    verify, whole = verification_tasks((o.fetches for o in objects), table.units,
                                       max_fetch=max_fetch)
    if whole:
        for o in objects:
            o.fetches = drop_segments(o.fetches, whole)
    return ReshardPlan(
        world_size=world, source_world_size=index.world_size, framework=index.framework,
        created_at=index.created_at, param_groups=index.param_groups, units=table.units,
        objects=objects, verify=verify, ranks=ranks, extras=docs,
    )


def assign_tasks(plan: ReshardPlan, workers: int) -> list[list[int]]:
    """Split the plan's tasks (``plan.tasks`` indices) among ``workers`` torchrun workers.

    Every destination array (all its chunks) and every pack goes to one worker, balanced
    by bytes (largest first); verification reads are balanced the same way.
    """
    if workers < 1:
        raise ConfigError(f"number of workers must be >= 1, got {workers}")
    groups: dict[str, list[int]] = {}
    for i, o in enumerate(plan.objects):
        groups.setdefault(f"a:{o.array}", []).append(i)
    n = len(plan.objects)
    for j, v in enumerate(plan.verify):
        groups.setdefault(f"v:{v.fetches[0].key if v.fetches else j}", []).append(n + j)
    names = sorted(groups)
    tasks = plan.tasks

    def cost(t: ObjectTask | VerifyTask) -> int:
        return t.read_bytes + (t.nbytes + t.pad if isinstance(t, ObjectTask) else 0)

    sizes = [sum(cost(tasks[i]) for i in groups[g]) for g in names]
    owners = balance_owners(sizes, workers)
    out: list[list[int]] = [[] for _ in range(workers)]
    for g, w in zip(names, owners):
        out[w].extend(groups[g])
    for lst in out:
        lst.sort()
    return out
