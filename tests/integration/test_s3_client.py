"""The embedded client against a real S3-compatible server (SeaweedFS): multi-rank FSDP2
save at 2 ranks, load at 3, bit-exact; storage permission errors are typed and clear."""

from __future__ import annotations

import os

import pytest
import torch
from ckptd_client import CheckpointClient
from distributed import run_world
from test_torch_fsdp import build, full_state, train

from ckptd.errors import StoragePermissionError
from ckptd.format.commit import committed_steps
from ckptd.storage import open_storage


def save_job(rank: int, world: int, uri: str, scratch: str) -> None:
    model, opt = build("fsdp2", world, seed=1)
    train(model, opt, 2, rank)
    expected = full_state(model, opt)
    client = CheckpointClient("s3job", storage=uri, pack_threshold=96)
    client.save_async(model, optimizer=opt, step=2, extra={"where": "s3"}).result(120)
    client.close()
    if rank == 0:
        torch.save(expected, os.path.join(scratch, "expected.pt"))


def load_job(rank: int, world: int, uri: str, scratch: str) -> None:
    model, opt = build("fsdp2", world, seed=2)
    client = CheckpointClient("s3job", storage=uri)
    info = client.load(model, optimizer=opt)
    assert info.step == 2 and info.world_size == 2 and info.extra == {"where": "s3"}
    want = torch.load(os.path.join(scratch, "expected.pt"), weights_only=True)
    got = full_state(model, opt)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    client.close()


@pytest.mark.slow
def test_fsdp2_save_at_2_load_at_3_on_s3(s3_uri, tmp_path):
    run_world(save_job, 2, s3_uri, str(tmp_path))
    assert committed_steps(open_storage(s3_uri), "s3job") == [2]
    run_world(load_job, 3, s3_uri, str(tmp_path))


def test_wrong_credentials_are_a_clear_permission_error(s3_uri, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "definitely-wrong")
    client = CheckpointClient("denied", storage=s3_uri)
    handle = client.save_async(torch.nn.Linear(4, 4), step=1)
    with pytest.raises(StoragePermissionError, match="(?i)permission|denied|credential"):
        handle.result(60)
    with pytest.raises(StoragePermissionError):
        client.list_steps()


@pytest.mark.s3
def test_background_write_rides_out_an_s3_outage_while_a_load_fails_fast(
        s3_uri, s3_server, caplog):
    """The embedded writer holds the staged bytes, so it retries an unreachable endpoint
    for minutes (100 attempts) and commits once it is back; a load, whose caller waits,
    gives up after the short policy with a clear, typed error."""
    import logging
    import time

    from faultproxy import FaultProxy

    from ckptd.errors import TransientStorageError

    proxy = FaultProxy(s3_server.endpoint_url)
    caplog.set_level(logging.WARNING, logger="ckptd.storage.s3")
    try:
        client = CheckpointClient("outage", storage=s3_uri,
                                  storage_options={"endpoint_url": proxy.url})
        m = torch.nn.Linear(64, 32)
        client.save_async(m, step=1).result(120)
        proxy.down()
        handle = client.save_async(m, step=2)
        deadline = time.monotonic() + 120
        while "attempt 2/100" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text[-2000:]
            time.sleep(0.05)
        assert not handle.done()
        reader = CheckpointClient("outage", storage=s3_uri,
                                  storage_options={"endpoint_url": proxy.url,
                                                   "retry_attempts": 2})
        with pytest.raises(TransientStorageError, match="unreachable"):
            reader.load(torch.nn.Linear(64, 32))
        proxy.up()
        assert handle.result(120).step == 2
        assert committed_steps(open_storage(s3_uri), "outage") == [1, 2]
        client.close()
        reader.close()
    finally:
        proxy.close()


@pytest.mark.s3
def test_a_commit_write_that_errs_after_landing_is_a_committed_save(s3_uri):
    """The put of COMMITTED reached the store and then reported an error (a 5xx or a lost
    answer): the save's handle failed although the step was committed and loaded.  Now
    the commit is read back; a COMMITTED that was never written still fails the save."""
    from ckptd.errors import TransientStorageError
    from ckptd.storage.testing import FaultInjectingBackend

    class CommitLandsButFails(FaultInjectingBackend):
        def __init__(self, inner, lands: bool) -> None:
            super().__init__(inner)
            self.lands = lands

        def put(self, key, data) -> None:
            if key.endswith("/COMMITTED"):
                if self.lands:
                    self.inner.put(key, data)
                raise TransientStorageError(f"injected: the put of {key} failed")
            self.inner.put(key, data)

    client = CheckpointClient("lands", storage=s3_uri)
    transport = client._transport
    m = torch.nn.Linear(8, 4)
    transport._wstorage = CommitLandsButFails(transport._wstorage, lands=True)
    assert client.save_async(m, step=1).result(60).step == 1
    transport._wstorage = CommitLandsButFails(transport._wstorage.inner, lands=False)
    with pytest.raises(TransientStorageError, match="injected"):
        client.save_async(m, step=2).result(60)
    client.close()
    assert committed_steps(open_storage(s3_uri), "lands") == [1]
    loaded = torch.nn.Linear(8, 4)
    assert CheckpointClient("lands", storage=s3_uri).load(loaded).step == 1
    assert torch.equal(loaded.weight, m.weight)
