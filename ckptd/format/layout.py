"""Pure layout math: regions, chunk grids, dim-0 sharding, overlap.  No I/O, no torch.

Everything here is a pure function of shapes and world sizes, tested exhaustively in
``tests/property``.  Conventions:

* A *region* of an N-d tensor is ``(offsets, shape)``; it may be empty (a zero length).
* Dim-0 sharding follows ``torch.chunk``: with ``world`` ranks, chunk length is
  ``ceil(d0 / world)`` and rank ``r`` holds rows ``[r*c, min(d0, (r+1)*c))``; trailing
  ranks may hold nothing.  FSDP2 (DTensor ``Shard(0)``), FSDP1 sharded state dicts and
  fairscale's flat parameters (1-D, before padding) all shard this way.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Region:
    """A box ``[offsets, offsets + shape)`` inside a tensor."""

    offsets: Shape
    shape: Shape

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.shape):
            raise ValueError(f"region rank mismatch: offsets {self.offsets}, shape {self.shape}")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in self.shape):
            raise ValueError(f"region has negative offsets or lengths: {self}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stops(self) -> Shape:
        return tuple(o + s for o, s in zip(self.offsets, self.shape))

    def empty(self) -> bool:
        return self.numel == 0

    @staticmethod
    def full(shape: Sequence[int]) -> Region:
        return Region(tuple(0 for _ in shape), tuple(shape))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.shape) and all(
            st <= d for st, d in zip(self.stops, shape)
        )

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "shape": list(self.shape)}

    @staticmethod
    def from_json(d: dict) -> Region:
        return Region(tuple(int(x) for x in d["offsets"]), tuple(int(x) for x in d["shape"]))


def intersect(a: Region, b: Region) -> Region | None:
    """The overlap of two regions of the same tensor, or None if they do not overlap."""
    if len(a.shape) != len(b.shape):
        raise ValueError(f"cannot intersect regions of different rank: {a} and {b}")
    offs = []
    shape = []
    for ao, asz, bo, bsz in zip(a.offsets, a.shape, b.offsets, b.shape):
        lo = max(ao, bo)
        hi = min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        shape.append(hi - lo)
    if not a.shape:  # 0-d tensors: both regions are the single element
        return Region((), ())
    return Region(tuple(offs), tuple(shape))


def shift(region: Region, origin: Sequence[int]) -> Region:
    """``region`` expressed relative to ``origin`` (which must not lie beyond it)."""
    return Region(tuple(o - g for o, g in zip(region.offsets, origin)), region.shape)


def dim0_chunk_len(d0: int, world: int) -> int:
    """Rows per rank when ``d0`` rows are split like ``torch.chunk`` over ``world`` ranks."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    return max(1, -(-d0 // world)) if d0 > 0 else 1


def dim0_shard(shape: Sequence[int], world: int, rank: int) -> Region:
    """The region of a dim-0 sharded tensor that ``rank`` of ``world`` holds (may be empty)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of size {world}")
    shape = tuple(shape)
    if not shape:
        raise ValueError("a 0-d tensor cannot be sharded along dim 0")
    c = dim0_chunk_len(shape[0], world)
    lo = min(shape[0], rank * c)
    hi = min(shape[0], (rank + 1) * c)
    return Region((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:])


def dim0_chunk_shape(shape: Sequence[int], world: int) -> Shape:
    """Chunk shape of an array whose chunks align with ``world`` dim-0 shards."""
    shape = tuple(shape)
    if not shape:
        return ()
    return (dim0_chunk_len(shape[0], world),) + tuple(max(1, d) for d in shape[1:])


def grid_coords(region: Region, chunk_shape: Sequence[int]) -> Shape | None:
    """Chunk coordinates if ``region`` is exactly one chunk of the grid (clipped at the
    array's far edge by the caller), else None."""
    coords = []
    for o, c in zip(region.offsets, chunk_shape):
        if c <= 0 or o % c:
            return None
        coords.append(o // c)
    return tuple(coords)


def chunk_region(coords: Sequence[int], chunk_shape: Sequence[int], shape: Sequence[int]) -> Region:
    """The region of the array covered by chunk ``coords`` (clipped at the array edge)."""
    offs = tuple(i * c for i, c in zip(coords, chunk_shape))
    sizes = tuple(max(0, min(c, d - o)) for o, c, d in zip(offs, chunk_shape, shape))
    return Region(offs, sizes)


def is_grid_chunk(region: Region, chunk_shape: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether ``region`` is exactly chunk ``grid_coords(region)`` of the array."""
    coords = grid_coords(region, chunk_shape)
    return coords is not None and chunk_region(coords, chunk_shape, shape) == region


def chunks_overlapping(region: Region, chunk_shape: Sequence[int]) -> Iterator[Shape]:
    """Coordinates of every chunk of the grid that ``region`` touches, in C order."""
    if region.empty():
        return
    ranges = [
        range(o // c, (o + s - 1) // c + 1)
        for o, s, c in zip(region.offsets, region.shape, chunk_shape)
    ]

    def rec(i: int, prefix: tuple[int, ...]) -> Iterator[Shape]:
        if i == len(ranges):
            yield prefix
            return
        for x in ranges[i]:
            yield from rec(i + 1, prefix + (x,))

    yield from rec(0, ())


def flat_range_rows(start: int, stop: int, shape: Sequence[int]) -> Region:
    """The smallest dim-0 row range of a C-ordered tensor that holds flat ``[start, stop)``."""
    shape = tuple(shape)
    if not shape:
        return Region((), ())
    row = math.prod(shape[1:]) or 1
    lo = start // row
    hi = -(-stop // row) if stop > start else lo
    return Region((lo,) + (0,) * (len(shape) - 1), (hi - lo,) + shape[1:])


def is_row_range(region: Region, shape: Sequence[int]) -> bool:
    """Whether ``region`` spans whole rows (all dims but 0 complete): a contiguous range."""
    return tuple(region.offsets[1:]) == (0,) * (len(shape) - 1) and tuple(
        region.shape[1:]
    ) == tuple(shape[1:])


def balance_owners(sizes: Sequence[int], world: int) -> list[int]:
    """Assign each replicated tensor (by byte size) one writing rank, balancing bytes.

    Deterministic: every rank computes the same answer from the same list.  Greedy
    largest-first onto the least-loaded rank (ties to the lowest rank).  O(n log n) whatever
    the world size (a reshard plans every one of ``world`` destination ranks with it).
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    owners = [0] * len(sizes)
    # (load, rank) of every rank that was given a tensor; the others have load 0, and the
    # lowest of them is ``fresh``
    heap: list[tuple[int, int]] = []
    fresh = 0
    for i in order:
        if fresh < world and (not heap or (0, fresh) < heap[0]):
            load, r = 0, fresh
            fresh += 1
        else:
            load, r = heapq.heappop(heap)
        owners[i] = r
        heapq.heappush(heap, (load + sizes[i], r))
    return owners
