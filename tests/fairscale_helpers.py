"""Helpers shared by the fairscale tests (tests/ is on sys.path via tests/conftest.py)."""

from __future__ import annotations

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
