"""DTensor parameters sharded along dim 1 (tensor-parallel style), with a dim that does not
divide the world size: saved at 2 ranks, loaded at 3 ranks and into a plain module."""

from __future__ import annotations

import os

import pytest
import torch
from distributed import run_world

from ckptd_client import CheckpointClient


def _model(world: int, seed: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(seed)
    full = torch.randn(7, 5)
    mesh = init_device_mesh("cpu", (world,))
    m = torch.nn.Linear(5, 7, bias=False)
    m.weight = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(1)]))
    return m, full


def save_job(rank: int, world: int, root: str) -> None:
    m, full = _model(world, seed=1)
    CheckpointClient("tp", storage=f"file://{root}", pack_threshold=0).save(m, step=1)
    if rank == 0:
        torch.save(full, os.path.join(root, "full.pt"))


def load_job(rank: int, world: int, root: str) -> None:
    m, _ = _model(world, seed=2)
    CheckpointClient("tp", storage=f"file://{root}").load(m)
    want = torch.load(os.path.join(root, "full.pt"), weights_only=True)
    assert torch.equal(m.weight.full_tensor(), want)


@pytest.mark.slow
def test_shard1_uneven_saved_at_2_loads_at_3_and_plain(tmp_path):
    root = str(tmp_path)
    run_world(save_job, 2, root)
    run_world(load_job, 3, root)
    plain = torch.nn.Linear(5, 7, bias=False)
    CheckpointClient("tp", storage=f"file://{root}").load(plain)
    assert torch.equal(plain.weight.detach(), torch.load(os.path.join(root, "full.pt"),
                                                         weights_only=True))


# --------------------------------------------------------------------------- 2-D: TP x FSDP2

class _MLP(torch.nn.Module):
    """Uneven dims: 13 and 7 divide neither mesh dim."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(6, 13)
        self.down = torch.nn.Linear(13, 7)
        self.norm = torch.nn.LayerNorm(7)


def _tp_fsdp(dp: int, tp: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """parallelize_module on the "tp" sub-mesh, then fully_shard on "dp": up.* get
    (_StridedShard(0), Shard(0)), down.weight (Shard(0), Shard(1)); norm.* live on the "dp"
    sub-mesh only (the same shards on every "tp" rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(seed)
    m = _MLP()
    if dp * tp == 1:  # a plain module
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    if tp > 1:
        parallelize_module(m, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if dp > 1:
        fully_shard(m, mesh=mesh["dp"])
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _full(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    def full(v: torch.Tensor) -> torch.Tensor:
        return v.full_tensor() if isinstance(v, DTensor) else v.detach().clone()

    out = {f"model/{k}": full(v) for k, v in m.state_dict().items()}
    names = {id(p): n for n, p in m.named_parameters()}
    for p, st in opt.state.items():
        out.update((f"optim/{names[id(p)]}/{k}", full(v)) for k, v in st.items())
    return out


def tp_fsdp_job(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckptd.errors import ConfigError

    m, opt = _tp_fsdp(2, 2, seed=1)
    assert any(isinstance(p, _StridedShard) for p in m.up.weight.placements)
    for i in range(2):  # training, without a forward (TP with uneven dims has none on CPU)
        for p in m.parameters():
            p.grad = p.detach() * 0.37 + 0.1 * (i + 1)
        opt.step()
        opt.zero_grad()
    client = CheckpointClient("tpdp", storage=f"file://{root}", commit_timeout=90)
    client.save(m, optimizer=opt, step=1)
    want = _full(m, opt)
    if rank == 0:
        torch.save(want, os.path.join(root, "tpdp.pt"))
    for dp, tp in ((4, 1), (1, 4), (2, 2)):
        m2, opt2 = _tp_fsdp(dp, tp, seed=2)
        client.load(m2, optimizer=opt2)
        got = _full(m2, opt2)
        assert sorted(got) == sorted(want)
        for k, v in want.items():
            assert torch.equal(got[k], v), (dp, tp, k)

    # layouts that are no boxes are refused on every rank, before anything is written
    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(3)
    partial = DTensor.from_local(torch.randn(7, 5), mesh, [Partial(), Partial()])
    scattered = DTensor.from_local(torch.randn(2, 5), mesh,  # rows {0, 2}, {1, 3}, ...
                                   [Shard(0), _StridedShard(0, split_factor=2)],
                                   shape=torch.Size((8, 5)), stride=(5, 1))
    for t, msg in ((partial, r"placement P\(sum\).*Reduce it first"),
                   (scattered, r"part of dim 0 is not one contiguous range")):
        bad = torch.nn.Module()
        bad.w = torch.nn.Parameter(t)
        with pytest.raises(ConfigError, match=r"cannot checkpoint 'model/w': a DTensor .*" + msg):
            client.save(bad, step=2)
    # local sizes 1, 2, 3, 4 of 10 rows: rank 2 holds what torch.chunk gives it (3 rows) and
    # saves; the others refuse, and rank 2's save fails with their error instead of waiting
    # for its commit timeout; the ranks' next save commits (same attempt names)
    bad.w = torch.nn.Parameter(DTensor.from_local(
        torch.randn(rank + 1, 5), init_device_mesh("cpu", (4,)), [Shard(0)],
        shape=torch.Size((10, 5)), stride=(5, 1)))
    with pytest.raises(Exception, match=r"its local tensor on this rank has shape \[\d, 5\]"):
        client.save(bad, step=2)
    client.save(m, optimizer=opt, step=3)
    client.close()
    assert client.list_steps() == [1, 3]


@pytest.mark.slow
def test_tp_x_fsdp2_saved_at_2x2_loads_at_4x1_1x4_plain_and_verifies(tmp_path):
    """Before: ranks at dp > 0 skipped their _StridedShard pieces (not a Shard subclass),
    and the dp-only norm shards were stored once per tp rank, so the save committed a
    checkpoint that no load could read."""
    from ckptd.storage import open_storage
    from ckptd.tools.verify import verify

    root = str(tmp_path)
    run_world(tp_fsdp_job, 4, root)
    want = torch.load(os.path.join(root, "tpdp.pt"), weights_only=True)
    m, opt = _tp_fsdp(1, 1, seed=2)
    CheckpointClient("tpdp", storage=f"file://{root}").load(m, optimizer=opt, step=1)
    got = _full(m, opt)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    reports = verify(open_storage(f"file://{root}"), "tpdp", step=1)
    assert [r.problems for r in reports] == [[]]
