"""Helpers shared by the fairscale tests (tests/ is on sys.path via tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn


def unpadded_lengths(model: nn.Module) -> dict[int, int]:
    """Unpadded length of every fairscale shard of ``model`` (by parameter id)."""
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    out = {}
    for m in model.modules():
        if isinstance(m, FSDP):
            for p, pad in zip(m.params, m.numel_padded_per_param):
                out[id(p)] = p.numel() - pad
    return out


def simulate_step(model: nn.Module, opt: torch.optim.Optimizer,
                  transform_: Callable[[torch.Tensor], None],
                  state_of: Callable[[torch.Tensor], Mapping[str, torch.Tensor]],
                  scalars: Mapping[str, Any] | None = None) -> None:
    """A training step on CPU, where fairscale's forward/backward cannot run: a real
    optimizer step creates the state entries, then every (flat) parameter becomes
    ``transform_`` of its old value, its per-element state tensors ``state_of(param)``, and
    its scalar state ``scalars`` (tensors cloned per parameter)."""
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    with torch.no_grad():
        for p, b in zip(params, before):
            p.copy_(b)
            transform_(p.data)
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            for k, v in state_of(p.detach()).items():
                st[k].copy_(v)
            for k, v in (scalars or {}).items():
                st[k] = v.clone() if isinstance(v, torch.Tensor) else v
            p.grad = None
