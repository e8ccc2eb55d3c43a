"""Mistakes a PyTorch user makes with the embedded client, on one process: each is a clear
ckptd error that names the cause, and nothing is saved or changed."""

from __future__ import annotations

import pytest
import torch
from ckptd_client import CheckpointClient

from ckptd.errors import CheckpointNotFoundError, ConfigError


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))


def test_optimizer_over_other_parameters_is_a_clear_error(tmp_path):
    """An optimizer that holds parameters the model does not have (built before the model
    was sharded, which replaces its parameters, or for another instance): torch's own state
    dict function fails with a bare KeyError: 0 there."""
    model = _net()
    stale = torch.optim.Adam(_net().parameters())
    client = CheckpointClient("stale", storage=f"file://{tmp_path}")
    with pytest.raises(ConfigError, match=r"cannot save: 4 of the optimizer's 4 parameters are "
                                          r"not parameters of the model .*shape \[6, 4\].*after "
                                          r"wrapping"):
        client.save(model, optimizer=stale, step=1)
    with pytest.raises(CheckpointNotFoundError):
        client.load(model)  # nothing was committed

    client.save(model, optimizer=torch.optim.Adam(model.parameters()), step=2)
    fresh = _net()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    mixed = torch.optim.Adam([{"params": fresh.parameters()},
                              {"params": [torch.nn.Parameter(torch.zeros(2))]}])
    with pytest.raises(ConfigError, match=r"cannot load: 1 of the optimizer's 5 parameters .*"
                                          r"param group 1, parameter 0, shape \[2\]"):
        client.load(fresh, optimizer=mixed)
    assert not mixed.state
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    client.close()


def test_unstorable_dtype_names_the_tensor_and_keeps_earlier_steps(tmp_path):
    """A buffer of a dtype ckptd has no zarr type for (complex32): the save names it (not
    only its dtype) before anything is written; the step saved before it still loads."""

    class Odd(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("phase", torch.zeros(3, dtype=torch.complex32))

    client = CheckpointClient("quant", storage=f"file://{tmp_path}")
    model = _net()
    client.save(model, step=1)
    with pytest.raises(ConfigError, match=r"cannot save step 2: ckptd cannot store the dtype "
                                          r"of 1 tensors: model/phase \(torch.complex32\);.*"
                                          r"Convert them"):
        client.save(Odd(), step=2)
    # a sparse buffer: torch's storage access failed with NotImplementedError
    sparse = _net()
    sparse.register_buffer("mask", torch.eye(3).to_sparse())
    with pytest.raises(ConfigError, match=r"state entry 'model/mask' is a torch.sparse_coo "
                                          r"tensor; ckptd stores dense"):
        client.save(sparse, step=2)
    assert client.list_steps() == [1]
    fresh = _net()
    assert client.load(fresh).step == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(),
                                                 model.state_dict().values()))
    client.close()


def test_loading_into_an_expanded_buffer_fails_before_anything_is_overwritten(tmp_path):
    """A buffer registered as ``t.expand(...)`` saves fine but cannot be filled in place;
    the load failed with torch's RuntimeError after earlier tensors were overwritten."""
    def build(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        m = _net()
        m.register_buffer("pos", torch.randn(1, 4).expand(5, 4))
        return m

    client = CheckpointClient("expanded", storage=f"file://{tmp_path}")
    saved = build(0)
    client.save(saved, step=1)
    target = build(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(ConfigError, match=r"model/pos\), .*nothing was loaded.*clone\(\)"):
        client.load(target)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    target.pos = target.pos.clone()
    client.load(target)
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in target.state_dict().items())
    client.close()


def test_load_into_a_model_on_the_meta_device_is_refused(tmp_path):
    """Deferred init (a model built under torch.device('meta')) loaded without to_empty():
    the load returned as if it had restored the step, with every tensor still without data."""
    client = CheckpointClient("meta", storage=f"file://{tmp_path}")
    saved = _net()
    client.save(saved, step=1)
    with torch.device("meta"):
        deferred = _net()
    with pytest.raises(ConfigError, match=r"cannot load: '0.weight' and 3 more tensors are on "
                                          r"the meta device.*to_empty"):
        client.load(deferred)
    deferred.to_empty(device="cpu")
    client.load(deferred)
    assert all(torch.equal(v, saved.state_dict()[k]) for k, v in deferred.state_dict().items())
    client.close()
