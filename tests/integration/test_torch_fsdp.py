"""Save at world sizes 1, 2, 4 and load at 1, 2, 3, 4, bit-exact, with FSDP2 and FSDP1.

Real multi-process gloo groups on CPU.  Each save job trains a few steps of a small model
with uneven dims (13 rows do not divide 2, 3 or 4), records the full (unsharded) model and
optimizer state as the expected values, and saves; each load job builds a fresh model at
another world size, loads every saved checkpoint and compares full states bit-exactly.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from distributed import run_world

from ckptd_client import CheckpointClient

SAVE_WORLDS = (1, 2, 4)
LOAD_WORLDS = (1, 2, 3, 4)


class Net(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.l1 = torch.nn.Linear(6, 13)
        self.norm = torch.nn.LayerNorm(13)
        self.l2 = torch.nn.Linear(13, 5, bias=False)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.norm(torch.relu(self.l1(self.emb(x)))))


def wrap(model: torch.nn.Module, framework: str, world: int) -> torch.nn.Module:
    if framework == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in (model.l1, model.l2):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if framework == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        return FSDP(model, device_id=torch.device("cpu"), use_orig_params=True)
    if framework == "plain":
        return model
    raise ValueError(framework)


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    o = StateDictOptions(full_state_dict=True, cpu_offload=False)
    out = {f"model/{k}": v.clone() for k, v in get_model_state_dict(model, options=o).items()}
    if opt is not None:
        osd = get_optimizer_state_dict(model, opt, options=o)
        for fqn, st in osd["state"].items():
            for k, v in st.items():
                out[f"optim/{fqn}/{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def build(framework: str, world: int, seed: int, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    model = wrap(Net(dtype), framework, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randint(0, 11, (8,), generator=g)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def save_job(rank: int, world: int, framework: str, root: str, job: str, dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    model, opt = build(framework, world, seed=1, dtype=dtype)
    train(model, opt, 3, rank)
    expected = full_state(model, opt)
    client = CheckpointClient(job, storage=f"file://{root}", pack_threshold=96)
    info = client.save_async(model, optimizer=opt, step=3, extra={"world": world}).result(120)
    assert info.step == 3 and info.world_size == world
    if rank == 0:
        torch.save(expected, os.path.join(root, f"{job}.expected.pt"))
    client.close()


def assert_equal_state(got: dict, want: dict, what: str = "") -> None:
    """Same keys; tensors of the same dtype and bit-identical, other values equal."""
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for k, b in want.items():
        a = got[k]
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {k} differs"
        else:
            assert a == b, (what, k, a, b)


def load_job(rank: int, world: int, framework: str, root: str, jobs: list[str],
             dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    for job in jobs:
        model, opt = build(framework, world, seed=2, dtype=dtype)
        client = CheckpointClient(job, storage=f"file://{root}")
        info = client.load(model, optimizer=opt)
        assert info.step == 3
        want = torch.load(os.path.join(root, f"{job}.expected.pt"), weights_only=True)
        assert_equal_state(full_state(model, opt), want, f"{job} at rank {rank}")
        # training goes on after a load (optimizer state is usable)
        train(model, opt, 1, rank)
        client.close()
    dist.barrier()


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["fsdp2", "fsdp1"])
def test_save_load_every_world_size_pair(tmp_path, framework):
    root = str(tmp_path)
    jobs = []
    for w in SAVE_WORLDS:
        job = f"{framework}-w{w}"
        run_world(save_job, w, framework, root, job, "float32")
        jobs.append(job)
    for w in LOAD_WORLDS:
        run_world(load_job, w, framework, root, jobs, "float32")


@pytest.mark.slow
def test_bfloat16_fsdp2_and_cross_framework(tmp_path):
    """bf16 FSDP2 at 2 ranks -> FSDP2 at 3, FSDP1 at 2 and a plain module at 1."""
    root = str(tmp_path)
    run_world(save_job, 2, "fsdp2", root, "bf16", "bfloat16")
    run_world(load_job, 3, "fsdp2", root, ["bf16"], "bfloat16")
    run_world(load_job, 2, "fsdp1", root, ["bf16"], "bfloat16")
    run_world(load_job, 1, "plain", root, ["bf16"], "bfloat16")
