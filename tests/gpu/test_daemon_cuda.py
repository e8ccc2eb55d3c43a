"""CUDA paths of the daemon transport: the memfd staging segment is page-locked with
cudaHostRegister, device-to-host copies land in it, and a restore onto the device is
bit-exact (copy and overlap mode).  Skipped on machines without CUDA."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
from ckptd_client import CheckpointClient

from ckptd.daemon.testing import start_daemon

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model():
    m = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.LayerNorm(1024)).cuda()
    return m.to(torch.bfloat16)


def test_cuda_save_through_daemon_with_registered_segment(tmp_path):
    run = tempfile.mkdtemp(prefix="ckd-", dir="/tmp")
    d = start_daemon(f"file://{tmp_path}/store", os.path.join(run, "s", "ckptd.sock"),
                     staging_bytes="256MiB", log_path=str(tmp_path / "daemon.log"))
    try:
        torch.manual_seed(0)
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        client = CheckpointClient("cuda", daemon=d.address)
        client.save(model, optimizer=opt, step=1)
        want = {1: {k: v.clone() for k, v in model.state_dict().items()}}
        segs = client._transport._segments
        assert segs and all(s.pinned for s in segs)
        model(torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
        want[2] = {k: v.clone() for k, v in model.state_dict().items()}
        h = client.save_async(model, optimizer=opt, step=2, overlap=True)
        opt.step()   # waits for the overlap copy; changes the parameters afterwards
        h.result(60)
        for step in (1, 2):
            other = _model()
            opt2 = torch.optim.AdamW(other.parameters(), lr=1e-3)
            client.load(other, optimizer=opt2, step=step)
            for k, v in other.state_dict().items():
                assert v.is_cuda and torch.equal(v, want[step][k]), (step, k)
        client.close()
    finally:
        d.stop()
        shutil.rmtree(run, ignore_errors=True)
