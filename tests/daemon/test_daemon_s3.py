"""The daemon writing to a real S3 server (SeaweedFS): save and commit through the daemon,
load back through it and directly from S3, bit-exact."""

from __future__ import annotations

import pytest
import torch
from ckptd_client import CheckpointClient

from ckptd.format.commit import committed_steps
from ckptd.storage import open_storage


@pytest.mark.s3
@pytest.mark.slow
def test_daemon_saves_to_s3(s3_uri, daemons):  # noqa: F811
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
