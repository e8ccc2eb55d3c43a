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


def _nice_values(pid: int) -> dict[int, int]:
    """Thread id -> nice value of every thread of ``pid`` (field 19 of /proc/.../stat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


def _save_one(address: str, job: str) -> None:
    m = torch.nn.Linear(64, 64)
    with CheckpointClient(job=job, daemon=address) as client:
        client.save_async(m, step=1).result(timeout=120)


def test_daemon_writes_at_lower_cpu_priority_than_it_answers(daemons):
    """Threads that checksum and write saves run --io-nice (default 10) levels below the
    thread that answers RPCs, so a busy daemon yields the node's cores to trainers."""
    d = daemons.start()
    _save_one(d.address, "nice")
    nice = _nice_values(d.pid)
    base = nice[d.pid]                    # the main thread runs the event loop (RPCs)
    assert set(nice.values()) == {base, min(19, base + 10)}, nice

    flat = daemons.start(socket_path=daemons.socket_path("flat"), extra_args=("--io-nice", "0"))
    _save_one(flat.address, "flat")
    assert set(_nice_values(flat.pid).values()) == {_nice_values(flat.pid)[flat.pid]}
