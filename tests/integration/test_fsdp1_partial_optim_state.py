"""A checkpoint in which some parameters have no optimizer state (no gradient when it was
saved: an unused layer), saved by FSDP2 and loaded into FSDP1 at 2 ranks.

FSDP1 keeps one optimizer state per flat parameter and cannot hold state for only some of
its parameters: with ``use_orig_params=False`` loading such state failed inside torch
(after the model was loaded), with ``use_orig_params=True`` the load passed but the next
save failed.  The parameters without saved state get what zero gradients give (zeros for
Adam's moments) and their flat parameter's step; every saved tensor is restored bit-exactly.
A frozen layer (``requires_grad=False``, not in the optimizer, as in LoRA-style fine-tuning)
shares the flat parameter with trained ones under ``use_orig_params=True``: it gets no
optimizer state (the load failed with ``KeyError`` after the model was overwritten).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from ckptd_client import CheckpointClient
from distributed import run_world
from test_torch_fsdp import full_state


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(6, 13)
        self.unused = torch.nn.Linear(3, 3)
        self.frozen = torch.nn.Linear(13, 13)
        self.frozen.requires_grad_(False)
        self.l2 = torch.nn.Linear(13, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.frozen(torch.relu(self.l1(x))))


def trained(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for i in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def save_job(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(trained(model), lr=1e-2, foreach=False)
    train(model, opt, 2)
    want = full_state(model, opt)
    assert not any(k.startswith("optim/unused.") for k in want)
    with CheckpointClient("partial", storage=f"file://{root}") as client:
        client.save(model, optimizer=opt, step=2)
    if rank == 0:
        torch.save(want, os.path.join(root, "want.pt"))


def load_job(rank: int, world: int, root: str) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    want = torch.load(os.path.join(root, "want.pt"), weights_only=True)
    for orig in (True, False):
        torch.manual_seed(2)
        net = Net()
        if not orig:  # a flat parameter of frozen and trained ones needs use_orig_params
            net.frozen = FSDP(net.frozen, device_id=torch.device("cpu"), use_orig_params=orig)
        model = FSDP(net, device_id=torch.device("cpu"), use_orig_params=orig)
        opt = torch.optim.Adam(trained(model), lr=1e-2, foreach=False)
        client = CheckpointClient("partial", storage=f"file://{root}")
        client.load(model, optimizer=opt)
        got = full_state(model, opt)  # torch's own FSDP1 state dict of the loaded state
        for k, w in want.items():
            assert torch.equal(got[k], w), f"{k} differs (use_orig_params={orig})"
        assert not any(k.startswith("optim/frozen.") for k in got), sorted(got)
        step = got["optim/l1.weight/step"]
        for p in ("unused.weight", "unused.bias"):
            assert torch.equal(got[f"optim/{p}/step"], step), p
            for key in ("exp_avg", "exp_avg_sq"):
                assert not got[f"optim/{p}/{key}"].any(), (p, key)
        client.save(model, optimizer=opt, step=3 + int(orig))
        train(model, opt, 1)
        client.close()
    dist.barrier()


@pytest.mark.slow
def test_fsdp2_state_without_unused_layers_loads_into_fsdp1(tmp_path):
    run_world(save_job, 2, str(tmp_path))
    run_world(load_job, 2, str(tmp_path))
