"""Property test of the whole format path through a storage backend (in memory): random
shapes and dtypes saved at one world size and read back at another are bit-exact, for
region targets (FSDP2/FSDP1) and flat-range targets (fairscale flat shards)."""

from __future__ import annotations

import math
import uuid

import fsspec
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptd.format import paths
from ckptd.format.commit import read_index, resolve_step, try_commit
from ckptd.format.items import LoadTarget
from ckptd.format.layout import dim0_shard
from ckptd.format.plan import plan_rank_save
from ckptd.format.reader import CheckpointReader
from ckptd.format.writer import SaveIdentity, write_rank
from ckptd.storage.fsspec_backend import FsspecBackend
from test_layout import fsdp2_items

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool,
          torch.float8_e4m3fn, torch.float8_e5m2]


def random_tensor(shape, dtype, gen):
    raw = torch.randint(0, 256, (math.prod(shape) * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple),
    st.lists(st.integers(1, 9), max_size=3).map(tuple),
    st.sampled_from(DTYPES),
    st.integers(1, 5),
    st.integers(1, 5),
    st.sampled_from([0, 40, 1 << 20]),
    st.integers(0, 2**31),
)
def test_write_then_read_at_another_world_size(shape, flat, dtype, w_save, w_load, threshold,
                                               seed):
    gen = torch.Generator().manual_seed(seed)
    full = {"model/a": random_tensor(shape, dtype, gen),
            "model/r": random_tensor(shape[:1], dtype, gen)}
    flat_full = [random_tensor((k,), torch.float32, gen) for k in flat]
    flat_cat = torch.cat(flat_full) if flat else torch.empty(0)
    storage = FsspecBackend(fsspec.filesystem("memory"), f"/t{uuid.uuid4().hex}", "memory://")
    for r in range(w_save):
        items = fsdp2_items(r, w_save, {"model/a": shape}, {"model/r": shape[:1]}, flat)
        for it in items:
            if it.name == "flat/model/fp":
                reg = it.region
                it.local = flat_cat[reg.offsets[0]:reg.offsets[0] + reg.shape[0]]
            elif it.name == "model/r":
                it.local, it.dtype = full["model/r"], dtype
            else:
                reg = it.region
                it.dtype = dtype
                it.local = full["model/a"][tuple(slice(o, o + s) for o, s in
                                                 zip(reg.offsets, reg.shape))]
        plan = plan_rank_save(items, r, w_save, threshold)
        buf = torch.zeros(plan.nbytes, dtype=torch.uint8)
        from ckptd_client.staging import stage

        stage(plan, items, buf)
        write_rank(storage, SaveIdentity("job", 7, "att", r, w_save, "test"), plan, buf.numpy())
    assert try_commit(storage, "job", 7, "att", w_save) is not None
    rec = resolve_step(storage, "job", None)
    index = read_index(storage, rec)
    reader = CheckpointReader(storage, index, paths.attempt_prefix("job", 7, "att"),
                              max_inflight_bytes=64)
    for r in range(w_load):
        reg = dim0_shard(shape, w_load, r)
        out = torch.empty(reg.shape, dtype=dtype)
        targets = [LoadTarget("model/a", shape, dtype, out, region=reg)]
        # fairscale-style: this rank's flat shard of the concatenation, per view
        n = sum(flat)
        freg = dim0_shard((n,), w_load, r)
        lo, hi = freg.offsets[0], freg.offsets[0] + freg.shape[0]
        fout = torch.full((hi - lo,), -1.0)
        start = 0
        for i, k in enumerate(flat):
            a, b = max(lo, start), min(hi, start + k)
            if a < b:
                targets.append(LoadTarget(f"model/flat{i}", (k,), torch.float32,
                                          fout[a - lo:b - lo], flat_range=(a - start, b - start)))
            start += k
        reader.read_targets(targets)
        want = full["model/a"][tuple(slice(o, o + s) for o, s in zip(reg.offsets, reg.shape))]
        assert torch.equal(out.view(torch.uint8), want.contiguous().view(torch.uint8))
        assert torch.equal(fout.view(torch.int32), flat_cat[lo:hi].view(torch.int32))  # NaN-safe
    got_r = reader.read_region("model/r")
    assert torch.equal(got_r.view(torch.uint8), full["model/r"].view(torch.uint8))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(1, 9), st.integers(1, 9), st.integers(1, 4),
       st.sampled_from([torch.float32, torch.bfloat16, torch.bool]), st.integers(0, 2**31))
def test_sharded_along_dim1_uneven_round_trips(d0, d1, d2, world, dtype, seed):
    """Tensor-parallel style Shard(1) with a dim that does not divide: the edge chunk is
    padded inside each row (zarr stores edge chunks at full size), not at its end."""
    gen = torch.Generator().manual_seed(seed)
    shape = (d0, d1, d2)
    full = random_tensor(shape, dtype, gen)
    c = -(-d1 // world)
    chunk = (d0, c, d2)
    storage = FsspecBackend(fsspec.filesystem("memory"), f"/t{uuid.uuid4().hex}", "memory://")
    from ckptd.format.items import SaveItem
    from ckptd.format.layout import Region
    from ckptd_client.staging import stage

    for r in range(world):
        lo, hi = min(d1, r * c), min(d1, (r + 1) * c)
        reg = Region((0, lo, 0), (d0, hi - lo, d2))
        item = SaveItem("model/tp", shape, dtype, full[:, lo:hi, :], reg, chunk_shape=chunk)
        plan = plan_rank_save([item], r, world, pack_threshold=0)
        buf = torch.zeros(plan.nbytes, dtype=torch.uint8)
        stage(plan, [item], buf)
        write_rank(storage, SaveIdentity("job", 1, "a", r, world, "test"), plan, buf.numpy())
    assert try_commit(storage, "job", 1, "a", world) is not None
    index = read_index(storage, resolve_step(storage, "job", None))
    reader = CheckpointReader(storage, index, paths.attempt_prefix("job", 1, "a"))
    got = reader.read_region("model/tp")
    assert torch.equal(got.view(torch.uint8), full.view(torch.uint8))
