"""fairscale FSDP through CheckpointClient: save at world 2 and 4, load at 1, 2, 3 and 4.

Real gloo process groups on CPU, embedded mode (``storage="file://..."``).  fairscale FSDP
cannot run forward/backward or gather full parameters without CUDA, so the save job sets
deterministic gradients on the shards and takes real optimizer steps, then gathers its own
full state from the shards with ``all_gather`` (fairscale's metadata unflattens it) as the
expected values.  Each load job builds a fresh model and a fresh optimizer at its world
size, loads, and compares every shard (padding included) and every optimizer state tensor
bit-exactly with what fairscale itself builds at that world size from the expected full
values.  The world-1 job also loads each checkpoint into the plain, unwrapped module (the
torch adapter) and compares its full state directly.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ckptd_client import CheckpointClient
from ckptd_client.adapters.fairscale_fsdp import FairscaleAdapter
from distributed import run_world
from torch import nn

SAVE_WORLDS = (2, 4)
LOAD_WORLDS = (1, 2, 3, 4)
# (name, flatten_parameters, parameter dtype)
CASES = (("flat-fp32", True, "float32"), ("noflat-bf16", False, "bfloat16"))
CPU = torch.device("cpu")
STEP = 5
SAVED = tuple(f"w{w}" for w in SAVE_WORLDS)


def _clean(name: str) -> str:
    return ".".join(s for s in name.split(".") if s not in {"_fsdp_wrapped_module", "_fpw_module"})


def unwrapped(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(
        nn.Linear(7, 13),
        nn.ReLU(),
        nn.Sequential(nn.Linear(13, 5), nn.LayerNorm(5)),
        nn.BatchNorm1d(5),
        nn.LayerNorm(2),  # 4 elements: padding-only shards at world 3 and 4
    )
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape))
        m[3].running_mean.copy_(torch.randn(5))
        m[3].running_var.copy_(torch.rand(5) + 0.5)
        m[3].num_batches_tracked.fill_(seed)
    return m


def wrap(m: nn.Module, flatten: bool, dtype: torch.dtype, group: Any = None) -> nn.Module:
    from fairscale.nn import auto_wrap, enable_wrap
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    targets = {id(m[2]), id(m[4])}

    def policy(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool,
               **_: Any) -> bool:
        return module_is_root or id(module) in targets

    kw: dict[str, Any] = dict(compute_device=CPU, flatten_parameters=flatten)
    if group is not None:
        kw["process_group"] = group
    if dtype != torch.float32:
        kw["buffer_dtype"] = dtype
    with enable_wrap(wrapper_cls=FSDP, auto_wrap_policy=policy, **kw):
        model = auto_wrap(m)
    return model.to(dtype) if dtype != torch.float32 else model


def optimizer(params: Any, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, betas=(0.85, 0.99), weight_decay=0.1)


def fsdp_instances(model: nn.Module) -> list[tuple[str, Any]]:
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    return [(_clean(n), m) for n, m in model.named_modules() if isinstance(m, FSDP)]


def storages(model: nn.Module) -> list[tuple[Any, torch.nn.Parameter, list[tuple[str, Any]]]]:
    """(instance, shard parameter, [(fqn, shape)]) for every fairscale-sharded parameter."""
    out = []
    for path, m in fsdp_instances(model):
        for i, p in enumerate(m.params):
            if i < m._num_flatten_params:
                names, shapes, _ = m.module.metadata(i)
            else:
                names, shapes = [m._param_name_groups[i][0]], [p._orig_size]
            fq = [
                (".".join(x for x in (path, _clean(n)) if x), tuple(s))
                for n, s in zip(names, shapes)
            ]
            out.append((m, p, fq))
    return out


def gather_full(m: Any, t: torch.Tensor, fq: list[tuple[str, Any]]) -> dict[str, torch.Tensor]:
    """Split the all-gathered, unpadded 1-D tensor ``t`` into the original parameters."""
    t = t.detach().reshape(-1).contiguous()
    if m.world_size > 1:
        parts = [torch.empty_like(t) for _ in range(m.world_size)]
        dist.all_gather(parts, t, group=m.process_group)
        t = torch.cat(parts)
    out = {}
    start = 0
    for fqn, shape in fq:
        n = int(torch.Size(shape).numel())
        out[fqn] = t[start : start + n].view(shape).clone()
        start += n
    return out


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    exp: dict[str, torch.Tensor] = {}
    for m, p, fq in storages(model):
        for fqn, v in gather_full(m, p.data, fq).items():
            exp[f"model/{fqn}"] = v
        for key, v in opt.state[p].items():
            if v.dim() > 0:
                for fqn, x in gather_full(m, v, fq).items():
                    exp[f"optim/{fqn}/{key}"] = x
            else:
                for fqn, _ in fq:
                    exp[f"optim/{fqn}/{key}"] = v.clone()
    for name, b in model.named_buffers():
        exp[f"model/{_clean(name)}"] = b.clone()
    return exp


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        for p in model.parameters():
            p.grad = torch.sin(p.detach() * 3.0) + 0.05  # elementwise: any sharding agrees
        opt.step()
        opt.zero_grad(set_to_none=True)


def save_job(rank: int, world: int, root: str, replicas: int = 1) -> None:
    """Save every case; with ``replicas`` > 1 each FSDP shards over a block of
    ``world // replicas`` consecutive ranks and the blocks hold the same state (HSDP-like)."""
    group = None
    if replicas > 1:
        k = world // replicas
        groups = [dist.new_group(list(range(i * k, (i + 1) * k))) for i in range(replicas)]
        group = groups[rank // k]
    for name, flatten, dtype_name in CASES:
        dtype = getattr(torch, dtype_name)
        model = wrap(unwrapped(seed=3), flatten, dtype, group)
        opt = optimizer(model.parameters(), lr=1e-2)
        train(model, opt, 2)
        expected = full_state(model, opt)
        if replicas > 1:  # the first block of ranks writes the sharded arrays, once
            items = FairscaleAdapter().save_state(model, opt).items
            flat = [it for it in items if not it.logical]
            assert flat and all(it.writer == (rank < world // replicas) for it in flat)
        job = f"{name}-w{world}" + (f"r{replicas}" if replicas > 1 else "")
        client = CheckpointClient(job, storage=f"file://{root}")
        info = client.save_async(model, optimizer=opt, step=STEP).result(120)
        assert info.step == STEP and info.world_size == world and info.framework == "fairscale"
        client.close()
        if rank == 0:
            torch.save(expected, os.path.join(root, f"{job}.expected.pt"))


def reference(values: dict[str, torch.Tensor], flatten: bool, dtype: torch.dtype) -> nn.Module:
    """What fairscale itself holds at this world size when its parameters are ``values``."""
    m = unwrapped(seed=0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(values[n].float())
    return wrap(m, flatten, dtype)


def load_job(rank: int, world: int, root: str, saved: tuple[str, ...] = SAVED) -> None:
    for name, flatten, dtype_name in CASES:
        dtype = getattr(torch, dtype_name)
        for tag in saved:
            job = f"{name}-{tag}"
            want = torch.load(os.path.join(root, f"{job}.expected.pt"), weights_only=True)
            model = wrap(unwrapped(seed=4), flatten, dtype)
            opt = optimizer(model.parameters(), lr=0.5)
            client = CheckpointClient(job, storage=f"file://{root}")
            info = client.load(model, optimizer=opt)
            assert info.step == STEP and info.framework == "fairscale"
            assert not info.missing_keys and not info.unexpected_keys

            params = {n: want[f"model/{n}"] for n, _ in unwrapped(0).named_parameters()}
            ref = reference(params, flatten, dtype)
            for p, r in zip(model.parameters(), ref.parameters(), strict=True):
                assert p.dtype == r.dtype and torch.equal(p.data, r.data), (job, world, rank)
            for bname, b in model.named_buffers():
                w = want[f"model/{_clean(bname)}"]
                assert b.dtype == w.dtype and torch.equal(b, w), (job, bname)
            for key in ("exp_avg", "exp_avg_sq"):
                vals = {n: want[f"optim/{n}/{key}"] for n in params}
                r_params = list(reference(vals, flatten, dtype).parameters())
                for p, r in zip(model.parameters(), r_params, strict=True):
                    st = opt.state[p][key]
                    assert st.dtype == p.dtype and torch.equal(st, r.data), (job, key, rank)
            for p in model.parameters():
                step = opt.state[p]["step"]
                assert step.dtype == torch.float32 and step.dim() == 0
                assert step.item() == want[f"optim/{next(iter(params))}/step"].item() == 2.0
            g = opt.param_groups[0]
            assert g["lr"] == 1e-2 and g["betas"] == (0.85, 0.99)

            # Training goes on from the restored state.
            train(model, opt, 1)
            assert all(opt.state[p]["step"].item() == 3.0 for p in model.parameters())
            client.close()

            if world == 1:
                load_plain(job, want, dtype, root)
    dist.barrier()


def load_plain(job: str, want: dict[str, torch.Tensor], dtype: torch.dtype, root: str) -> None:
    """The same checkpoint into the unwrapped module (torch adapter): full tensors."""
    model = unwrapped(seed=5).to(dtype)
    opt = optimizer(model.parameters(), lr=0.5)
    client = CheckpointClient(job, storage=f"file://{root}")
    client.load(model, optimizer=opt)
    client.close()
    for n, v in model.state_dict().items():
        w = want[f"model/{n}"]
        assert v.dtype == w.dtype and torch.equal(v, w), (job, n)
    for n, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            w = want[f"optim/{n}/{key}"]
            assert torch.equal(opt.state[p][key], w), (job, n, key)


@pytest.mark.slow
def test_fairscale_save_load_every_world_size_pair(tmp_path: Any) -> None:
    root = str(tmp_path)
    for w in SAVE_WORLDS:
        run_world(save_job, w, root)
    for w in LOAD_WORLDS:
        run_world(load_job, w, root)


@pytest.mark.slow
def test_fairscale_replica_groups_write_once(tmp_path: Any) -> None:
    """FSDP over blocks of 2 of 4 ranks (two replicas): one replica writes; load at 3."""
    root = str(tmp_path)
    run_world(save_job, 4, root, 2)
    run_world(load_job, 3, root, ("w4r2",))


def groups_job(rank: int, world: int, root: str) -> None:
    """Param groups by FSDP instance: the same groups in another order get their own
    hyperparameters back; other groups fail before anything is read (strict) or keep the
    live hyperparameters (strict=False)."""
    import ckptd_client.client as client_mod

    from ckptd.errors import StateMismatchError

    def groups(model: nn.Module, swapped: bool, **hp: Any) -> list[dict[str, Any]]:
        top, *nested = [m for _, m in fsdp_instances(model)]
        own = {"params": list(top.params), "weight_decay": hp.get("wd", 0.1)}
        inner = {"params": [p for m in nested for p in m.params], "weight_decay": 0.0,
                 "lr": hp.get("inner_lr", 0.02)}
        return [inner, own] if swapped else [own, inner]

    model = wrap(unwrapped(seed=3), True, torch.float32)
    opt = torch.optim.AdamW(groups(model, swapped=False), lr=0.01)
    train(model, opt, 2)
    client = CheckpointClient("fs-groups", storage=f"file://{root}")
    client.save(model, optimizer=opt, step=2)

    fresh = wrap(unwrapped(seed=4), True, torch.float32)
    swapped = torch.optim.AdamW(groups(fresh, swapped=True, wd=0.5, inner_lr=1.0), lr=1.0)
    client.load(fresh, optimizer=swapped)
    inner, own = swapped.param_groups
    assert (inner["weight_decay"], inner["lr"]) == (0.0, 0.02)
    assert (own["weight_decay"], own["lr"]) == (0.1, 0.01)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p.data, q.data)
        for key, v in opt.state[p].items():
            assert torch.equal(swapped.state[q][key], v), key

    other = wrap(unwrapped(seed=4), True, torch.float32)
    top, first, last = [m for _, m in fsdp_instances(other)]
    regrouped = torch.optim.AdamW([{"params": [*top.params, *first.params]},
                                   {"params": list(last.params), "weight_decay": 0.3}], lr=0.5)
    before = [p.detach().clone() for p in other.parameters()]
    real_reader = client_mod.CheckpointReader

    def no_reading(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the param groups must be checked before anything is read")

    client_mod.CheckpointReader = no_reading  # type: ignore[assignment,misc]
    try:
        with pytest.raises(StateMismatchError, match="optimizer param group 0 holds other "
                                                     "parameters than every saved group"):
            client.load(other, optimizer=regrouped)
    finally:
        client_mod.CheckpointReader = real_reader  # type: ignore[misc]
    assert all(torch.equal(p, b) for p, b in zip(other.parameters(), before, strict=True))
    assert not regrouped.state
    client.load(other, optimizer=regrouped, strict=False)
    assert [(g["weight_decay"], g["lr"]) for g in regrouped.param_groups] == [(0.01, 0.5),
                                                                            (0.3, 0.5)]
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(p.data, q.data)
    client.close()


@pytest.mark.slow
def test_fairscale_param_groups_are_matched_by_their_parameters(tmp_path: Any) -> None:
    run_world(groups_job, 2, str(tmp_path))
