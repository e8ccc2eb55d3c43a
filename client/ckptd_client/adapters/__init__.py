"""Framework adapters; :func:`adapter_for` picks the one that handles a model."""

from __future__ import annotations

import torch

from ckptd.errors import ConfigError
from ckptd_client.adapters.base import FrameworkAdapter, LoadPlan, SaveState, TensorMeta

__all__ = ["FrameworkAdapter", "LoadPlan", "SaveState", "TensorMeta", "adapter_for"]


def _adapter_classes() -> list[type[FrameworkAdapter]]:
    from ckptd_client.adapters.fairscale_fsdp import FairscaleAdapter
    from ckptd_client.adapters.torch_state import TorchAdapter

    # fairscale first: its wrapper is an nn.Module that the torch adapter would accept.
    return [FairscaleAdapter, TorchAdapter]


def adapter_for(model: torch.nn.Module) -> FrameworkAdapter:
    """The adapter for ``model``: fairscale FSDP, or PyTorch (FSDP2, FSDP1, DDP, plain)."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"expected a torch.nn.Module (optionally wrapped with FSDP/FSDP2/DDP), got "
            f"{type(model).__name__}"
        )
    for cls in _adapter_classes():
        if cls.matches(model):
            return cls()
    raise ConfigError(f"no adapter handles a model of type {type(model).__name__}")
