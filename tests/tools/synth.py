"""Small synthetic checkpoints written through the real format code in one process
(no torch.distributed): fast fixtures for ls/verify/gc tests, on any storage backend."""

from __future__ import annotations

import torch
from ckptd_client.staging import stage

from ckptd.format.commit import try_commit
from ckptd.format.items import SaveItem
from ckptd.format.layout import Region, dim0_chunk_shape, dim0_shard
from ckptd.format.plan import plan_rank_save
from ckptd.format.writer import SaveIdentity, write_rank
from ckptd.storage.base import StorageBackend

SHAPES = {"model/w": (10, 4), "model/b": (10,), "optim/w/exp_avg": (10, 4)}


def full_tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def write_step(storage: StorageBackend, job: str, step: int, attempt: str, world: int = 2,
               commit: bool = True, ranks: list[int] | None = None,
               pack_threshold: int = 16) -> dict[str, torch.Tensor]:
    """Write ``ranks`` (default all) of a dim-0 sharded save; commit if every rank wrote."""
    full = full_tensors(step)
    for r in (range(world) if ranks is None else ranks):
        items = []
        for name, t in full.items():
            reg = dim0_shard(t.shape, world, r)
            local = t[reg.offsets[0]:reg.offsets[0] + reg.shape[0]].contiguous()
            items.append(SaveItem(name, tuple(t.shape), t.dtype, local, reg,
                                  chunk_shape=dim0_chunk_shape(t.shape, world)))
        items.append(SaveItem("model/scale", (), torch.float64, torch.tensor(2.5, dtype=torch.float64),
                              Region((), ()), replicated=True))
        plan = plan_rank_save(items, r, world, pack_threshold)
        buf = torch.zeros(plan.nbytes, dtype=torch.uint8)
        stage(plan, items, buf)
        write_rank(storage, SaveIdentity(job, step, attempt, r, world, "fsdp2"), plan,
                   buf.numpy(), extra={"user": {"step": step}})
    if commit:
        assert try_commit(storage, job, step, attempt, world) is not None
    return full
