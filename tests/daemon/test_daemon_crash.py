"""Real processes killed for real: a trainer SIGKILLed right after save_async returns (the
step still commits), the daemon SIGKILLed mid-save (the step never commits, the earlier one
loads bit-exact, the handle fails clearly, a restarted daemon serves the next save), and
SIGTERM draining (first SIGTERM drains and exits 0; a second one aborts)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from ckptd_client import CheckpointClient
from daemon_helpers import assert_equal_state, daemon_crash_rank, fsdp
from distributed import free_port, run_world

from ckptd.daemon.cli import check_health
from ckptd.errors import DaemonUnavailableError
from ckptd.format.commit import committed_steps
from ckptd.storage import open_storage

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_trainer_sigkilled_after_save_async_still_commits(tmp_path, daemons):
    root = str(tmp_path)
    gate = os.path.join(root, "gate")  # absent: the daemon holds every write
    d = daemons.start(env={"CKPTD_TEST_WRITE_GATE": gate})
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "trainer_kill.py"), str(r), "2",
                               str(port), root, d.address], env=env)
             for r in range(2)]
    for p in procs:
        assert p.wait(timeout=120) == -signal.SIGKILL
    assert all(os.path.exists(os.path.join(root, f"handed-over-{r}")) for r in range(2))
    store = open_storage(f"file://{root}/store")
    assert committed_steps(store, "killed") == []  # nothing was written before the kill
    open(gate, "w").close()  # let the daemon write what the dead trainers handed over
    steps = []
    for _ in range(600):
        steps = committed_steps(store, "killed")
        if steps:
            break
        time.sleep(0.1)
    assert steps == [7], d.log()
    want = torch.load(os.path.join(root, "killed.expected.pt"), weights_only=True)
    model = fsdp.Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    CheckpointClient("killed", daemon=d.address).load(model, optimizer=opt)
    assert_equal_state(fsdp.full_state(model, opt), want, "after trainer SIGKILL")
    assert "session closed" in d.log()  # the dead trainers' sessions were reclaimed
    assert check_health("unix:" + d.socket) == "SERVING"


@pytest.mark.slow
def test_daemon_sigkilled_mid_save_then_restarted(tmp_path, daemons):
    root = str(tmp_path)
    sock = daemons.socket_path("crash")
    run_world(daemon_crash_rank, 2, root, sock, os.path.join(root, "gate"), root)


def _small_model():
    torch.manual_seed(0)
    m = torch.nn.Linear(64, 32)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def _wait_until_draining(d) -> None:
    """Poll health (bounded) until the daemon has stopped SERVING after a SIGTERM."""
    for _ in range(200):
        if check_health("unix:" + d.socket) != "SERVING":
            break
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_drains_in_flight_saves_and_exits_0(tmp_path, daemons):
    root = str(tmp_path)
    gate = os.path.join(root, "gate")
    d = daemons.start(env={"CKPTD_TEST_WRITE_GATE": gate})
    m, opt = _small_model()
    client = CheckpointClient("drain", daemon=d.address)
    h = client.save_async(m, optimizer=opt, step=1)
    d.proc.send_signal(signal.SIGTERM)
    # draining: not SERVING any more, new saves are refused, the accepted one is still owed
    _wait_until_draining(d)
    assert check_health("unix:" + d.socket) == "NOT_SERVING"
    with pytest.raises(DaemonUnavailableError, match="draining|shutting down"):
        client.save_async(m, optimizer=opt, step=2).result(30)
    assert not h.done()
    open(gate, "w").close()
    assert h.result(60).step == 1
    assert d.proc.wait(60) == 0
    assert committed_steps(open_storage(f"file://{root}/store"), "drain") == [1]
    client.close()


@pytest.mark.slow
def test_second_sigterm_aborts_without_committing(tmp_path, daemons):
    root = str(tmp_path)
    d = daemons.start(env={"CKPTD_TEST_WRITE_GATE": os.path.join(root, "never")})
    m, opt = _small_model()
    client = CheckpointClient("abort", daemon=d.address)
    h = client.save_async(m, optimizer=opt, step=1)
    d.proc.send_signal(signal.SIGTERM)
    _wait_until_draining(d)
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(60) == 1
    with pytest.raises(DaemonUnavailableError, match="will not commit"):
        h.result(30)
    store = open_storage(f"file://{root}/store")
    assert committed_steps(store, "abort") == []
    assert not any(k.endswith("_ranks/0.json") for k in store.list_files("abort"))
    client.close()


@pytest.mark.slow
def test_trainer_that_exits_after_save_async_hands_over_and_does_not_wait_for_the_daemon(
        tmp_path, daemons):
    """A script that ends right after save_async (copy and overlap mode) exits at once with
    its saves handed over: the daemon holds every write (gate closed) and the script still
    exits; both steps commit once the daemon may write."""
    root = str(tmp_path)
    gate = os.path.join(root, "gate")
    d = daemons.start(env={"CKPTD_TEST_WRITE_GATE": gate})
    script = (
        "import torch\n"
        "from ckptd_client import CheckpointClient\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Linear(64, 64)\n"
        f"c = CheckpointClient('exits', daemon={d.address!r})\n"
        "c.save_async(m, step=1)\n"
        "c.save_async(m, step=2, overlap=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    store = open_storage(f"file://{root}/store")
    assert committed_steps(store, "exits") == []   # exited before the daemon wrote anything
    open(gate, "w").close()
    for _ in range(600):
        if committed_steps(store, "exits") == [1, 2]:
            break
        time.sleep(0.1)
    assert committed_steps(store, "exits") == [1, 2], d.log()
    torch.manual_seed(0)
    want = torch.nn.Linear(64, 64)
    for step in (1, 2):
        back = torch.nn.Linear(64, 64)
        CheckpointClient("exits", daemon=d.address).load(back, step=step)
        assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(),
                                                     want.state_dict().values()))
