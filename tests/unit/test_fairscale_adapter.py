"""FairscaleAdapter against real fairscale FSDP in real gloo process groups (CPU).

fairscale FSDP's forward/backward and full ``state_dict()`` need CUDA, so "training" is
simulated: the model is built from a seeded module, its shards are changed in place by an
elementwise transform (separate mul/add: the same rounding whatever the sharding), and the
optimizer state is created by a real ``optimizer.step()`` on CPU and then overwritten with
elementwise functions of the parameters.  The expected logical tensors are computed from
the unwrapped module alone, independently of the adapter and of fairscale's flattening.

Checks, for world sizes 1, 2 and 3:

1. save: concatenating the ranks' ``SaveItem`` s per array (each element written exactly
   once, chunk-aligned) and slicing the views gives exactly the expected parameters,
   buffers and optimizer state, under the unwrapped module's ``state_dict()`` names;
2. load: a ``load_plan`` on a freshly built model and fresh optimizer, filled from an
   independent full copy of the logical tensors, makes every shard (padding included) and
   every optimizer state tensor bit-identical to what fairscale itself builds at that world
   size from the same full values; the installed optimizer then steps.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ckptd.format.items import SaveItem
from ckptd_client.adapters.base import TensorMeta
from ckptd_client.adapters.fairscale_fsdp import FairscaleAdapter
from fairscale_helpers import simulate_step, unpadded_lengths

pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Case:
    name: str
    flatten: bool = True
    dtype: torch.dtype = torch.float32  # parameter dtype (bf16 via .to() after wrapping)
    mixed: bool = False  # fairscale mixed precision (fp32 params, bf16 compute/buffers)
    optim: str = "adam"  # "adam" or "sgd" (momentum, plus injected python-number state)
    auto: bool = True  # auto_wrap (else explicit wrap() calls)
    plain_root: bool = False  # FSDP inside a plain module that also has its own Linear
    tied: bool = False  # a tied weight inside the root FSDP
    single_rank_ln: bool = False  # LayerNorm(2) wrapped with a one-rank process group


CASES = [
    Case("flat-fp32"),
    Case("flat-bf16", dtype=torch.bfloat16),
    Case("noflat-fp32-sgd", flatten=False, optim="sgd"),
    Case("noflat-bf16", flatten=False, dtype=torch.bfloat16, auto=False),
    Case("flat-mixed", mixed=True),
    Case("plain-root-tied", plain_root=True, tied=True, auto=False),
    Case("noflat-tied-sgd", flatten=False, tied=True, optim="sgd", auto=False),
    Case("single-rank-pg", single_rank_ln=True, auto=False),
]

# --------------------------------------------------------------------------- model


def _unwrapped(case: Case, seed: int) -> nn.Module:
    """The model as the user writes it; deterministic values everywhere (fp32)."""
    torch.manual_seed(seed)
    inner = nn.Sequential(
        nn.Linear(7, 13),  # 0: 104 elements
        nn.ReLU(),
        nn.Sequential(nn.Linear(13, 5), nn.LayerNorm(5)),  # 2: own FSDP, 80 elements
        nn.BatchNorm1d(5),  # 3: buffers, including int64 num_batches_tracked
        nn.LayerNorm(2),  # 4: own FSDP, 4 elements: at world 3 one rank holds only padding
    )
    if case.tied:
        inner.append(nn.Linear(7, 13))
        inner[5].weight = inner[0].weight
    model: nn.Module = nn.Sequential(inner, nn.Linear(5, 3)) if case.plain_root else inner
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
        bn = inner[3]
        bn.running_mean.copy_(torch.randn(5))
        bn.running_var.copy_(torch.rand(5) + 0.5)
        bn.num_batches_tracked.fill_(seed % 97)
    return model


def _inner(model: nn.Module, case: Case) -> nn.Module:
    return model[0] if case.plain_root else model


def _wrap(model: nn.Module, case: Case, pg1: Any) -> nn.Module:
    """fairscale FSDP around a (fp32) unwrapped model: root, [2] and [4] get instances."""
    from fairscale.nn import auto_wrap, enable_wrap, wrap
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    kw: dict[str, Any] = dict(compute_device=CPU, flatten_parameters=case.flatten)
    if case.mixed:
        kw.update(mixed_precision=True, compute_dtype=torch.bfloat16)
    elif case.dtype != torch.float32:
        kw.update(buffer_dtype=case.dtype)  # else lazy init casts buffers back to fp32
    inner = _inner(model, case)
    targets = {id(inner[2]), id(inner[4])}

    def policy(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool,
               **_: Any) -> bool:
        return module_is_root or id(module) in targets

    with enable_wrap(wrapper_cls=FSDP, **kw):
        if case.auto:
            wrapped = auto_wrap(inner, auto_wrap_policy=policy)
        else:
            inner[2] = wrap(inner[2])
            inner[4] = wrap(inner[4], process_group=pg1) if case.single_rank_ln else wrap(inner[4])
            wrapped = wrap(inner)
    if case.plain_root:
        model[0] = wrapped
    else:
        model = wrapped
    assert isinstance(_inner(model, case), FSDP)
    if case.dtype != torch.float32:
        model = model.to(case.dtype)
    return model


def _transform_(t: torch.Tensor) -> None:
    """Simulated training: elementwise, so identical on shards and on full tensors."""
    t.mul_(-1.5).add_(0.25)


def _state_values(p: torch.Tensor, case: Case) -> dict[str, torch.Tensor]:
    """Per-element optimizer state as a function of the parameter value."""
    if case.optim == "adam":
        return {"exp_avg": p * 3.0 + 1.0, "exp_avg_sq": p * p + 0.5}
    return {"momentum_buffer": p * -2.0 + 0.125}


def _scalar_state(case: Case) -> dict[str, Any]:
    if case.optim == "adam":
        return {"step": torch.tensor(7.0)}
    return {"py_count": 5, "py_scale": 0.375}


def _optimizer(params: Any, case: Case, lr: float) -> torch.optim.Optimizer:
    if case.optim == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(0.8, 0.95), weight_decay=0.01)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True)


def _train(model: nn.Module, opt: torch.optim.Optimizer, case: Case) -> None:
    simulate_step(model, opt, _transform_, lambda p: _state_values(p, case),
                  _scalar_state(case))


def _expected(case: Case, seed: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Logical tensors from the unwrapped model alone, and its unique parameter names."""
    u = _unwrapped(case, seed).to(case.dtype)
    with torch.no_grad():
        for p in u.parameters():
            _transform_(p)
    sd = u.state_dict()
    exp = {f"model/{k}": v.clone() for k, v in sd.items()}
    if case.mixed:  # fairscale casts buffers to the bf16 compute dtype, state_dict -> fp32
        for k, v in u.named_buffers():
            if v.is_floating_point():
                exp[f"model/{k}"] = v.to(torch.bfloat16).to(torch.float32)
    unique = [n for n, _ in u.named_parameters()]
    for n, p in u.named_parameters():
        for k, v in _state_values(p.detach(), case).items():
            exp[f"optim/{n}/{k}"] = v
        for k, v in _scalar_state(case).items():
            exp[f"optim/{n}/{k}"] = v.clone() if isinstance(v, torch.Tensor) else _as_tensor(v)
    return exp, unique


def _as_tensor(v: Any) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64 if isinstance(v, int) else torch.float64)


# --------------------------------------------------------------------------- checks


def _reconstruct(per_rank: list[list[SaveItem]]) -> dict[str, torch.Tensor]:
    """Logical tensors from every rank's SaveItems; checks single coverage and alignment."""
    arrays: dict[str, dict[str, Any]] = {}
    logical: dict[str, torch.Tensor] = {}
    for items in per_rank:
        for it in items:
            assert it.region.within(it.global_shape), it
            assert tuple(it.local.shape) == it.region.shape, it.name
            assert it.local.dtype == it.dtype, it.name
            if it.logical:
                assert it.replicated and it.region.shape == it.global_shape, it.name
                if it.name in logical:
                    assert torch.equal(logical[it.name], it.local), it.name
                logical[it.name] = it.local
                continue
            assert len(it.global_shape) == 1 and it.chunk_shape is not None
            (n,) = it.global_shape
            a = arrays.setdefault(
                it.name,
                dict(
                    n=n, dtype=it.dtype, chunk=it.chunk_shape, views=it.views,
                    data=torch.zeros(n, dtype=it.dtype), count=torch.zeros(n, dtype=torch.int64),
                    replicated=it.replicated,
                ),
            )
            assert (a["n"], a["dtype"], a["chunk"], a["views"], a["replicated"]) == (
                n, it.dtype, it.chunk_shape, it.views, it.replicated
            ), it.name  # every rank records the same array and the same views
            off, length = it.region.offsets[0], it.region.shape[0]
            if it.replicated:
                assert length == n
                if a["count"].sum() == 0:
                    a["data"].copy_(it.local)
                    a["count"] += 1
                assert torch.equal(a["data"], it.local)
                continue
            (c,) = it.chunk_shape
            if length:  # one whole chunk, clipped only at the array's end
                assert off % c == 0 and length == min(c, n - off), (it.name, off, length, c)
            if it.writer:
                a["data"][off : off + length] = it.local
                a["count"][off : off + length] += 1
    for name, a in arrays.items():
        assert bool((a["count"] == 1).all()), f"{name}: elements not written exactly once"
        for v in a["views"]:
            assert v.dtype == a["dtype"]
            k = math.prod(v.shape)
            assert v.start + k <= a["n"]
            assert v.name not in logical or v.name.startswith("model/"), v.name
            logical[v.name] = a["data"][v.start : v.start + k].view(v.shape)
    return logical


def _assert_same(got: dict[str, torch.Tensor], exp: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(exp), f"{what}: {sorted(set(got) ^ set(exp))}"
    for k, v in exp.items():
        assert got[k].dtype == v.dtype, (what, k, got[k].dtype, v.dtype)
        assert tuple(got[k].shape) == tuple(v.shape), (what, k)
        assert torch.equal(got[k].cpu(), v), (what, k)


def _fill(plan_targets: list, full: dict[str, torch.Tensor]) -> None:
    """What the reader does: copy each target's part of the logical tensor into ``out``."""
    for t in plan_targets:
        src = full[t.name]
        assert tuple(src.shape) == tuple(t.global_shape), t.name
        if t.flat_range is not None:
            lo, hi = t.flat_range
            assert t.out.dim() == 1 and t.out.numel() == hi - lo
            t.out.copy_(src.reshape(-1)[lo:hi])
        else:
            sl = tuple(slice(o, o + s) for o, s in zip(t.region.offsets, t.region.shape))
            t.out.copy_(src[sl] if sl else src)


def _reference(case: Case, values: dict[str, torch.Tensor], pg1: Any) -> nn.Module:
    """What fairscale itself holds at this world size for full parameter ``values``."""
    u = _unwrapped(case, seed=0)
    with torch.no_grad():
        for n, p in u.named_parameters():
            p.copy_(values[n].float())
    return _wrap(u, case, pg1)


def _check_case(case: Case, rank: int, world: int, pg1: Any) -> None:
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    adapter = FairscaleAdapter()
    seed = 11
    exp, unique = _expected(case, seed)

    # ---- save
    model = _wrap(_unwrapped(case, seed), case, pg1)
    assert FairscaleAdapter.matches(model)
    opt = _optimizer(model.parameters(), case, lr=1e-3)
    _train(model, opt, case)
    state = adapter.save_state(model, opt)
    mine = [
        replace(it, local=it.local.detach().cpu().clone()) for it in state.items
    ]
    if world == 3 and case.flatten and not case.single_rank_ln:
        # LayerNorm(2): 4 elements, shard length 2; rank 2 holds only padding and still
        # records the array and its views.
        empty = [it for it in mine if not it.logical and it.region.empty()]
        assert bool(empty) == (rank == 2)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)
    logical = _reconstruct(gathered)
    _assert_same(logical, exp, f"{case.name} save")
    if case.single_rank_ln and world > 1:
        reps = {it.name for it in mine if not it.logical and it.replicated}
        assert reps == {"flat/model/4.flat_param_0"} | (
            {f"flat/optim/4.flat_param_0/{k}" for k in ("exp_avg", "exp_avg_sq")}
        ), reps

    groups = state.param_groups
    json.dumps(groups)
    assert len(groups) == 1 and sorted(groups[0]["params"]) == sorted(unique)
    if case.optim == "adam":
        assert groups[0]["betas"] == [0.8, 0.95] and groups[0]["lr"] == 1e-3

    # ---- load into a fresh model (other values) and a fresh optimizer (no state)
    available = {k: TensorMeta(tuple(v.shape), v.dtype) for k, v in exp.items()}
    model2 = _wrap(_unwrapped(case, seed + 1), case, pg1)
    opt2 = _optimizer(model2.parameters(), case, lr=0.5)
    assert not opt2.state
    plan = adapter.load_plan(model2, opt2, available)
    u_keys = _unwrapped(case, seed).to(case.dtype).state_dict()
    assert {k: (m.shape, m.dtype) for k, m in plan.model_names.items()} == {
        f"model/{k}": (tuple(v.shape), exp[f"model/{k}"].dtype) for k, v in u_keys.items()
    }
    assert {k: m.shape for k, m in plan.optim_names.items()} == {
        k: tuple(v.shape) for k, v in exp.items() if k.startswith("optim/")
    }
    _fill(plan.targets, {k: v.clone() for k, v in exp.items()})
    plan.finish(groups)

    model_vals = {k[len("model/"):]: v for k, v in exp.items() if k.startswith("model/")}
    ref = _reference(case, model_vals, pg1)
    refs = {
        key: _reference(case, {n: exp[f"optim/{n}/{key}"] for n in unique}, pg1)
        for key in _state_values(torch.zeros(1), case)
    }
    _check_loaded(case, model2, opt2, exp, ref, refs, with_padding=True)

    # The installed state is usable by the optimizer.
    params2 = list(model2.parameters())
    for p in params2:
        p.grad = torch.full_like(p, 0.25)
    opt2.step()
    if case.optim == "adam":
        assert all(opt2.state[p]["step"].item() == 8.0 for p in params2)

    # Load again, now into an optimizer that has state (reused in place where it fits);
    # padding now holds whatever the step left there, so compare the valid elements.
    plan = adapter.load_plan(model2, opt2, available)
    _fill(plan.targets, {k: v.clone() for k, v in exp.items()})
    plan.finish(groups)
    _check_loaded(case, model2, opt2, exp, ref, refs, with_padding=False)
    assert isinstance(_inner(model2, case), FSDP)


def _check_loaded(
    case: Case,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    exp: dict[str, torch.Tensor],
    ref: nn.Module,
    refs: dict[str, nn.Module],
    with_padding: bool,
) -> None:
    valid = unpadded_lengths(model)

    def same(a: torch.Tensor, b: torch.Tensor, p: torch.Tensor) -> bool:
        if not with_padding and id(p) in valid:
            a, b = a.reshape(-1)[: valid[id(p)]], b.reshape(-1)[: valid[id(p)]]
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

    params = list(model.parameters())
    for p, pr in zip(params, ref.parameters(), strict=True):
        assert same(p.data, pr.data, p), case.name
    for name, b in _buffers(model):
        want = exp[f"model/{name}"]
        assert torch.equal(b.to(want.dtype), want), (case.name, name)
    for i, p in enumerate(params):
        st = opt.state[p]
        assert sorted(st) == sorted(list(refs) + list(_scalar_state(case))), sorted(st)
        for key, r in refs.items():
            assert same(st[key], list(r.parameters())[i].data, p), (case.name, i, key)
        for key, v in _scalar_state(case).items():
            if isinstance(v, torch.Tensor):
                assert isinstance(st[key], torch.Tensor) and st[key].dtype == torch.float32
                assert st[key].dim() == 0 and st[key].item() == v.item()
            else:
                assert type(st[key]) is type(v) and st[key] == v, (key, st[key])
    g = opt.param_groups[0]
    assert g["lr"] == 1e-3
    if case.optim == "adam":
        assert g["betas"] == (0.8, 0.95) and isinstance(g["betas"], tuple)


def _buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, b in model.named_buffers():
        parts = name.split(".")
        clean = ".".join(s for s in parts if s not in {"_fsdp_wrapped_module", "_fpw_module"})
        out.append((clean, b))
    return out


def _worker(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        pgs = [dist.new_group([r]) for r in range(world)]
        for case in CASES:
            _check_case(case, rank, world, pgs[rank])
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fairscale_adapter_save_and_load(world: int, tmp_path: Any) -> None:
    mp.spawn(_worker, args=(world, str(tmp_path / "store")), nprocs=world, join=True)


def test_matches_without_fairscale_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(
        sys.modules, "fairscale.nn.data_parallel.fully_sharded_data_parallel", raising=False
    )
    assert not FairscaleAdapter.matches(nn.Linear(2, 2))


def test_matches_plain_module_is_false() -> None:
    import fairscale.nn.data_parallel  # noqa: F401  (fairscale present, model is not FSDP)

    assert not FairscaleAdapter.matches(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))


def _buffer_dtype_worker(rank: int, store: str, root: str) -> None:
    """fairscale casts floating buffers to float32 (its buffer_dtype) at its lazy init, which
    save runs; a freshly built model (not yet initialized) must still load that checkpoint."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    from ckptd_client import CheckpointClient

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=1)
    try:
        def build(seed: int) -> nn.Module:
            torch.manual_seed(seed)
            m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
            m[0].register_buffer("stat", torch.randn(5).bfloat16())
            m[1].register_buffer("dbl", torch.randn(3, dtype=torch.float64))
            m[1] = FSDP(m[1], compute_device=CPU)
            return FSDP(m, compute_device=CPU)

        saved = build(0)
        with CheckpointClient("j", storage=f"file://{root}") as c:
            c.save(saved, step=1)
        fresh = build(1)
        with CheckpointClient("j", storage=f"file://{root}") as c:
            c.load(fresh)  # strict: was a dtype mismatch (float32 saved, bf16/float64 live)
        got, want = _buffers(fresh), _buffers(saved)
        assert [n for n, _ in got] == [n for n, _ in want] == ["0.stat", "1.dbl"]
        for (n, g), (_, w) in zip(got, want):
            assert g.dtype == w.dtype == torch.float32 and torch.equal(g, w), n
    finally:
        dist.destroy_process_group()


def test_fresh_model_loads_buffers_fairscale_casts_at_init(tmp_path: Any) -> None:
    mp.spawn(_buffer_dtype_worker, args=(str(tmp_path / "store"), str(tmp_path / "ckpt")),
             nprocs=1, join=True)
