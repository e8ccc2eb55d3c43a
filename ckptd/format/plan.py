"""Save planning: which bytes of one rank go where.  Pure: no I/O, no tensor data read.

:func:`plan_rank_save` turns a rank's :class:`SaveItem` s into a :class:`RankPlan`:

* ``copies``: where each item's bytes go in the rank's staging buffer (C order, 64-byte
  aligned so any dtype can be viewed in place);
* ``writes``: the objects to write from that buffer (zarr chunks, and one pack object of
  small tensors), each a contiguous buffer range plus trailing zero padding;
* the manifest skeleton (arrays, logical tensors and their pieces) that the writer
  completes with checksums.

The plan is JSON (``to_json``/``from_json``) so it can travel to the daemon with a Save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptd.errors import ConfigError
from ckptd.format.dtypes import dtype_name, itemsize
from ckptd.format.items import SaveItem
from ckptd.format.layout import Region, balance_owners, grid_coords, is_grid_chunk
from ckptd.format.manifest import ArrayRecord, ChunkRecord, Piece, TensorRecord

if TYPE_CHECKING:
    import torch

ALIGN = 64
DEFAULT_PACK_THRESHOLD = 1 << 20  # tensors smaller than 1 MiB go into the rank's pack


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def chunk_key(coords: tuple[int, ...]) -> str:
    """zarr v3 default chunk key (separator '/'): ``c/1/0``; ``c`` for 0-d arrays."""
    return "/".join(["c", *(str(c) for c in coords)])


def chunk_id(coords: tuple[int, ...]) -> str:
    """Chunk id used in manifests: ``1.0`` (``""`` for 0-d arrays)."""
    return ".".join(str(c) for c in coords)


def pack_array(rank: int) -> str:
    return f"_packs/{rank}"


@dataclass(frozen=True, slots=True)
class StageCopy:
    """Copy item ``item`` to buffer bytes ``[offset, offset+nbytes)``.

    With ``chunk_shape`` set, the destination is a whole zarr chunk of that shape and the
    item fills its leading corner (an edge chunk cut short along a dim other than 0: zarr
    stores edge chunks at full size, so the padding sits inside each row, not at the end).
    """

    item: int
    offset: int
    nbytes: int
    chunk_shape: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class ObjectWrite:
    """Write buffer bytes ``[offset, offset+nbytes)`` then ``pad`` zero bytes to ``key``.

    ``array``/``chunk`` name the zarr chunk this is (``chunk`` None for a pack object).
    """

    key: str
    offset: int
    nbytes: int
    pad: int
    array: str
    chunk: str | None


@dataclass(frozen=True, slots=True)
class ArrayMeta:
    """An array whose ``zarr.json`` this rank writes."""

    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]


@dataclass(slots=True)
class RankPlan:
    nbytes: int
    copies: list[StageCopy] = field(default_factory=list)
    writes: list[ObjectWrite] = field(default_factory=list)
    array_meta: dict[str, ArrayMeta] = field(default_factory=dict)
    arrays: dict[str, ArrayRecord] = field(default_factory=dict)  # chunks: crc32c = 0 here
    tensors: dict[str, TensorRecord] = field(default_factory=dict)
    packs: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "nbytes": self.nbytes,
            "copies": [[c.item, c.offset, c.nbytes]
                       + ([list(c.chunk_shape)] if c.chunk_shape is not None else [])
                       for c in self.copies],
            "writes": [[w.key, w.offset, w.nbytes, w.pad, w.array, w.chunk] for w in self.writes],
            "array_meta": {
                k: {"shape": list(m.shape), "dtype": m.dtype, "chunk_shape": list(m.chunk_shape)}
                for k, m in self.array_meta.items()
            },
            "arrays": {k: a.to_json() for k, a in self.arrays.items()},
            "tensors": {k: t.to_json() for k, t in self.tensors.items()},
            "packs": dict(self.packs),
        }

    @staticmethod
    def from_json(d: dict) -> RankPlan:
        return RankPlan(
            nbytes=int(d["nbytes"]),
            copies=[StageCopy(int(c[0]), int(c[1]), int(c[2]),
                              tuple(int(x) for x in c[3]) if len(c) > 3 else None)
                    for c in d["copies"]],
            writes=[
                ObjectWrite(str(k), int(o), int(n), int(p), str(a), None if c is None else str(c))
                for k, o, n, p, a, c in d["writes"]
            ],
            array_meta={
                k: ArrayMeta(tuple(int(x) for x in m["shape"]), str(m["dtype"]),
                             tuple(int(x) for x in m["chunk_shape"]))
                for k, m in d["array_meta"].items()
            },
            arrays={k: ArrayRecord.from_json(a) for k, a in d["arrays"].items()},
            tensors={k: TensorRecord.from_json(t) for k, t in d["tensors"].items()},
            packs={k: int(v) for k, v in d["packs"].items()},
        )


def _check_item(i: int, item: SaveItem) -> None:
    if tuple(item.local.shape) != tuple(item.region.shape):
        raise ConfigError(
            f"save item {item.name!r}: local tensor has shape {tuple(item.local.shape)} but its "
            f"region has shape {item.region.shape} (adapter bug)"
        )
    if not item.region.within(item.global_shape):
        raise ConfigError(
            f"save item {item.name!r}: region {item.region} lies outside global shape "
            f"{item.global_shape} (adapter bug)"
        )
    if item.local.dtype != item.dtype:
        raise ConfigError(
            f"save item {item.name!r}: local dtype {item.local.dtype} differs from declared "
            f"{item.dtype} (adapter bug)"
        )


def plan_rank_save(
    items: list[SaveItem],
    rank: int,
    world_size: int,
    pack_threshold: int = DEFAULT_PACK_THRESHOLD,
) -> RankPlan:
    """Plan what ``rank`` writes.  Every rank of a save calls it with its own items."""
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is outside world size {world_size}")
    replicated = sorted(
        (it.name, i) for i, it in enumerate(items) if it.replicated and it.writer
    )
    owners = balance_owners(
        [math.prod(items[i].global_shape) * itemsize(items[i].dtype) for _, i in replicated],
        world_size,
    )
    owner_of = {i: owners[k] for k, (_, i) in enumerate(replicated)}

    plan = RankPlan(nbytes=0)
    buf = 0
    pack_items: list[tuple[int, SaveItem]] = []
    piece_arrays: dict[str, int] = {}

    for i, item in enumerate(items):
        _check_item(i, item)
        dt = dtype_name(item.dtype)
        if item.logical:
            plan.tensors.setdefault(item.name, TensorRecord(tuple(item.global_shape), dt, []))
        for v in item.views:
            numel = math.prod(v.shape)
            if v.start < 0 or v.start + numel > math.prod(item.global_shape):
                raise ConfigError(
                    f"view {v.name!r} of {item.name!r} covers elements [{v.start}, "
                    f"{v.start + numel}) outside the array's {math.prod(item.global_shape)}"
                )
            plan.tensors[v.name] = TensorRecord(
                tuple(v.shape), dtype_name(v.dtype),
                [Piece(Region.full(v.shape), array=item.name, flat_start=v.start)]
                if numel else [],
            )
        writes_it = item.writer and (not item.replicated or owner_of.get(i) == rank)
        if not writes_it or item.region.empty():
            continue
        nbytes = item.region.numel * itemsize(item.dtype)
        if item.logical and nbytes < pack_threshold:
            pack_items.append((i, item))
            continue
        chunk_shape = item.chunk_shape
        if item.replicated and chunk_shape is None:
            chunk_shape = tuple(item.global_shape)
        if chunk_shape is not None and is_grid_chunk(item.region, chunk_shape, item.global_shape):
            array, shape, offsets = item.name, tuple(item.global_shape), item.region.offsets
        else:
            if not item.logical:
                raise ConfigError(
                    f"storage array {item.name!r}: region {item.region} is not a chunk of grid "
                    f"{chunk_shape} (adapter bug)"
                )
            n = piece_arrays.get(item.name, 0)
            piece_arrays[item.name] = n + 1
            array = f"_pieces/{rank}/{item.name}" + (f".{n}" if n else "")
            shape, chunk_shape, offsets = item.region.shape, item.region.shape, (0,) * len(
                item.region.shape
            )
        coords = grid_coords(Region(offsets, item.region.shape), chunk_shape)
        assert coords is not None
        chunk_elems = math.prod(chunk_shape)
        pad = chunk_elems * itemsize(item.dtype) - nbytes
        rec = plan.arrays.setdefault(array, ArrayRecord(shape, dt, tuple(chunk_shape), {}))
        rec.chunks[chunk_id(coords)] = ChunkRecord(nbytes + pad, 0)
        if all(c == 0 for c in coords):
            plan.array_meta[array] = ArrayMeta(shape, dt, tuple(chunk_shape))
        if tuple(item.region.shape[1:]) != tuple(chunk_shape[1:]):
            # cut short along a dim other than 0: stage the whole padded chunk
            nbytes, pad = nbytes + pad, 0
            plan.copies.append(StageCopy(i, buf, nbytes, tuple(chunk_shape)))
        else:
            plan.copies.append(StageCopy(i, buf, nbytes))
        plan.writes.append(ObjectWrite(f"{array}/{chunk_key(coords)}", buf, nbytes, pad, array,
                                       chunk_id(coords)))
        if item.logical:
            plan.tensors[item.name].pieces.append(
                Piece(item.region, array=array, array_offsets=tuple(offsets))
            )
        buf = _align(buf + nbytes)

    if pack_items:
        pack = pack_array(rank)
        start = buf
        for i, item in pack_items:
            nbytes = item.region.numel * itemsize(item.dtype)
            plan.copies.append(StageCopy(i, buf, nbytes))
            plan.tensors[item.name].pieces.append(
                Piece(item.region, pack=pack, byte_offset=buf - start, nbytes=nbytes, crc32c=0)
            )
            buf = _align(buf + nbytes)
        size = buf - start
        plan.packs[pack] = size
        plan.array_meta[pack] = ArrayMeta((size,), "uint8", (size,))
        plan.arrays[pack] = ArrayRecord((size,), "uint8", (size,), {"0": ChunkRecord(size, 0)})
        plan.writes.append(ObjectWrite(f"{pack}/{chunk_key((0,))}", start, size, 0, pack, "0"))
    plan.nbytes = buf
    return plan


def stage_dtype_view(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype,
                     shape: tuple[int, ...]) -> torch.Tensor:
    """A view of ``buffer`` (1-D uint8) bytes ``[offset, offset+nbytes)`` as ``dtype``/``shape``."""
    return buffer[offset:offset + nbytes].view(dtype).view(shape)
