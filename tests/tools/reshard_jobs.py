"""Rank functions for the tools tests: save FSDP2, FSDP1 and fairscale FSDP checkpoints
at one world size, and load checkpoints at another, bit-exactly.

FSDP2/FSDP1 reuse ``tests/integration/test_torch_fsdp.py`` (train 3 steps, save, record
the full state; load, compare the full state bit-exactly, train one more step).

fairscale FSDP's forward/backward need CUDA, so its "training" is simulated as in
``tests/unit/test_fairscale_adapter.py``: shards changed in place by an elementwise
transform, optimizer state created by a real CPU ``optimizer.step()`` then overwritten
with elementwise functions of the parameters.  The expected logical tensors come from
the unwrapped module alone (:func:`fairscale_expected`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from ckptd_client import CheckpointClient
from integration.test_torch_fsdp import assert_equal_state, build, full_state, save_job
from torch import nn
from fairscale_helpers import simulate_step, unpadded_lengths

TORCH_FRAMEWORKS = ("fsdp2", "fsdp1")
CPU = torch.device("cpu")


# --------------------------------------------------------------------------- fairscale


def fairscale_unwrapped(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(7, 13),  # 104 elements: fairscale shard lengths differ for 2, 3, 4 ranks
        nn.ReLU(),
        nn.Sequential(nn.Linear(13, 5), nn.LayerNorm(5)),  # own FSDP instance
        nn.BatchNorm1d(5),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
        model[3].running_mean.copy_(torch.randn(5))
        model[3].running_var.copy_(torch.rand(5) + 0.5)
        model[3].num_batches_tracked.fill_(seed % 97)
    return model


def fairscale_wrap(model: nn.Module) -> nn.Module:
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    model[2] = FSDP(model[2], compute_device=CPU)
    return FSDP(model, compute_device=CPU)


def _transform_(t: torch.Tensor) -> None:
    t.mul_(-1.5).add_(0.25)


def _state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"exp_avg": p * 3.0 + 1.0, "exp_avg_sq": p * p + 0.5}


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3, betas=(0.8, 0.95), weight_decay=0.01)


def fairscale_train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    simulate_step(model, opt, _transform_, _state, {"step": torch.tensor(7.0)})


def fairscale_expected(seed: int) -> dict[str, torch.Tensor]:
    """Logical tensors (``model/<fqn>``, ``optim/<fqn>/<key>``) from the unwrapped model."""
    u = fairscale_unwrapped(seed)
    with torch.no_grad():
        for p in u.parameters():
            _transform_(p)
    exp = {f"model/{k}": v.clone() for k, v in u.state_dict().items()}
    for n, p in u.named_parameters():
        for k, v in _state(p.detach()).items():
            exp[f"optim/{n}/{k}"] = v
        exp[f"optim/{n}/step"] = torch.tensor(7.0)
    return exp


def fairscale_save(rank: int, world: int, root: str, job: str) -> None:
    model = fairscale_wrap(fairscale_unwrapped(11))
    opt = _optimizer(model.parameters())
    fairscale_train(model, opt)
    client = CheckpointClient(job, storage=f"file://{root}", pack_threshold=96)
    info = client.save_async(model, optimizer=opt, step=3, extra={"world": world}).result(120)
    assert info.step == 3 and info.world_size == world and info.framework == "fairscale"
    client.close()
    if rank == 0:
        torch.save(fairscale_expected(11), os.path.join(root, f"{job}.expected.pt"))


def fairscale_load(rank: int, world: int, root: str, jobs: list[str]) -> None:
    """Load each job at ``world`` ranks and compare every local shard (parameters and
    optimizer state) with what fairscale itself builds from the expected full values."""
    for job in jobs:
        exp = torch.load(os.path.join(root, f"{job}.expected.pt"), weights_only=True)
        model = fairscale_wrap(fairscale_unwrapped(5))
        opt = _optimizer(model.parameters())
        client = CheckpointClient(job, storage=f"file://{root}")
        info = client.load(model, optimizer=opt)
        assert info.step == 3 and info.extra is not None and info.extra["world"] in (2, 4)
        client.close()
        # the reference: fairscale shards the expected full values itself at this world size
        refs = {}
        for key in ("model", "exp_avg", "exp_avg_sq"):
            u = fairscale_unwrapped(0)
            with torch.no_grad():
                for n, p in u.named_parameters():
                    p.copy_(exp[f"model/{n}"] if key == "model" else exp[f"optim/{n}/{key}"])
            refs[key] = fairscale_wrap(u)
        valid = unpadded_lengths(model)
        params = list(model.parameters())
        for key, ref in refs.items():
            for p, pr in zip(params, ref.parameters(), strict=True):
                got = p.data if key == "model" else opt.state[p][key]
                n = valid[id(p)]
                assert torch.equal(got.reshape(-1)[:n], pr.data.reshape(-1)[:n]), (job, key)
            for p in params:
                assert torch.equal(opt.state[p]["step"].float(), torch.tensor(7.0))
        bn = dict(model.named_buffers())
        for name, b in bn.items():
            clean = name.replace("_fsdp_wrapped_module.", "").replace("_fpw_module.", "")
            assert torch.equal(b.to(exp[f"model/{clean}"].dtype), exp[f"model/{clean}"]), name
    dist.barrier()


# --------------------------------------------------------------------------- launches


def save_all(rank: int, world: int, root: str) -> None:
    """Save ``<framework>-w<world>`` for FSDP2, FSDP1 and fairscale."""
    for fw in TORCH_FRAMEWORKS:
        save_job(rank, world, fw, root, f"{fw}-w{world}", "float32")
    fairscale_save(rank, world, root, f"fairscale-w{world}")


def torch_load(rank: int, world: int, framework: str, root: str, jobs: list[str]) -> None:
    """Like ``test_torch_fsdp.load_job`` (full model and optimizer state compared
    bit-exactly with what was saved), without the extra training step."""
    for job in jobs:
        model, opt = build(framework, world, seed=2)
        client = CheckpointClient(job, storage=f"file://{root}")
        info = client.load(model, optimizer=opt)
        assert info.step == 3
        want = torch.load(os.path.join(root, f"{job}.expected.pt"), weights_only=True)
        if framework == "fsdp2":
            _check_local_dtensors(model, opt, want, job, rank)
            client.close()
            continue
        assert_equal_state(full_state(model, opt), want, f"{job} at rank {rank}")
        client.close()
    dist.barrier()


def _check_local_dtensors(model: nn.Module, opt: torch.optim.Optimizer,
                          want: dict[str, Any], job: str, rank: int) -> None:
    """FSDP2: every local shard (parameters and optimizer state) equals the saved full
    tensor's region for this rank (no collectives, so cheap at 16 ranks)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def region_of(t: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, DTensor):
            return full
        shape, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return full[tuple(slice(o, o + s) for o, s in zip(off, shape))]

    names = {}
    for fqn, p in model.named_parameters():
        names[p] = fqn
        got = p.to_local() if isinstance(p, DTensor) else p
        assert torch.equal(got.detach(), region_of(p, want[f"model/{fqn}"])), (job, fqn, rank)
    n = 0
    for p, st in opt.state.items():
        for k, v in st.items():
            full = want[f"optim/{names[p]}/{k}"]
            got = v.to_local() if isinstance(v, DTensor) else v
            assert torch.equal(got, region_of(v, full)), (job, names[p], k, rank)
            n += 1
    assert n == len([k for k in want if k.startswith("optim/")]), (job, n)


def load_all(rank: int, world: int, root: str, jobs: dict[str, list[str]]) -> None:
    """Load every job of ``jobs`` (framework -> job names) at ``world`` ranks."""
    for fw in TORCH_FRAMEWORKS:
        if jobs.get(fw):
            torch_load(rank, world, fw, root, jobs[fw])
    if jobs.get("fairscale"):
        fairscale_load(rank, world, root, jobs["fairscale"])


def reshard_under_workers(rank: int, world: int, argv: list[str]) -> None:
    """Every worker of a torchrun-like group runs the same ``ckptd reshard`` command."""
    from ckptd.cli import main

    assert main(argv) == 0
