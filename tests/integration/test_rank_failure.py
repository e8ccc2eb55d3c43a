"""One rank's save fails (here: a file-size limit on that rank's process, a real EFBIG)
while the others' writes succeed: every rank's handle fails at once, not after the commit
timeout, because the failed rank records ``_ranks/<rank>.failed`` and the waiting ranks
look for it; the earlier step still loads and the next save commits."""

from __future__ import annotations

import resource

import pytest
import torch
from distributed import run_world

from ckptd.errors import SaveFailedError, StorageError


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))


def one_rank_fails(rank: int, world: int, uri: str) -> None:
    from ckptd_client import CheckpointClient

    model = _model(0)
    client = CheckpointClient("rankfail", storage=uri, pack_threshold=0)  # commit_timeout 1800 s
    client.save(model, step=1, timeout=120)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:  # chunks are 256 KiB: this rank cannot write them; its failure record fits
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, limit[1]))
    handle = client.save_async(model, step=2)
    with pytest.raises((StorageError, SaveFailedError)) as err:
        handle.result(120)  # TimeoutError if rank 0 waited for its commit timeout (1800 s)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        assert err.type is StorageError and "RLIMIT_FSIZE" in str(err.value)
    else:
        assert err.type is SaveFailedError
        assert "step 2 of job 'rankfail' will not commit: rank 1's save failed" in str(err.value)
        assert "RLIMIT_FSIZE" in str(err.value)
    assert client.list_steps() == [1]
    back = _model(5)
    assert client.load(back).step == 1
    for a, b in zip(back.parameters(), _model(0).parameters()):
        assert torch.equal(a, b)
    assert client.save(model, step=3, timeout=120).step == 3
    client.close()


@pytest.mark.slow
def test_a_failed_rank_fails_every_rank_at_once(tmp_path):
    run_world(one_rank_fails, 2, f"file://{tmp_path}")
