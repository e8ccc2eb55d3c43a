"""DTensor parameters sharded along dim 1 (tensor-parallel style), with a dim that does not
divide the world size: saved at 2 ranks, loaded at 3 ranks and into a plain module."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_world

from ckptd_client import CheckpointClient


def _model(world: int, seed: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(seed)
    full = torch.randn(7, 5)
    mesh = init_device_mesh("cpu", (world,))
    m = torch.nn.Linear(5, 7, bias=False)
    m.weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(1)]))
    return m, full


def save_job(rank: int, world: int, root: str) -> None:
    m, full = _model(world, seed=1)
    CheckpointClient("tp", storage=f"file://{root}", pack_threshold=0).save(m, step=1)
    if rank == 0:
        torch.save(full, os.path.join(root, "full.pt"))


def load_job(rank: int, world: int, root: str) -> None:
    m, _ = _model(world, seed=2)
    CheckpointClient("tp", storage=f"file://{root}").load(m)
    want = torch.load(os.path.join(root, "full.pt"), weights_only=True)
    assert torch.equal(m.weight.full_tensor(), want)


@pytest.mark.slow
def test_shard1_uneven_saved_at_2_loads_at_3_and_plain(tmp_path):
    root = str(tmp_path)
    run_world(save_job, 2, root)
    run_world(load_job, 3, root)
    plain = torch.nn.Linear(5, 7, bias=False)
    CheckpointClient("tp", storage=f"file://{root}").load(plain)
    assert torch.equal(plain.weight.detach(), torch.load(os.path.join(root, "full.pt"),
                                                         weights_only=True))
