"""fairscale FSDP models beyond plain layers, through CheckpointClient (2 gloo ranks, CPU).

The root flat parameter starts with a 0-d parameter (a learnable scale, as CLIP's
``logit_scale``) and holds a tied weight; a nested instance holds frozen parameters (not in
the optimizer); parameters of another one are not flattened and a ``/`` is in their
names (a ModuleDict key).  Training is simulated as in ``fairscale_helpers.simulate_step``.  A fresh
model and a fresh optimizer load every shard and every Adam state tensor bit-exactly.  A
one-rank FSDP instance whose values differ between ranks fails the save.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from distributed import run_world
from fairscale_helpers import unpadded_lengths
from torch import nn

CPU = torch.device("cpu")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))  # first in the root's flat parameter
        self.emb = nn.Embedding(11, 7)
        self.block = nn.Sequential(nn.Linear(7, 5), nn.BatchNorm1d(5))
        self.frozen = nn.Linear(5, 3)
        self.head = nn.Linear(7, 11, bias=False)
        self.head.weight = self.emb.weight
        self.named = nn.ModuleDict({"enc/0": nn.Linear(2, 3)})  # a '/' in parameter names


def build(seed: int) -> nn.Module:
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    torch.manual_seed(seed)
    m = Net()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape))
    m.frozen.requires_grad_(False)
    m.block = FSDP(m.block, compute_device=CPU)
    m.frozen = FSDP(m.frozen, compute_device=CPU)
    m.named = FSDP(m.named, compute_device=CPU, flatten_parameters=False)
    return FSDP(m, compute_device=CPU)


def adam(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)


def job(rank: int, world: int, root: str) -> None:
    from ckptd_client import CheckpointClient

    model = build(seed=1)
    opt = adam(model, lr=1e-3)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.5).add_(0.25)
    for p in params:
        opt.state[p]["exp_avg"].copy_(p.detach() * 3.0 + 1.0)
        opt.state[p]["exp_avg_sq"].copy_(p.detach() * p.detach() + 0.5)
        p.grad = None
    client = CheckpointClient("scalar", storage=f"file://{root}")
    client.save(model, optimizer=opt, step=3)

    fresh = build(seed=2)
    fresh_opt = adam(fresh, lr=0.5)
    info = client.load(fresh, optimizer=fresh_opt)
    client.close()
    assert not info.missing_keys and not info.unexpected_keys
    assert fresh_opt.param_groups[0]["lr"] == 1e-3
    valid = unpadded_lengths(model)  # the padding is not state (Adam stepped it above)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        n = valid[id(p)]
        assert torch.equal(p.data[:n], q.data[:n])
        if p.requires_grad:
            for key, v in opt.state[p].items():
                got = fresh_opt.state[q][key]
                assert got.shape == v.shape, key
                assert torch.equal(got, v) if v.dim() == 0 else torch.equal(got[:n], v[:n]), key
        else:
            assert q not in fresh_opt.state
    for (name, b), (_, c) in zip(model.named_buffers(), fresh.named_buffers(), strict=True):
        assert torch.equal(b, c), name

    # Optimizer state ckptd cannot store names the flat parameter by the parameters it
    # holds (not only the first one, with the flat shard's shape as "the parameter's").
    from ckptd.errors import ConfigError

    client = CheckpointClient("scalar", storage=f"file://{root}")
    root_flat = params[0]  # scale, emb.weight (head.weight tied)
    for key, bad, what in (("row", torch.zeros(3), r"has shape \(3,\); expected the parameter's"),
                           ("note", "a string", r"is a str; expected a tensor or a python number")):
        opt.state[root_flat][key] = bad
        with pytest.raises(ConfigError, match=r"'" + key + r"' of fairscale flat parameter "
                           r"'flat_param_0' \(holding scale, emb\.weight; local shard\) " + what):
            client.save(model, optimizer=opt, step=4)
        del opt.state[root_flat][key]
    assert client.list_steps() == [3]
    client.close()

    # A one-rank FSDP instance is saved once, as a replica: per-rank values (MoE experts in
    # one-rank process groups) fail the save instead of keeping rank 0's copy only.
    from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

    from ckptd.errors import ConfigError

    own = [dist.new_group([r]) for r in range(world)][rank]
    for per_rank in (False, True):  # the same values on every rank, then per-rank values
        torch.manual_seed(5 + rank if per_rank else 5)
        experts = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4))
        experts[1] = FSDP(experts[1], process_group=own, compute_device=CPU)
        experts = FSDP(experts, compute_device=CPU)
        client = CheckpointClient("experts", storage=f"file://{root}")
        if not per_rank:
            client.save(experts, step=1)
        else:
            with pytest.raises(ConfigError, match=r"differ between rank 0 and ranks \[1\]"):
                client.save(experts, step=2)
            assert client.list_steps() == [1]
        client.close()


@pytest.mark.slow
def test_fairscale_scalar_tied_and_frozen_parameters(tmp_path: Any) -> None:
    run_world(job, 2, str(tmp_path))
