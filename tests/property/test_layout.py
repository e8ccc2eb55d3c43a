"""Property tests of the pure layout and planning code: every element of every logical
tensor is covered exactly once, for any shapes and any save/load world sizes."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.format.items import FlatView, SaveItem
from ckptd.format.layout import (
    Region,
    balance_owners,
    chunk_region,
    chunks_overlapping,
    dim0_chunk_shape,
    dim0_shard,
    flat_range_rows,
    intersect,
    is_grid_chunk,
)
from ckptd.format.manifest import Index, RankManifest
from ckptd.format.plan import plan_rank_save

shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
worlds = st.integers(1, 9)


def _mark(counts: np.ndarray, region: Region) -> None:
    if counts.ndim == 0:
        counts[()] += 1
        return
    counts[tuple(slice(o, o + s) for o, s in zip(region.offsets, region.shape))] += 1


@given(shapes.filter(lambda s: len(s) > 0), worlds)
def test_dim0_shards_partition_the_tensor(shape, world):
    counts = np.zeros(shape, dtype=np.int64)
    for r in range(world):
        reg = dim0_shard(shape, world, r)
        assert reg.within(shape)
        _mark(counts, reg)
        if shape and not reg.empty():
            assert is_grid_chunk(reg, dim0_chunk_shape(shape, world), shape)
    assert (counts == 1).all()


@given(shapes.filter(lambda s: len(s) > 0), st.data())
def test_chunks_overlapping_cover_region_exactly(shape, data):
    chunk = tuple(data.draw(st.integers(1, 5)) for _ in shape)
    offs = tuple(data.draw(st.integers(0, d)) for d in shape)
    size = tuple(data.draw(st.integers(0, d - o)) for o, d in zip(offs, shape))
    want = Region(offs, size)
    counts = np.zeros(shape, dtype=np.int64)
    for c in chunks_overlapping(want, chunk):
        sub = intersect(chunk_region(c, chunk, shape), want)
        assert sub is not None
        _mark(counts, sub)
    expect = np.zeros(shape, dtype=np.int64)
    _mark(expect, want)
    assert (counts == expect).all()


@given(st.integers(0, 50), st.data())
def test_flat_range_rows_holds_the_range(n, data):
    shape = (n, data.draw(st.integers(1, 5)))
    total = math.prod(shape)
    lo = data.draw(st.integers(0, total))
    hi = data.draw(st.integers(lo, total))
    rows = flat_range_rows(lo, hi, shape)
    row = shape[1]
    assert rows.offsets[0] * row <= lo and (hi <= (rows.offsets[0] + rows.shape[0]) * row
                                            or hi == lo)
    assert rows.within(shape)


@given(st.lists(st.integers(0, 1000), max_size=30), st.integers(1, 40))
def test_balance_owners_assigns_every_tensor_once(sizes, world):
    owners = balance_owners(sizes, world)
    assert len(owners) == len(sizes) and all(0 <= o < world for o in owners)
    assert owners == balance_owners(list(sizes), world)  # deterministic
    if sizes:
        loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(world)]
        assert max(loads) - min(loads) <= max(sizes)
    # exactly the greedy rule: largest first onto the least-loaded rank, ties to the lowest
    load = [0] * world
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        assert owners[i] == min(range(world), key=lambda k: (load[k], k))
        load[owners[i]] += sizes[i]


def fsdp2_items(rank: int, world: int, tensors: dict[str, tuple[int, ...]],
                replicated: dict[str, tuple[int, ...]], flat: tuple[int, ...]) -> list[SaveItem]:
    items = []
    for name, shape in tensors.items():
        if not shape:  # a 0-d tensor cannot be sharded: every rank holds it
            replicated = {**replicated, name: shape}
            continue
        reg = dim0_shard(shape, world, rank)
        items.append(SaveItem(name, shape, torch.float32, torch.empty(reg.shape, device="meta"),
                              reg, chunk_shape=dim0_chunk_shape(shape, world)))
    for name, shape in replicated.items():
        items.append(SaveItem(name, shape, torch.bfloat16, torch.empty(shape, device="meta",
                                                                       dtype=torch.bfloat16),
                              Region.full(shape), replicated=True))
    if flat:
        n = sum(flat)
        reg = dim0_shard((n,), world, rank)
        views, start = [], 0
        for i, k in enumerate(flat):
            views.append(FlatView(f"model/flat{i}", (k,), torch.float32, start))
            start += k
        items.append(SaveItem("flat/model/fp", (n,), torch.float32,
                              torch.empty(reg.shape, device="meta"), reg,
                              chunk_shape=dim0_chunk_shape((n,), world), logical=False,
                              views=views))
    return items


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(st.sampled_from(["model/a", "model/b", "optim/a/exp_avg"]), shapes,
                    max_size=3),
    st.dictionaries(st.sampled_from(["model/r1", "model/r2", "optim/a/step"]), shapes,
                    max_size=3),
    st.lists(st.integers(1, 7), max_size=3).map(tuple),
    worlds,
    st.sampled_from([0, 16, 1 << 20]),
)
def test_planned_pieces_cover_each_logical_tensor_exactly_once(tensors, replicated, flat,
                                                                world, threshold):
    manifests = []
    for r in range(world):
        plan = plan_rank_save(fsdp2_items(r, world, tensors, replicated, flat), r, world,
                              threshold)
        # no two objects of one rank overlap in the staging buffer
        spans = sorted((c.offset, c.offset + c.nbytes) for c in plan.copies)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        manifests.append(RankManifest("j", 1, "a", r, world, "fsdp2", 0.0, plan.arrays,
                                      plan.packs, plan.tensors))
    index = Index.merge(manifests)
    # every chunk of every array is written by exactly one rank
    for r_i, m in enumerate(manifests):
        for r_j, other in enumerate(manifests[r_i + 1:], r_i + 1):
            for name in set(m.arrays) & set(other.arrays):
                assert not set(m.arrays[name].chunks) & set(other.arrays[name].chunks)
    expected = {**tensors, **replicated, **{f"model/flat{i}": (k,) for i, k in enumerate(flat)}}
    assert set(index.tensors) == set(expected)
    for name, shape in expected.items():
        t = index.tensors[name]
        assert t.shape == shape
        counts = np.zeros(shape, dtype=np.int64)
        for p in t.pieces:
            assert p.region.within(shape)
            _mark(counts, p.region)
        assert (counts == 1).all(), (name, counts)
