"""Ranks saving through two daemons (two nodes), and one daemon's writes fail (a file where
that rank's chunk directories belong): the other daemon's rank fails at once, naming the
failed rank and its error, instead of waiting for its commit timeout."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

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


def node_daemon_killed_mid_save(rank: int, world: int, root: str, run_dir: str) -> None:
    """Rank 0 saves through daemon A, rank 1 through daemon B; B is SIGKILLed holding
    rank 1's step 2 (not yet written) and restarted; then B is upgraded: SIGTERM while it
    holds step 4 (step 5 is refused while it drains), down (step 6 finds no daemon), back
    (step 7)."""
    import signal

    import torch
    import torch.distributed as dist
    from ckptd_client import CheckpointClient

    from ckptd.daemon.testing import start_daemon
    from ckptd.errors import DaemonUnavailableError, SaveFailedError

    store = f"file://{root}/store"
    sock = os.path.join(run_dir, "ab"[rank], "ckptd.sock")
    gate = os.path.join(root, "gate")  # daemon B holds every write while it is absent
    env = {"CKPTD_TEST_WRITE_GATE": gate} if rank == 1 else {}
    node = start_daemon(store, sock, staging_bytes="64MiB", env=env,
                        log_path=os.path.join(root, f"daemon-{rank}.log"))
    try:
        if rank == 1:
            open(gate, "w").close()
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 16)
        client = CheckpointClient("lostnode", daemon=node.address)  # commit timeout 1800 s
        assert client.save(model, step=1).step == 1
        if rank == 1:
            os.unlink(gate)
        dist.barrier()
        h2 = client.save_async(model, step=2)  # returns: each daemon owns its rank's bytes
        dist.barrier()
        if rank == 1:
            node.kill()
            with pytest.raises(DaemonUnavailableError, match="will not commit"):
                h2.result(60)
            open(gate, "w").close()
            node = start_daemon(store, sock, staging_bytes="64MiB", env=env,
                                log_path=os.path.join(root, "daemon-1b.log"))
        # rank 1's next save registers with the restarted daemon, which records that its
        # step 2 was lost; rank 0 stops waiting for step 2 (it waited 1800 s before)
        assert client.save(model, step=3).step == 3
        if rank == 0:
            with pytest.raises(SaveFailedError) as err:
                h2.result(60)
            assert ("step 2 of job 'lostnode' will not commit: rank 1's save failed: "
                    "DaemonUnavailableError") in str(err.value)
        # rolling upgrade of B: steps refused while it drains or is down fail on rank 0 too
        if rank == 1:
            os.unlink(gate)
        dist.barrier()
        h4 = client.save_async(model, step=4)
        dist.barrier()
        later = []
        if rank == 1:
            node.proc.send_signal(signal.SIGTERM)
            for _ in range(600):
                if "draining" in node.log():
                    break
                time.sleep(0.05)
            with pytest.raises(DaemonUnavailableError, match="shutting down"):
                client.save_async(model, step=5)
            open(gate, "w").close()
            assert node.proc.wait(60) == 0 and h4.result(60).step == 4
            client._transport.connect_timeout = 1.0  # instead of 30 s
            with pytest.raises(DaemonUnavailableError, match="not reachable"):
                client.save_async(model, step=6)
            node = start_daemon(store, sock, staging_bytes="64MiB", env=env,
                                log_path=os.path.join(root, "daemon-1c.log"))
        else:
            later = [client.save_async(model, step=5), client.save_async(model, step=6)]
            assert h4.result(60).step == 4
        dist.barrier()
        assert client.save(model, step=7).step == 7  # rank 1 registers: records 5 and 6
        for step, h in zip((5, 6), later):
            with pytest.raises(SaveFailedError, match=f"step {step} of job 'lostnode' will not "
                               "commit: rank 1's save failed: DaemonUnavailableError"):
                h.result(60)
        client.close()
        dist.barrier()
    finally:
        node.kill()


@pytest.mark.slow
def test_a_node_daemon_killed_or_restarted_fails_the_other_nodes_ranks_when_it_is_back(
        tmp_path):
    """The step a killed daemon held, and the steps refused while a daemon drains or is
    down, never commit; once the daemon is back, its rank's client records that
    (AbandonSave) and the ranks of the other node fail instead of waiting for their commit
    timeout (30 min); the steps before and after commit."""
    root = str(tmp_path)
    run_dir = tempfile.mkdtemp(prefix="ckd-", dir="/tmp")  # short socket paths
    try:
        run_world(node_daemon_killed_mid_save, 2, root, run_dir)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    steps = list_steps(open_storage(f"file://{root}/store"), "lostnode")
    assert [(s.step, s.committed) for s in steps] == [(1, True), (2, False), (3, True),
                                                      (4, True), (5, False), (6, False),
                                                      (7, True)]


def ranks_on_daemons_with_other_storage(rank: int, world: int, addresses: list[str]) -> None:
    from ckptd_client import CheckpointClient

    from ckptd.errors import ConfigError

    with pytest.raises(ConfigError, match=r"the ranks of job 'split' write to different "
                       r"storage: rank 0 to 'file://.*', ranks \[1\] elsewhere .*same --storage"):
        CheckpointClient("split", daemon=addresses[rank])


@pytest.mark.slow
def test_ranks_whose_daemons_write_to_different_storage_are_refused_at_once(tmp_path, daemons):
    """One node's daemon with another --storage: no save of the job could commit (each
    waited its commit timeout), so the client says so when it is created.  (The daemon does
    not reach S3 before a save: no S3 server is needed.)"""
    node0 = daemons.start(storage=f"file://{tmp_path}/store")
    node1 = daemons.start(storage="s3://another-bucket/ckpt")
    run_world(ranks_on_daemons_with_other_storage, 2, [node0.address, node1.address])
