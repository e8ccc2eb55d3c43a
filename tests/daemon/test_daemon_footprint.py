"""The daemon only moves bytes: it never loads torch, whatever dtypes it persists and
serves (torch alone would add ~200 MB to every node's daemon)."""

from __future__ import annotations

import os

import torch
from ckptd_client import CheckpointClient


def _torch_mapped(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split()[-1] for line in f
                       if "libtorch" in line or "/torch/_C" in line})


def test_daemon_saves_and_serves_every_dtype_without_importing_torch(daemons):
    d = daemons.start()
    m = torch.nn.Module()
    g = torch.Generator().manual_seed(3)
    for i, dt in enumerate((torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                            torch.int64, torch.bool, torch.complex64)):
        t = torch.randn(300, 129, generator=g).to(dt) if dt != torch.complex64 else torch.randn(
            64, 7, dtype=dt, generator=g)
        m.register_buffer(f"b{i}", t)
    client = CheckpointClient(job="footprint", daemon=d.address)
    client.save_async(m, step=1).result(timeout=120)
    fresh = torch.nn.Module()
    for k, v in m.state_dict().items():
        fresh.register_buffer(k, torch.zeros_like(v))
    client.load(fresh)
    for k, v in m.state_dict().items():
        assert torch.equal(fresh.state_dict()[k].view(torch.uint8), v.view(torch.uint8)), k
    client.close()
    assert d.alive()
    assert _torch_mapped(d.pid) == []
    assert _torch_mapped(os.getpid())  # the check sees torch where it is loaded
