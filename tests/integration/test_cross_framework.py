"""A fairscale FSDP checkpoint loads into an FSDP2 model of another world size, and back.

fairscale (flat parameters, world 2) -> FSDP2 (DTensor Shard(0), world 3): every parameter,
buffer and AdamW state equals the fairscale job's gathered full state bit-exactly.  The FSDP2
job then trains one step, saves, and a fairscale job at world 2 restores exactly what FSDP2
holds.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_world
from test_fairscale_roundtrip import full_state as fairscale_full_state
from test_fairscale_roundtrip import optimizer, save_job, train, unwrapped, wrap
from test_torch_fsdp import assert_equal_state
from test_torch_fsdp import full_state as torch_full_state

from ckptd_client import CheckpointClient

JOB = "flat-fp32-w2"  # written by test_fairscale_roundtrip.save_job at world 2


def _fsdp2(model: torch.nn.Module, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def fsdp2_job(rank: int, world: int, root: str) -> None:
    want = torch.load(os.path.join(root, f"{JOB}.expected.pt"), weights_only=True)
    model = _fsdp2(unwrapped(seed=11), world)
    opt = optimizer(model.parameters(), lr=0.5)
    info = CheckpointClient(JOB, storage=f"file://{root}").load(model, optimizer=opt)
    assert info.framework == "fairscale" and info.world_size == 2
    assert_equal_state(torch_full_state(model, opt), want, "fairscale -> fsdp2")
    assert opt.param_groups[0]["lr"] == 1e-2  # hyperparameters restored too
    train(model, opt, 1)
    expected = torch_full_state(model, opt)
    client = CheckpointClient("from-fsdp2", storage=f"file://{root}")
    client.save(model, optimizer=opt, step=9)
    client.close()
    if rank == 0:
        torch.save(expected, os.path.join(root, "from-fsdp2.expected.pt"))


def fairscale_job(rank: int, world: int, root: str) -> None:
    want = torch.load(os.path.join(root, "from-fsdp2.expected.pt"), weights_only=True)
    model = wrap(unwrapped(seed=12), True, torch.float32)
    opt = optimizer(model.parameters(), lr=0.5)
    info = CheckpointClient("from-fsdp2", storage=f"file://{root}").load(model, optimizer=opt)
    assert info.framework == "fsdp2" and info.world_size == 3
    assert_equal_state(fairscale_full_state(model, opt), want, "fsdp2 -> fairscale")
    dist.barrier()


@pytest.mark.slow
def test_fairscale_to_fsdp2_and_back(tmp_path: Any) -> None:
    root = str(tmp_path)
    run_world(save_job, 2, root)
    run_world(fsdp2_job, 3, root)
    run_world(fairscale_job, 2, root)
