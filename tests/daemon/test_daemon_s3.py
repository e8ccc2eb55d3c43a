"""The daemon writing to a real S3 server (SeaweedFS): save and commit through the daemon,
load back through it and directly from S3, bit-exact; an outage between daemon and S3."""

from __future__ import annotations

import time

import pytest
import torch
from ckptd_client import CheckpointClient
from faultproxy import FaultProxy

from ckptd.errors import TransientStorageError
from ckptd.format.commit import committed_steps
from ckptd.storage import open_storage


@pytest.mark.s3
@pytest.mark.slow
def test_daemon_saves_to_s3(s3_uri, daemons):
    d = daemons.start(storage=s3_uri)   # the daemon inherits the S3 endpoint and credentials
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 300), torch.nn.LayerNorm(300))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 512)).sum().backward()
    opt.step()
    client = CheckpointClient("s3job", daemon=d.address)
    assert client.save_async(m, optimizer=opt, step=1).result(120).storage == s3_uri.rstrip("/")
    assert client.list_steps() == [1]
    assert committed_steps(open_storage(s3_uri), "s3job") == [1]
    for c in (client, CheckpointClient("s3job", storage=s3_uri)):
        m2 = torch.nn.Sequential(torch.nn.Linear(512, 300), torch.nn.LayerNorm(300))
        opt2 = torch.optim.AdamW(m2.parameters())
        c.load(m2, optimizer=opt2)
        for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
            assert torch.equal(a, b)
        c.close()


def _wait_for(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _text(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(256, 128)


@pytest.mark.s3
@pytest.mark.slow
def test_daemon_rides_out_an_s3_outage_and_fails_a_save_only_after_its_retry_window(
        s3_uri, s3_server, daemons):
    """The daemon holds a save's bytes, so a network outage to S3 shorter than
    --storage-retry-s delays the commit instead of losing the step; past the window the save
    fails with the storage's error, earlier steps stay loadable and the daemon keeps serving."""
    proxy = FaultProxy(s3_server.endpoint_url)
    try:
        env = {"CKPTD_S3_ENDPOINT_URL": proxy.url}
        patient = daemons.start(storage=s3_uri, env=env)
        hasty = daemons.start(storage=s3_uri, env=env, extra_args=("--storage-retry-s", "0.5"))
        m1, m2 = _model(1), _model(2)
        c = CheckpointClient("outage", daemon=patient.address)
        assert c.save_async(m1, step=1).result(120).step == 1

        proxy.down()
        handle = c.save_async(m2, step=2)
        handle.wait_staged()                  # handed over while S3 is unreachable
        # the write is retried under the daemon's window (100 attempts, not the 6 of a
        # storage client's default policy, which gives up after a few seconds)
        _wait_for(lambda: "transient error on attempt 2/100" in _text(patient.log_path),
                  "the daemon to retry a failed write")
        assert not handle.done()
        proxy.up()
        assert handle.result(120).step == 2
        assert c.list_steps() == [1, 2]

        proxy.down()
        h = CheckpointClient("outage", daemon=hasty.address)
        with pytest.raises(TransientStorageError, match="unreachable") as err:
            h.save_async(m1, step=3).result(120)
        assert "step 3" in str(err.value) and "not committed" in str(err.value)
        assert proxy.refused > 0
        proxy.up()
        assert hasty.alive() and patient.alive()
        assert h.save_async(m1, step=4).result(120).step == 4
        assert committed_steps(open_storage(s3_uri), "outage") == [1, 2, 4]
        back = _model(0)
        c.load(back, step=2)
        assert torch.equal(back.weight, m2.weight) and torch.equal(back.bias, m2.bias)
        c.close()
        h.close()
    finally:
        proxy.close()
