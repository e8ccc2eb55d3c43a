"""TCP: TLS only, bearer token checked; a remote client streams its bytes (no shared
memory) and loads through the daemon; a wrong or missing token is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest
import torch
from ckptd_client import CheckpointClient
from daemon_helpers import error_class
from distributed import free_port

from ckptd.daemon.cli import check_health
from ckptd.errors import AuthenticationError
from ckptd.v1 import ckptd_pb2 as pb
from ckptd.v1 import ckptd_pb2_grpc as pb_grpc


def _self_signed(d: str) -> tuple[str, str]:
    key, cert = os.path.join(d, "key.pem"), os.path.join(d, "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key


@pytest.mark.slow
def test_tls_token_stream_save_load_and_wrong_token(tmp_path, daemons, monkeypatch):
    cert, key = _self_signed(str(tmp_path))
    token_file = tmp_path / "token"
    token = "t0k3n-" + os.urandom(16).hex()
    token_file.write_text(token + "\n")
    port = free_port()
    addr = f"127.0.0.1:{port}"
    d = daemons.start(extra_args=("--listen", addr, "--tls-cert", cert, "--tls-key", key,
                                  "--token-file", str(token_file)))
    monkeypatch.setenv("CKPTD_TLS_CA", cert)

    # health needs no token (probes); it is still TLS
    with open(cert, "rb") as f:
        ca = f.read()
    assert check_health(addr, tls_ca=ca, secure=True) == "SERVING"
    # `ckptd health` trusts CKPTD_TLS_CA as the clients do (it ignored it: a failed handshake)
    health = subprocess.run([sys.executable, "-m", "ckptd.cli", "health", "--address", addr],
                            capture_output=True, text=True, timeout=60, check=False)
    assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr
    # plaintext TCP is not served
    assert check_health(addr, secure=False, timeout=3) != "SERVING"

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 300)).sum().backward()
    opt.step()
    client = CheckpointClient("remote", daemon=addr, token=token)
    assert not client._transport.local
    info = client.save_async(m, optimizer=opt, step=5, extra={"k": 1}).result(60)
    assert info.step == 5
    assert client.list_steps() == [5]
    m2 = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 10))
    opt2 = torch.optim.AdamW(m2.parameters())
    assert client.load(m2, optimizer=opt2).extra == {"k": 1}
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    read = client._transport.storage().read_bytes   # no shared memory over TCP: streamed
    assert read["shared_memory"] == 0 and read["stream"] > 0
    client.close()

    with pytest.raises(AuthenticationError, match="wrong bearer token"):
        CheckpointClient("remote", daemon=addr, token="not-the-token")
    monkeypatch.delenv("CKPTD_TOKEN", raising=False)
    monkeypatch.delenv("CKPTD_TOKEN_FILE", raising=False)
    with pytest.raises(AuthenticationError, match="missing bearer token"):
        CheckpointClient("remote", daemon=addr)
    # raw: every RPC kind is refused without the token
    channel = grpc.secure_channel(addr, grpc.ssl_channel_credentials(ca))
    stub = pb_grpc.CheckpointServiceStub(channel)
    for call, req in ((stub.ListSteps, pb.ListStepsRequest(job="remote")),
                      (stub.ReadObject, pb.ReadObjectRequest(job="remote", key="remote/x"))):
        with pytest.raises(grpc.RpcError) as ei:
            r = call(req, timeout=10, metadata=(("authorization", "Bearer nope"),))
            if not isinstance(r, pb.ListStepsResponse):
                list(r)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error_class(ei.value) == "AuthenticationError"
    # with the token: reading into shared memory is refused over TCP (remote clients stream)
    md = (("authorization", f"Bearer {token}"),)
    session = stub.RegisterRank(pb.RegisterRankRequest(job="remote", rank=0, world_size=1),
                                timeout=10, metadata=md)
    with pytest.raises(grpc.RpcError) as ei:
        stub.ReadIntoSegment(pb.ReadIntoSegmentRequest(
            session_id=session.session_id, segment_id="x",
            ranges=[pb.ReadRange(key="remote/x", length=4)]), timeout=10, metadata=md)
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "Unix socket" in ei.value.details()
    channel.close()

    # client-side mistakes say which setting is wrong
    from ckptd_client.transport.daemon import DaemonTransport

    from ckptd.errors import ConfigError, DaemonUnavailableError

    for var in ("CKPTD_TLS_CA", "CKPTD_TOKEN_FILE"):
        with monkeypatch.context() as mp:
            mp.setenv(var, str(tmp_path / "missing.pem"))
            with pytest.raises(ConfigError, match=f"{var}=.*missing.pem cannot be read"):
                CheckpointClient("remote", daemon=addr)
    monkeypatch.delenv("CKPTD_TLS_CA")      # the self-signed certificate is not trusted
    with pytest.raises(DaemonUnavailableError, match="not accepted here.*CKPTD_TLS_CA"):
        DaemonTransport(addr, job="remote", rank=0, world_size=1, token=token,
                        connect_timeout=0.5)
    with pytest.raises(DaemonUnavailableError, match="Nothing accepts TCP connections"):
        DaemonTransport(f"127.0.0.1:{free_port()}", job="remote", rank=0, world_size=1,
                        token=token, connect_timeout=0.5)
    assert check_health("unix:" + d.socket) == "SERVING"


def test_startup_failures_say_why_and_leave_nothing_serving(tmp_path):
    """A bad certificate or key, a busy TCP port or a busy metrics port: exit 2 with a
    one-line reason (no traceback), and no Unix socket left for clients to find; likewise
    `ckptd health` with an unreadable --tls-ca."""
    import socket
    import sys

    d = str(tmp_path)
    cert, key = _self_signed(d)
    os.mkdir(os.path.join(d, "other"))
    _cert2, key2 = _self_signed(os.path.join(d, "other"))
    token = os.path.join(d, "token")
    with open(token, "w") as f:
        f.write("0123456789abcdef0123")
    garbage = os.path.join(d, "garbage.pem")
    with open(garbage, "w") as f:
        f.write("not a certificate\n")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    sock = os.path.join(d, "run", "x.sock")

    def serve(*args: str) -> str:
        out = subprocess.run(
            [sys.executable, "-m", "ckptd.cli", "serve", "--storage", f"file://{d}/store",
             "--socket", sock, *args], capture_output=True, text=True, timeout=60, check=False)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert not os.path.exists(sock), out.stderr
        return out.stderr

    tls = ("--tls-cert", cert, "--tls-key", key, "--token-file", token, "--metrics-port", "0")
    free = f"127.0.0.1:{free_port()}"
    assert "not a PEM certificate" in serve("--listen", free, *tls[:1], garbage, "--tls-key",
                                            garbage, *tls[4:])
    assert "KEY_VALUES_MISMATCH" in serve("--listen", free, *tls[:3], key2, *tls[4:])
    assert "--token-file" in serve("--listen", free, *tls[:5], os.path.join(d, "nope"),
                                   *tls[6:])
    assert f"cannot listen on --listen 127.0.0.1:{port}" in serve(
        "--listen", f"127.0.0.1:{port}", *tls)
    assert f"--metrics-port {port}" in serve("--metrics-port", str(port))
    busy.close()
    health = subprocess.run(
        [sys.executable, "-m", "ckptd.cli", "health", "--address", free, "--tls-ca",
         os.path.join(d, "nope.pem")], capture_output=True, text=True, timeout=60, check=False)
    assert health.returncode == 2 and "--tls-ca" in health.stderr, health.stderr
    assert "Traceback" not in health.stderr
