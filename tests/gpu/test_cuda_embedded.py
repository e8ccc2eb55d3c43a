"""CUDA paths of the embedded client: pinned staging, device-to-host copies, restore onto
the device.  Skipped on machines without CUDA (the project's CI has none)."""

from __future__ import annotations

import pytest
import torch

from ckptd_client import CheckpointClient

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_model_round_trip_with_pinned_staging(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.LayerNorm(1024)).cuda()
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    client = CheckpointClient("cuda", storage=f"file://{tmp_path}")
    client.save(model, optimizer=opt, step=1)
    assert client._transport._staging.tensor.is_pinned()
    other = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.LayerNorm(1024)).cuda()
    other.to(torch.bfloat16)
    opt2 = torch.optim.AdamW(other.parameters(), lr=1e-3)
    client.load(other, optimizer=opt2)
    for a, b in zip(model.state_dict().values(), other.state_dict().values()):
        assert b.is_cuda and torch.equal(a, b)
    client.close()
