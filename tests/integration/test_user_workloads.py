"""FSDP2 workloads beyond the basic round trip, saved at 3 ranks and loaded at 2.

The model has a parameter with fewer rows than ranks (1 x 5), a frozen layer, a layer
forward never uses, a non-persistent buffer and a bf16 mixed-precision policy.  Each
checkpoint is loaded into a fresh model and optimizer at another world size: the full state
must equal the saved one bit-exactly, and one more step must give what a run without any
checkpoint gets (up to the reduction order of another world size), also when the optimizer
was saved before its first step.  A load right after save_async loads the same step on
every rank.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from ckptd_client import CheckpointClient
from distributed import run_world
from test_torch_fsdp import full_state


class Workload(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.l1 = torch.nn.Linear(6, 13)
        self.frozen = torch.nn.Linear(13, 13)
        self.frozen.requires_grad_(False)
        self.unused = torch.nn.Linear(13, 13)
        self.l2 = torch.nn.Linear(13, 5, bias=False)
        self.tiny = torch.nn.Parameter(torch.randn(1, 5))
        self.register_buffer("cache", torch.ones(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.frozen(torch.relu(self.l1(self.emb(x))))) + self.tiny


def build(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(seed)
    model = Workload()
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in (model.l1, model.l2):
        fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    x = torch.randint(0, 11, (8,), generator=torch.Generator().manual_seed(i))  # same on every rank
    model(x).float().pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def save_job(rank: int, world: int, root: str, trained_steps: int) -> None:
    model, opt = build(world, seed=1)
    for i in range(trained_steps):
        step(model, opt, i)
    client = CheckpointClient(f"w{trained_steps}", storage=f"file://{root}")
    client.save(model, optimizer=opt, step=trained_steps)
    client.close()
    # get_optimizer_state_dict (in full_state) creates the state of an optimizer that has
    # none, so a stateless optimizer is compared by its model only
    before = full_state(model, opt if opt.state else None)
    # the run without any checkpoint
    ref, ref_opt = build(world, seed=1)
    for i in range(trained_steps):
        step(ref, ref_opt, i)
    step(ref, ref_opt, 100)
    after = full_state(ref, ref_opt)
    if rank == 0:
        torch.save({"before": before, "after": after},
                   os.path.join(root, f"w{trained_steps}.expected.pt"))


def load_job(rank: int, world: int, root: str, trained_steps: int) -> None:
    model, opt = build(world, seed=2)
    CheckpointClient(f"w{trained_steps}", storage=f"file://{root}").load(model, optimizer=opt)
    want = torch.load(os.path.join(root, f"w{trained_steps}.expected.pt"), weights_only=True)
    for phase in ("before", "after"):
        got = full_state(model, opt if phase == "after" or opt.state else None)
        assert sorted(got) == sorted(want[phase]), sorted(set(got) ^ set(want[phase]))
        for k, w in want[phase].items():
            g = got[k]
            assert g.dtype == w.dtype and g.shape == w.shape, k
            if phase == "before":
                assert torch.equal(g, w), f"{k} differs after loading at {world} ranks"
            else:
                torch.testing.assert_close(g, w, msg=f"{k} differs one step after the load")
        if phase == "before":
            step(model, opt, 100)
    dist.barrier()


@pytest.mark.slow
@pytest.mark.parametrize("trained_steps", [0, 2], ids=["before-first-step", "trained"])
def test_fsdp2_workload_saved_at_3_loads_at_2(tmp_path, trained_steps):
    run_world(save_job, 3, str(tmp_path), trained_steps)
    run_world(load_job, 2, str(tmp_path), trained_steps)


def decay_groups(model: torch.nn.Module, no_decay_first: bool, lr: float = 1e-2,
                 wd: float = 0.1) -> list[dict]:
    """Weights (and the 1 x 5 parameter) decay; biases do not and have their own lr."""
    named = list(model.named_parameters())
    decay = {"params": [p for n, p in named if p.dim() >= 2], "weight_decay": wd, "lr": lr}
    no_decay = {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0,
                "lr": 3 * lr}
    return [no_decay, decay] if no_decay_first else [decay, no_decay]


def deferred_init_and_groups_job(rank: int, world: int, root: str) -> None:
    """FSDP2 with deferred init: a save before the model is materialized names a meta
    tensor; then a checkpoint saved with decay/no-decay groups loads into an optimizer that
    builds them in the other order, and training goes on exactly as in the saving run."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ckptd.errors import ConfigError

    def build_deferred(seed: int) -> torch.nn.Module:
        with torch.device("meta"):
            model = Workload()
        mesh = init_device_mesh("cpu", (world,))
        for m in (model.l1, model.l2):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def materialize(model: torch.nn.Module, seed: int) -> None:
        model.to_empty(device="cpu")
        torch.manual_seed(seed)
        with torch.no_grad():
            for m in (model.emb, model.l1, model.frozen, model.unused, model.l2):
                m.reset_parameters()
            torch.nn.init.normal_(model.tiny)
            model.cache.fill_(1.0)

    client = CheckpointClient("deferred", storage=f"file://{root}")
    model = build_deferred(1)
    with pytest.raises(ConfigError, match=r"cannot save step 0: 'model/.*' and \d+ more tensors "
                                          r"are on the meta device.*to_empty"):
        client.save_async(model, step=0)
    materialize(model, 1)
    opt = torch.optim.AdamW(decay_groups(model, no_decay_first=False))
    for i in range(2):
        step(model, opt, i)
    client.save(model, optimizer=opt, step=2)

    fresh = build_deferred(2)
    materialize(fresh, 2)
    opt2 = torch.optim.AdamW(decay_groups(fresh, no_decay_first=True, lr=0.5, wd=0.5))
    client.load(fresh, optimizer=opt2)
    no_decay, decay = opt2.param_groups
    assert (no_decay["weight_decay"], no_decay["lr"]) == (0.0, 3e-2)
    assert (decay["weight_decay"], decay["lr"]) == (0.1, 1e-2)
    step(model, opt, 100)
    step(fresh, opt2, 100)
    for (n, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local()), f"{n} differs one step after the load"
    client.close()


@pytest.mark.slow
def test_fsdp2_deferred_init_and_param_groups_in_another_order(tmp_path):
    run_world(deferred_init_and_groups_job, 2, str(tmp_path))


def load_during_save_job(rank: int, world: int, root: str) -> None:
    """save_async of step 2, then load() at once on every rank: all ranks must load the same
    step.  Rank 1's write of step 2 is held until rank 0 has either waited for its save or
    resolved the latest step, so rank 0 cannot see step 2 committed unless load waits."""
    import time

    from ckptd_client import client as client_mod
    from ckptd_client.client import SaveHandle
    from ckptd_client.transport import embedded

    gate = os.path.join(root, "gate")
    if rank == 0:
        real_resolve, real_result = client_mod.resolve_step, SaveHandle.result

        def resolve(*args, **kwargs):
            try:
                return real_resolve(*args, **kwargs)
            finally:
                open(gate, "w").close()

        def result(self, timeout=None):
            open(gate, "w").close()
            return real_result(self, timeout)

        client_mod.resolve_step, SaveHandle.result = resolve, result
    else:
        real_write = embedded.write_rank

        def held_write(*args, **kwargs):
            deadline = time.monotonic() + 120  # released by rank 0, see above
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.01)
            return real_write(*args, **kwargs)

        embedded.write_rank = held_write
    model = torch.nn.Linear(4, 3)
    client = CheckpointClient("load-during-save", storage=f"file://{root}")
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(step)
        client.save_async(model, step=step)
        if step == 1:
            client.wait()
    fresh = torch.nn.Linear(4, 3)
    info = client.load(fresh)
    assert info.step == 2, f"rank {rank} loaded step {info.step} while step 2 was in flight"
    assert torch.equal(fresh.weight, torch.full_like(fresh.weight, 2.0))
    client.close()


@pytest.mark.slow
def test_a_load_right_after_save_async_loads_the_same_step_on_every_rank(tmp_path):
    run_world(load_during_save_job, 2, str(tmp_path))
