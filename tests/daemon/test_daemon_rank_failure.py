"""Ranks saving through two daemons (two nodes), and one daemon's writes fail (a file where
that rank's chunk directories belong): the other daemon's rank fails at once, naming the
failed rank and its error, instead of waiting for its commit timeout."""

from __future__ import annotations

import os

import pytest
from daemon_helpers import fsdp
from distributed import run_world

from ckptd.errors import CkptdError
from ckptd.format import paths
from ckptd.format.commit import list_steps
from ckptd.storage import open_storage


def save_through_own_daemon(rank: int, world: int, store: str, addresses: list[str]) -> None:
    from ckptd_client import CheckpointClient

    model, _ = fsdp.build("fsdp2", world, seed=1)
    client = CheckpointClient("rankfail", daemon=addresses[rank], pack_threshold=0)
    if rank == 1:  # this rank writes chunk 1 of every (dim-0 sharded) array: block them
        attempt = os.path.join(store, paths.attempt_prefix("rankfail", 1,
                                                           f"{client.launch_id}.1"))
        for name in model.state_dict():
            os.makedirs(os.path.join(attempt, "model", name, "c"), exist_ok=True)
            with open(os.path.join(attempt, "model", name, "c", "1"), "w") as f:
                f.write("not a directory")
    handle = client.save_async(model, step=1)  # commit timeout: the default 1800 s
    with pytest.raises(CkptdError) as err:
        handle.result(120)  # TimeoutError if rank 0 waited for its commit timeout
    assert "Move it away" in str(err.value)  # rank 1's own error, or what it recorded
    if rank == 0:
        assert "step 1 of job 'rankfail' will not commit: rank 1's save failed" in str(err.value)
    client.close()


@pytest.mark.slow
def test_a_rank_failing_on_another_daemon_fails_this_daemons_rank_at_once(tmp_path, daemons):
    store = str(tmp_path / "store")
    node0, node1 = daemons.start(), daemons.start()
    run_world(save_through_own_daemon, 2, store, [node0.address, node1.address])
    steps = list_steps(open_storage(store), "rankfail")
    assert [(s.step, s.committed) for s in steps] == [(1, False)]
    assert node0.alive() and node1.alive()


def one_rank_fails_before_handover(rank: int, world: int, address: str) -> None:
    from ckptd_client import CheckpointClient

    from ckptd.errors import ConfigError

    model, _ = fsdp.build("fsdp2", world, seed=1)
    client = CheckpointClient("abandon", daemon=address)
    if rank == 1:  # only this rank's extra state cannot be stored: refused before handover
        with pytest.raises(ConfigError, match="extra.bad is a object"):
            client.save_async(model, step=1, extra={"bad": object()})
    else:
        handle = client.save_async(model, step=1)  # commit timeout: the default 1800 s
        with pytest.raises(CkptdError) as err:
            handle.result(120)  # TimeoutError if it waited for its commit timeout
        assert "step 1 of job 'abandon' will not commit: rank 1's save failed" in str(err.value)
        assert "extra.bad is a object" in str(err.value)  # rank 1's own error
    # the ranks' next save commits (their attempt names stayed in step)
    assert client.save(model, step=2).step == 2
    # with backpressure 'error' the ranks agree before staging: the others skip the step
    # (a BackpressureError would blame a save still being written)
    client.backpressure = "error"
    if rank == 1:
        with pytest.raises(ConfigError, match="extra.bad is a object"):
            client.save_async(model, step=3, extra={"bad": object()})
    else:
        assert client.save_async(model, step=3).result(60).skipped
    assert client.save(model, step=4).step == 4
    client.close()


@pytest.mark.slow
def test_a_rank_whose_save_fails_before_handover_fails_the_others_at_once(tmp_path, daemons):
    """The daemon records the failure a rank reports with AbandonSave, as an embedded
    client records its own, so the ranks waiting for the commit stop waiting."""
    store = str(tmp_path / "abandon-store")
    node = daemons.start(storage=f"file://{store}")
    run_world(one_rank_fails_before_handover, 2, node.address)
    steps = list_steps(open_storage(store), "abandon")
    assert [(s.step, s.committed) for s in steps] == [(1, False), (2, True), (3, False),
                                                      (4, True)]
    assert node.alive()
