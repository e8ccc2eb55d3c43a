"""Loads on the daemon's node read through shared memory (ReadIntoSegment): bit-exact, no
object bytes in gRPC messages (the daemon's and the client's byte counts say which path
was used), the read segment is given back after the load, the stream is the fallback,
malformed requests are refused while the daemon keeps serving, and a client killed in the
middle of a load leaves nothing behind -- the segment stays mapped until the daemon's
reading thread is done with it, then returns to the budget."""

from __future__ import annotations

import mmap
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import torch
from ckptd_client import CheckpointClient
from daemon_helpers import Daemons, error_class, raw_session
from distributed import free_port

from ckptd.daemon.cli import check_health
from ckptd.storage import open_storage
from ckptd.v1 import ckptd_pb2 as pb


def _metric(port: int, name: str, labels: str = "") -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    label = r"\{" + re.escape(labels) + r"\}" if labels else ""
    pat = "^" + re.escape(name) + label + r" (\S+)$"
    m = re.search(pat, body, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def _model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(512, 384), torch.nn.LayerNorm(384),
                            torch.nn.Linear(384, 40).to(torch.bfloat16))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m[2](m[1](m[0](torch.randn(4, 512))).bfloat16()).float().sum().backward()
    opt.step()
    opt.zero_grad()
    return m, opt


def _equal(a: torch.nn.Module, oa: torch.optim.Optimizer, b: torch.nn.Module,
           ob: torch.optim.Optimizer) -> None:
    for (k, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert x.dtype == y.dtype and torch.equal(x, y), k
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        for k in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])), (i, k)


def _wait(cond, what: str, log) -> None:
    for _ in range(1200):
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{log()[-3000:]}")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    root = tmp_path_factory.mktemp("shmread")
    ds = Daemons(str(root))
    port = free_port()
    d = ds.start(extra_args=("--metrics-port", str(port)), staging_bytes="128MiB")
    d.metrics_port = port  # type: ignore[attr-defined]
    d.root = str(root)  # type: ignore[attr-defined]
    yield d
    ds.close()


def test_load_reads_through_shared_memory_bit_exact(daemon, monkeypatch):
    monkeypatch.delenv("CKPTD_SHM_READS", raising=False)
    m, opt = _model(1)
    client = CheckpointClient("shm", daemon=daemon.address, pack_threshold=4096)
    client.save(m, optimizer=opt, step=3, extra={"note": "x", "t": torch.arange(5)})
    port = daemon.metrics_port
    shm_before = _metric(port, "ckptd_bytes_read_total", 'transfer="shared_memory"')
    segments = _metric(port, "ckptd_staging_segments")     # the client's save segment

    m2, opt2 = _model(2)
    info = client.load(m2, optimizer=opt2)
    assert info.step == 3 and info.extra["note"] == "x"
    assert torch.equal(info.extra["t"], torch.arange(5))
    _equal(m, opt, m2, opt2)
    storage = client._transport.storage()
    got = storage.read_bytes
    # the checkpoint's chunks came through shared memory; only small metadata (the commit
    # record, manifests, the index) was streamed
    assert got["shared_memory"] >= sum(p.numel() * p.element_size() for p in m.parameters())
    assert got["stream"] < got["shared_memory"]
    daemon_shm = _metric(port, "ckptd_bytes_read_total", 'transfer="shared_memory"')
    assert daemon_shm - shm_before == got["shared_memory"]
    # the read segment went back to the budget when the load ended
    assert _metric(port, "ckptd_staging_segments") == segments
    assert not storage._windows

    # embedded mode reads the same bytes
    m3, opt3 = _model(3)
    CheckpointClient("shm", storage=f"file://{daemon.root}/store").load(m3, optimizer=opt3)
    _equal(m2, opt2, m3, opt3)
    client.close()
    _wait(lambda: _metric(port, "ckptd_staging_bytes_in_use") == 0, "budget back", daemon.log)


def test_forced_fallback_streams_and_is_bit_exact(daemon, monkeypatch):
    m, opt = _model(4)
    client = CheckpointClient("stream", daemon=daemon.address)
    client.save(m, optimizer=opt, step=1)
    monkeypatch.setenv("CKPTD_SHM_READS", "0")
    m2, opt2 = _model(5)
    client.load(m2, optimizer=opt2)
    _equal(m, opt, m2, opt2)
    got = client._transport.storage().read_bytes
    assert got["shared_memory"] == 0 and got["stream"] > 0
    client.close()


def _read(s, segment_id: str, *ranges: pb.ReadRange) -> pb.ReadIntoSegmentResponse:
    return s.stub.ReadIntoSegment(pb.ReadIntoSegmentRequest(
        session_id=s.session.session_id, segment_id=segment_id, ranges=list(ranges)),
        timeout=30)


def _refused(s, segment_id: str, *ranges: pb.ReadRange,
             session_id: str | None = None) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.RpcError) as ei:
        s.stub.ReadIntoSegment(pb.ReadIntoSegmentRequest(
            session_id=session_id or s.session.session_id, segment_id=segment_id,
            ranges=list(ranges)), timeout=30)
    return ei.value.code(), error_class(ei.value), ei.value.details()


def test_bad_read_requests_are_refused_and_daemon_keeps_serving(daemon):
    store = open_storage(f"file://{daemon.root}/store")
    data = os.urandom(5000)
    store.put("raw/obj", data)
    store.put("other/secret", b"not yours")
    INVALID, NOT_FOUND, PRECONDITION = (grpc.StatusCode.INVALID_ARGUMENT,
                                        grpc.StatusCode.NOT_FOUND,
                                        grpc.StatusCode.FAILED_PRECONDITION)
    with raw_session(daemon.socket) as s, raw_session(daemon.socket, rank=0) as other:
        sid = s.session.session_id
        seg = s.stub.AcquireStaging(pb.AcquireStagingRequest(
            session_id=sid, nbytes=10_000, transfer=pb.TRANSFER_SHARED_MEMORY,
            use=pb.SEGMENT_USE_READ), timeout=10)
        assert seg.size == 1 << 20                        # rounded up to 1 MiB, no headroom
        # not fetched yet: nothing may be read into it
        code, _, msg = _refused(s, seg.segment_id, pb.ReadRange(key="raw/obj", length=10))
        assert code == PRECONDITION and "fetch it" in msg
        reply, fds = s.fetch(seg.segment_id)
        assert reply["ok"] and len(fds) == 1
        mm = mmap.mmap(fds[0], seg.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        os.close(fds[0])

        # valid: a whole object, a range, a range past the end, a missing object
        r = _read(s, seg.segment_id,
                  pb.ReadRange(key="raw/obj", length=5000, offset=0, whole=True),
                  pb.ReadRange(key="raw/obj", start=100, length=50, offset=8192),
                  pb.ReadRange(key="raw/obj", start=4990, length=64, offset=16384),
                  pb.ReadRange(key="raw/absent", length=8, offset=20000),
                  pb.ReadRange(key="raw/obj", length=4000, offset=30000, whole=True))
        assert list(r.nbytes) == [5000, 50, 10, -1, 5000]
        assert mm[:5000] == data and mm[8192:8242] == data[100:150]
        assert mm[16384:16394] == data[4990:] and mm[30000:30010] == bytes(10)

        # bounds: past the end of the segment, overlapping ranges, too many ranges
        code, cls, msg = _refused(s, seg.segment_id, pb.ReadRange(
            key="raw/obj", length=4096, offset=seg.size - 4000))
        assert (code, cls) == (INVALID, "StagingError") and "outside the read segment" in msg
        code, _, _ = _refused(s, seg.segment_id, pb.ReadRange(
            key="raw/obj", length=8, offset=(1 << 64) - 4))
        assert code == INVALID
        code, _, msg = _refused(s, seg.segment_id,
                                pb.ReadRange(key="raw/obj", length=100, offset=0),
                                pb.ReadRange(key="raw/obj", length=100, offset=64))
        assert code == INVALID and "overlap" in msg
        code, _, msg = _refused(s, seg.segment_id, *[pb.ReadRange(key="raw/obj")] * 4097)
        assert code == INVALID and "4096" in msg
        code, _, msg = _refused(s, seg.segment_id, pb.ReadRange(
            key="raw/obj", start=1, length=10, whole=True))
        assert code == INVALID and "start at 0" in msg
        # keys outside the session's job, or escaping it
        for key in ("other/secret", "raw/../other/secret", "/etc/passwd", "raw", "rawx/obj"):
            code, cls, msg = _refused(s, seg.segment_id, pb.ReadRange(key=key, length=9))
            assert (code, cls) == (INVALID, "ConfigError"), key
        assert mm[:9] == data[:9]                         # nothing was read by refusals
        # segments: not this session's, unknown, a save segment; an unknown session
        code, _, _ = _refused(other, seg.segment_id, pb.ReadRange(key="raw/obj", length=9))
        assert code == NOT_FOUND
        code, _, _ = _refused(s, "nope", pb.ReadRange(key="raw/obj", length=9))
        assert code == NOT_FOUND
        code, _, _ = _refused(s, seg.segment_id, pb.ReadRange(key="raw/obj", length=9),
                              session_id="0" * 32)
        assert code == NOT_FOUND
        save_seg = s.stub.AcquireStaging(pb.AcquireStagingRequest(
            session_id=sid, nbytes=1000, transfer=pb.TRANSFER_SHARED_MEMORY), timeout=10)
        for fd in s.fetch(save_seg.segment_id)[1]:
            os.close(fd)
        code, _, msg = _refused(s, save_seg.segment_id, pb.ReadRange(key="raw/obj", length=9))
        assert code == PRECONDITION and "not a read segment" in msg
        # a read segment is not a staging buffer for Save; a stream reservation is not one
        with pytest.raises(grpc.RpcError) as ei:
            s.stub.Save(pb.SaveRequest(
                session_id=sid, segment_id=seg.segment_id, identity=pb.SaveIdentity(
                    job="raw", step=1, attempt="a1", rank=0, world_size=1, framework="plain"),
                plan_json=b"{}", extra_json=b"null", param_groups_json=b"[]"), timeout=10)
        assert ei.value.code() == INVALID and "read" in ei.value.details()
        with pytest.raises(grpc.RpcError) as ei:
            s.stub.AcquireStaging(pb.AcquireStagingRequest(
                session_id=sid, nbytes=1000, transfer=pb.TRANSFER_STREAM,
                use=pb.SEGMENT_USE_READ), timeout=10)
        assert ei.value.code() == INVALID
        # released: gone for reads, and its bytes are back in the budget
        s.stub.ReleaseStaging(pb.ReleaseStagingRequest(session_id=sid,
                                                       segment_id=seg.segment_id), timeout=10)
        code, _, _ = _refused(s, seg.segment_id, pb.ReadRange(key="raw/obj", length=9))
        assert code == NOT_FOUND
        mm.close()

    assert check_health("unix:" + daemon.socket) == "SERVING"
    m, opt = _model(6)
    client = CheckpointClient("after-bad-reads", daemon=daemon.address)
    client.save(m, optimizer=opt, step=1)
    m2, opt2 = _model(7)
    client.load(m2, optimizer=opt2)
    _equal(m, opt, m2, opt2)
    assert client._transport.storage().read_bytes["shared_memory"] > 0
    client.close()


LOADER = """
import sys, torch
from ckptd_client import CheckpointClient
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(512, 384), torch.nn.Linear(384, 40))
CheckpointClient("killload", daemon=sys.argv[1]).load(m)
print("loaded")
"""


@pytest.mark.slow
def test_client_killed_mid_load_leaves_no_segment(tmp_path, daemons: Daemons):
    gate = str(tmp_path / "read-gate")        # absent: the daemon holds every range it reads
    port = free_port()
    d = daemons.start(env={"CKPTD_TEST_READ_GATE": gate},
                      extra_args=("--metrics-port", str(port)))
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 384), torch.nn.Linear(384, 40))
    saver = CheckpointClient("killload", daemon=d.address)
    saver.save(m, step=1)
    saver.close()
    _wait(lambda: _metric(port, "ckptd_staging_bytes_in_use") == 0, "saver's segment", d.log)

    proc = subprocess.Popen([sys.executable, "-c", LOADER, d.address],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: _metric(port, "ckptd_read_ranges_in_flight") > 0, "a range in flight",
              d.log)
        assert _metric(port, "ckptd_staging_segments") == 1   # the loader's read segment
        assert _metric(port, "ckptd_staging_bytes_in_use") > 0
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
    _wait(lambda: any("session closed" in line and f"pid={proc.pid}" in line
                      for line in d.log().splitlines()), "the loader's session to close", d.log)
    # the session is gone, but a read thread still holds the segment: it stays mapped and
    # charged (freeing it now could unmap memory the thread is about to write)
    assert _metric(port, "ckptd_staging_segments") == 1
    assert _metric(port, "ckptd_read_ranges_in_flight") > 0
    open(gate, "w").close()                   # let the held reads finish
    _wait(lambda: (_metric(port, "ckptd_staging_segments"),
                   _metric(port, "ckptd_staging_bytes_in_use"),
                   _metric(port, "ckptd_read_ranges_in_flight")) == (0, 0, 0),
          "the read segment to be freed", d.log)
    assert check_health("unix:" + d.socket) == "SERVING"
    m2 = torch.nn.Sequential(torch.nn.Linear(512, 384), torch.nn.Linear(384, 40))
    loader = CheckpointClient("killload", daemon=d.address)
    loader.load(m2)
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    assert loader._transport.storage().read_bytes["shared_memory"] > 0
    loader.close()


@pytest.mark.slow
def test_daemon_restarted_mid_load_the_load_completes_through_the_stream(tmp_path,
                                                                         daemons: Daemons):
    import threading

    gate = str(tmp_path / "read-gate")
    port = free_port()
    sock = daemons.socket_path("restart")
    d = daemons.start(socket_path=sock, env={"CKPTD_TEST_READ_GATE": gate},
                      extra_args=("--metrics-port", str(port)))
    m, opt = _model(8)
    client = CheckpointClient("restart", daemon=d.address)
    client.save(m, optimizer=opt, step=1)
    m2, opt2 = _model(9)
    result: dict[str, object] = {}

    def load() -> None:
        try:
            result["info"] = client.load(m2, optimizer=opt2)
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    t = threading.Thread(target=load)
    t.start()
    _wait(lambda: _metric(port, "ckptd_read_ranges_in_flight") > 0, "a range in flight", d.log)
    d.kill()                                  # mid-read: the daemon's segment mapping is gone
    d2 = daemons.start(socket_path=sock)      # same socket, no gate
    t.join(timeout=300)
    assert not t.is_alive() and "error" not in result, result.get("error")
    _equal(m, opt, m2, opt2)
    read = client._transport.storage().read_bytes
    assert read["stream"] > 0                 # the rest came through the stream
    assert check_health("unix:" + d2.socket) == "SERVING"
    client.close()


@pytest.mark.slow
def test_tight_budget_smaller_window_and_an_oversize_chunk_streams(daemons: Daemons):
    """The budget cannot give the window the reader wants (twice its 36 MB chunk): the client
    takes a 32 MiB one instead; the chunk larger than that is streamed, the rest comes
    through shared memory, and the load is bit-exact."""
    port = free_port()
    d = daemons.start(staging_bytes="80MiB", extra_args=("--metrics-port", str(port)))
    torch.manual_seed(11)
    m = torch.nn.Sequential(torch.nn.Linear(3000, 3000), torch.nn.Linear(3000, 8))
    client = CheckpointClient("tight", daemon=d.address)
    client.save(m, step=1)                    # its ~37 MB segment stays with the client
    m2 = torch.nn.Sequential(torch.nn.Linear(3000, 3000), torch.nn.Linear(3000, 8))
    client.load(m2)
    for a, b in zip(m.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    read = client._transport.storage().read_bytes
    big = 3000 * 3000 * 4
    assert read["stream"] >= big and 0 < read["shared_memory"] < big
    client.close()
    _wait(lambda: _metric(port, "ckptd_staging_bytes_in_use") == 0, "budget back", d.log)
