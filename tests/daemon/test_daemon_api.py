"""One process, one real daemon: the client API through the daemon (copy and overlap mode,
extra state, list/load), backpressure policies, metrics and structured logs, and requests
that must be rejected -- after which the daemon still serves."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import urllib.request

import grpc
import pytest
import torch
from ckptd_client import CheckpointClient
from daemon_helpers import Daemons, error_class, raw_channel, raw_session
from distributed import free_port

from ckptd.daemon.cli import check_health
from ckptd.errors import BackpressureError, ConfigError, StagingError
from ckptd.format.commit import committed_steps
from ckptd.format.manifest import ArrayRecord, ChunkRecord
from ckptd.format.plan import ArrayMeta, ObjectWrite, RankPlan
from ckptd.storage import open_storage
from ckptd.v1 import ckptd_pb2 as pb


class Mixed(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.big = torch.nn.Parameter(torch.randn(700, 300, generator=g))  # > pack threshold
        self.bf16 = torch.nn.Parameter(torch.randn(33, 5, generator=g).bfloat16())
        self.register_buffer("i64", torch.randint(-2**40, 2**40, (6,), generator=g))
        self.register_buffer("mask", torch.rand(11, generator=g) > 0.5)


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    (m.big.sum() + m.bf16.float().pow(2).sum()).backward()
    opt.step()
    opt.zero_grad()


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared")
    ds = Daemons(str(root))
    port = free_port()
    d = ds.start(extra_args=("--metrics-port", str(port), "--log-format", "json"),
                 staging_bytes="64MiB")
    d.metrics_port = port  # type: ignore[attr-defined]
    d.root = str(root)  # type: ignore[attr-defined]
    yield d
    ds.close()


def test_save_list_load_through_daemon(shared):
    m, opt = Mixed(), None
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    _train(m, opt)
    client = CheckpointClient("api", daemon=shared.address)
    h1 = client.save_async(m, optimizer=opt, step=10, extra={"lr": 1e-3, "t": torch.arange(3)})
    # copy mode: save_async returned after the daemon acknowledged the handoff
    assert "checkpoint staged: job api step 10" in shared.log()
    h1.wait_staged()
    snapshot = {k: v.clone() for k, v in m.state_dict().items()}
    _train(m, opt)  # changing the parameters now does not change the save
    assert h1.result(60).step == 10 and h1.done() and h1.exception() is None
    client.save(m, optimizer=opt, step=20, extra={"lr": 5e-4})
    assert client.list_steps() == [10, 20]

    m2 = Mixed(seed=9)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-3)
    info = client.load(m2, optimizer=opt2, step=10)
    assert info.step == 10 and info.extra["lr"] == 1e-3
    assert torch.equal(info.extra["t"], torch.arange(3))
    for k, v in snapshot.items():
        assert torch.equal(m2.state_dict()[k], v), k
    # the same checkpoint read from storage directly (embedded mode) is identical
    m3 = Mixed(seed=8)
    opt3 = torch.optim.AdamW(m3.parameters(), lr=1e-3)
    CheckpointClient("api", storage=f"file://{shared.root}/store").load(m3, optimizer=opt3)
    m4 = Mixed(seed=7)
    opt4 = torch.optim.AdamW(m4.parameters(), lr=1e-3)
    assert client.load(m4, optimizer=opt4).step == 20
    _equal(m3, m4)
    assert opt3.state_dict()["state"].keys() == opt4.state_dict()["state"].keys()
    # extra state too large for one message to the daemon: refused saying what to do, and
    # the client (its segment) goes on saving
    with pytest.raises(ConfigError, match="more than the 63 MiB.*as tensors"):
        client.save(m, step=30, extra={"log": "x" * (64 << 20)})
    assert client.save(m, optimizer=opt, step=31).step == 31
    client.close()


def test_cached_plans_a_changed_or_tampered_plan_is_checked_again(shared):
    """The client reuses its encoded plan and the daemon its check of those bytes; a plan
    that differs from the cached one is checked in full (a bad one after good ones is
    rejected), and a changed model gets a new plan that the daemon accepts."""
    client = CheckpointClient("plancache", daemon=shared.address)
    m = torch.nn.Linear(64, 32)
    for step in (1, 2):
        client.save(m, step=step, timeout=60)
    transport = client._transport
    good = transport._encoded_plan
    doc = json.loads(good(client._last_plan[1]))
    doc["writes"][0][1] = 1 << 40          # a write far outside the segment

    transport._encoded_plan = lambda plan: json.dumps(doc).encode()
    with pytest.raises(StagingError, match="outside"):
        client.save(m, step=3, timeout=60)
    transport._encoded_plan = good
    assert client.save(m, step=4, timeout=60).step == 4  # the good plan still works

    bigger = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 8))
    assert client.save(bigger, step=5, timeout=60).step == 5  # a new plan
    back = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 8))
    client.load(back, step=5)
    _equal(bigger, back)
    assert client.list_steps() == [1, 2, 4, 5]
    client.close()


def test_overlap_mode_returns_before_staging_and_step_waits(shared, monkeypatch):
    """save_async(overlap=True) returns while the copy is still pending; the next
    optimizer.step() waits for it -- proven by ordering, not timing."""
    import ckptd_client.client as client_mod

    order: list[str] = []
    step_called = threading.Event()
    real_stage = client_mod.stage

    def gated_stage(*args, **kwargs):
        assert step_called.wait(60), "optimizer.step() was never called"
        real_stage(*args, **kwargs)
        order.append("staged")

    monkeypatch.setattr(client_mod, "stage", gated_stage)
    m = Mixed()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    _train(m, opt)
    before = {k: v.clone() for k, v in m.state_dict().items()}

    def first_pre_hook(*_a):
        order.append("step-called")
        step_called.set()

    opt.register_step_pre_hook(first_pre_hook)  # registered before ckptd's hook: runs first
    opt.register_step_post_hook(lambda *_a: order.append("step-done"))
    client = CheckpointClient("overlap", daemon=shared.address)
    handle = client.save_async(m, optimizer=opt, step=1, overlap=True)
    # staging cannot have happened: it waits for step_called, which only step() sets
    assert order == [] and not handle.done()
    (m.big.sum() * 3).backward()   # "forward/backward" runs while the copy is pending
    opt.step()
    assert order == ["step-called", "staged", "step-done"]
    handle.wait_staged()
    assert handle.result(60).step == 1
    m2 = Mixed(seed=3)
    client.load(m2, step=1, strict=False)
    for k, v in before.items():   # the pre-step values were saved, not the updated ones
        assert torch.equal(m2.state_dict()[k], v), k
    assert not torch.equal(m.big, before["big"])
    client.close()


def test_metrics_and_json_state_logs(shared):
    client = CheckpointClient("metrics", daemon=shared.address)
    m = torch.nn.Linear(8, 8)
    client.save(m, step=3)
    client.close()
    body = urllib.request.urlopen(f"http://127.0.0.1:{shared.metrics_port}/metrics",
                                  timeout=10).read().decode()
    for name in ("ckptd_bytes_staged_total", "ckptd_bytes_written_total",
                 "ckptd_save_latency_seconds_bucket", "ckptd_queue_depth",
                 "ckptd_save_failures_total", "ckptd_staging_bytes_in_use"):
        assert name in body, name
    states = []
    for line in shared.log().splitlines():
        doc = json.loads(line)  # every line is one JSON object
        if doc.get("event") == "checkpoint" and doc.get("job") == "metrics":
            states.append(doc["state"])
            assert doc["step"] == 3 and doc["rank"] == 0
    assert states == ["staged", "written", "committed"]


def _bad_plan(size: int, key: str = "a/c/0", offset: int | None = None) -> bytes:
    plan = RankPlan(
        nbytes=64,
        writes=[ObjectWrite(key, size - 8 if offset is None else offset, 64, 0, "a", "0")],
        array_meta={"a": ArrayMeta((16,), "float32", (16,))},
        arrays={"a": ArrayRecord((16,), "float32", (16,), {"0": ChunkRecord(64, 0)})})
    return json.dumps(plan.to_json()).encode()


def _ident(job: str = "raw", step: int = 1) -> pb.SaveIdentity:
    return pb.SaveIdentity(job=job, step=step, attempt="a1", rank=0, world_size=1,
                           framework="plain")


def _code(call, *args, **kwargs) -> tuple[grpc.StatusCode, str, str]:
    with pytest.raises(grpc.RpcError) as ei:
        r = call(*args, **kwargs)
        if hasattr(r, "__iter__") and not isinstance(r, (bytes, str)):
            list(r)
    return ei.value.code(), error_class(ei.value), ei.value.details()


def test_bad_requests_are_rejected_and_daemon_keeps_serving(shared):
    channel, stub = raw_channel(shared.socket)
    # job names that escape their directory, ranks outside the world
    code, cls, msg = _code(stub.RegisterRank, pb.RegisterRankRequest(
        job="../etc", rank=0, world_size=1), timeout=10)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and cls == "ConfigError" and "job" in msg
    code, cls, _ = _code(stub.RegisterRank, pb.RegisterRankRequest(
        job="ok", rank=3, world_size=2), timeout=10)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _, _ = _code(stub.ListSteps, pb.ListStepsRequest(job="a/../../b"), timeout=10)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # reading another job's keys, or escaping the job
    for key in ("other/000000000001/COMMITTED", "raw/../other/x", "/etc/passwd"):
        code, _, _ = _code(stub.ReadObject, pb.ReadObjectRequest(job="raw", key=key), timeout=10)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, key
    code, cls, _ = _code(stub.StatObject, pb.StatObjectRequest(job="..", key="../x"), timeout=10)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and cls == "ConfigError"

    with raw_session(shared.socket) as s:
        sid = s.session.session_id
        # a segment larger than the whole budget can never be granted
        code, cls, msg = _code(s.stub.AcquireStaging, pb.AcquireStagingRequest(
            session_id=sid, nbytes=1 << 40, transfer=pb.TRANSFER_SHARED_MEMORY), timeout=10)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and cls == "StagingError"
        assert "never fit" in msg
        seg = s.stub.AcquireStaging(pb.AcquireStagingRequest(
            session_id=sid, nbytes=1000, transfer=pb.TRANSFER_SHARED_MEMORY), timeout=10)
        reply, fds = s.fetch(seg.segment_id)
        assert reply["ok"] and reply["size"] == seg.size and len(fds) == 1
        fd = fds[0]
        # the segment is sealed: the client can neither shrink nor grow it (no SIGBUS)
        assert os.fstat(fd).st_size == seg.size
        for new_size in (0, seg.size * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, new_size)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        os.close(fd)
        # a second fetch of the same segment is refused
        reply, fds = s.fetch(seg.segment_id)
        assert not reply["ok"] and fds == []

        def save(**kw):
            req = {"session_id": sid, "segment_id": seg.segment_id, "identity": _ident(),
                   "plan_json": _bad_plan(seg.size), "extra_json": b"null",
                   "param_groups_json": b"[]"}
            req.update(kw)
            return _code(s.stub.Save, pb.SaveRequest(**req), timeout=10)

        # a plan whose write points outside its segment
        code, cls, msg = save()
        assert code == grpc.StatusCode.INVALID_ARGUMENT and cls == "StagingError", msg
        assert "outside" in msg
        code, _, msg = save(plan_json=_bad_plan(seg.size, offset=-64))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, msg
        # unsafe keys, malformed plans and JSON
        code, _, msg = save(plan_json=_bad_plan(seg.size, key="../../etc/x", offset=0))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "safe" in msg
        code, _, _ = save(plan_json=b"{not json")
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        code, _, _ = save(plan_json=json.dumps({"nbytes": "x"}).encode())
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        code, _, _ = save(plan_json=_bad_plan(seg.size, offset=0), param_groups_json=b"{}")
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        # identity: a job with '../', another job than the session's, rank outside the world
        code, cls, _ = save(identity=_ident(job="../x"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and cls == "ConfigError"
        code, _, msg = save(identity=_ident(job="other"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "session" in msg
        code, _, _ = save(identity=pb.SaveIdentity(job="raw", step=1, attempt="a", rank=5,
                                                   world_size=1, framework="plain"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        # a segment that is not this session's
        code, _, _ = save(segment_id="nope")
        assert code == grpc.StatusCode.NOT_FOUND
        # an oversized request (over the 64 MiB message limit)
        code, _, msg = save(plan_json=b" " * (65 << 20))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, msg
        # an unknown session
        code, _, _ = _code(s.stub.AcquireStaging, pb.AcquireStagingRequest(
            session_id="0" * 32, nbytes=10, transfer=pb.TRANSFER_SHARED_MEMORY), timeout=10)
        assert code == grpc.StatusCode.NOT_FOUND

    # garbage on the fd socket, and connections that hang up at once
    for payload in (b"\xff\x00garbage", b"[]", json.dumps({"session": "x", "secret": "zz"}).encode(),
                    b""):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        c.settimeout(10)
        c.connect(shared.socket + ".fds")
        if payload:
            c.send(payload)
            assert not json.loads(c.recv(4096))["ok"]
        c.close()
    channel.close()

    # still serving: health, and a valid save and load right after
    assert check_health("unix:" + shared.socket) == "SERVING"
    client = CheckpointClient("after-bad", daemon=shared.address)
    m = torch.nn.Linear(16, 4)
    assert client.save(m, step=1, timeout=60).step == 1
    m2 = torch.nn.Linear(16, 4)
    client.load(m2)
    assert torch.equal(m.weight, m2.weight)
    with pytest.raises(ConfigError):
        client._transport.storage().get("other-job/x")  # a client reads only its job
    client.close()


def test_backpressure_block_skip_error(tmp_path, daemons: Daemons):
    root = str(tmp_path)
    gate = os.path.join(root, "gate")     # absent: the daemon holds writes
    d = daemons.start(staging_bytes="1MiB", env={"CKPTD_TEST_WRITE_GATE": gate})
    store = open_storage(f"file://{root}/store")
    m = torch.nn.Linear(32, 32)

    def manifest_written(job: str, step: int) -> bool:
        return any(k.endswith("_ranks/0.json") for k in store.list_files(f"{job}/{step:012d}"))

    # skip: the previous save owns the only segment the budget allows -> counted and logged
    c = CheckpointClient("bp-skip", daemon=d.address, backpressure="skip")
    h1 = c.save_async(m, step=1)
    h2 = c.save_async(m, step=2)
    assert h2.done() and h2.result().skipped and c.stats["skipped"] == 1
    open(gate, "w").close()
    assert h1.result(60).step == 1
    c.close()
    os.unlink(gate)

    # error: BackpressureError with the reason
    c = CheckpointClient("bp-error", daemon=d.address, backpressure="error")
    h1 = c.save_async(m, step=1)
    with pytest.raises(BackpressureError, match="still being written"):
        c.save_async(m, step=2)
    open(gate, "w").close()
    h1.result(60)
    c.close()
    os.unlink(gate)

    # block (default): the next save starts staging only after the previous one's bytes
    # are durable (its manifest exists when save_async returns)
    c = CheckpointClient("bp-block", daemon=d.address)
    h1 = c.save_async(m, step=1)
    assert not manifest_written("bp-block", 1)
    opener = threading.Timer(0.5, lambda: open(gate, "w").close())
    opener.start()
    h2 = c.save_async(m, step=2)
    assert manifest_written("bp-block", 1)
    assert h1.result(60).step == 1 and h2.result(60).step == 2
    opener.join()
    c.close()
    assert committed_steps(store, "bp-block") == [1, 2]
    assert committed_steps(store, "bp-skip") == [1]
    with pytest.raises(StagingError, match="never fit"):
        CheckpointClient("too-big", daemon=d.address).save(torch.nn.Linear(1024, 1024), step=1)
    assert check_health("unix:" + d.socket) == "SERVING"


def test_retention_after_commit(tmp_path, daemons: Daemons):
    d = daemons.start(extra_args=("--keep-last", "2", "--keep-every", "10"))
    client = CheckpointClient("keep", daemon=d.address)
    m = torch.nn.Linear(8, 8)
    for step in (10, 11, 12, 13, 14):
        client.save(m, step=step, timeout=60)
    store = open_storage(f"file://{tmp_path}/store")
    for _ in range(600):   # retention runs on the daemon after each commit
        if committed_steps(store, "keep") == [10, 13, 14]:
            break
        threading.Event().wait(0.05)
    assert committed_steps(store, "keep") == [10, 13, 14], d.log()
    assert "retention applied" in d.log()
    # the job rolls back to step 10 and saves step 11 again: the retention after that commit
    # keeps it, although steps 13 and 14 (of the abandoned run) have higher numbers
    client.load(m, step=10)
    client.save(m, step=11, timeout=60)
    client.close()
    for _ in range(600):
        if d.log().count("retention applied to job keep after step 11") == 2:
            break
        threading.Event().wait(0.05)
    assert d.log().count("retention applied to job keep after step 11") == 2, d.log()
    assert committed_steps(store, "keep") == [10, 11, 13, 14], d.log()


def test_a_budget_too_small_for_one_segment_per_rank_of_the_job_fails_instead_of_waiting(
        daemons: Daemons):
    """Clients keep their segment for reuse: when rank 0's segment leaves no room for rank
    1's on this node, rank 1 could never stage (it waited forever under 'block', skipped every
    step under 'skip'); another job's rank may still wait for room."""
    from ckptd_client.transport.daemon import DaemonTransport

    d = daemons.start(staging_bytes="64MiB")
    t0, t1, other = (DaemonTransport(d.address, job=j, rank=r, world_size=2)
                     for j, r in (("tight", 0), ("tight", 1), ("other", 0)))
    try:
        lease = t0.acquire(40 << 20, block=False)
        assert lease is not None
        for block in (False, True):
            with pytest.raises(StagingError, match=r"rank 1 of job 'tight' needs a \d+-byte "
                               r"staging segment, and ranks \[0\] of the job on this node keep "
                               r".*staging-bytes"):
                t1.acquire(40 << 20, block=block)
        assert other.acquire(40 << 20, block=False) is None  # busy: it may wait for room
        lease.release()
        t0.close()
        for _ in range(200):  # the daemon closes rank 0's session once it sees the client go
            try:
                assert t1.acquire(40 << 20, block=False) is not None
                break
            except StagingError:
                threading.Event().wait(0.05)
        else:
            raise AssertionError("rank 1 could not stage after rank 0's client closed")
    finally:
        for t in (t0, t1, other):
            t.close()


def test_socket_directory_and_socket_modes(daemons: Daemons):
    """Created under a restrictive umask inside a 0750 (setgid, socket group) directory."""
    import stat

    gid = os.getgid()
    d = daemons.start(extra_args=("--socket-group", str(gid)))
    st = os.stat(os.path.dirname(d.socket))
    assert stat.S_IMODE(st.st_mode) == 0o2750 and st.st_gid == gid
    for path in (d.socket, d.socket + ".fds"):
        sst = os.stat(path)
        assert stat.S_ISSOCK(sst.st_mode) and stat.S_IMODE(sst.st_mode) == 0o660, oct(sst.st_mode)
        assert sst.st_gid == gid
    # a second daemon on the same socket is refused while the first serves (the daemon itself
    # refuses too, not only the helper)
    with pytest.raises(Exception, match="already serving"):
        daemons.start(socket_path=d.socket)
    second = subprocess.run(
        [sys.executable, "-m", "ckptd.cli", "serve", "--storage", f"file://{d.log_path}.x",
         "--socket", d.socket, "--metrics-port", "0"], capture_output=True, text=True, timeout=60,
        check=False)
    assert second.returncode == 2 and "already serving" in second.stderr
    assert check_health("unix:" + d.socket) == "SERVING"


def test_address_typos_and_a_missing_socket_say_what_to_do(tmp_path):
    from ckptd_client.transport.daemon import DaemonTransport, parse_address

    from ckptd.errors import DaemonUnavailableError

    for bad in ("http://host:7000", "host:7000/x", "tcp://", "unix://relative/x.sock", "host"):
        with pytest.raises(ConfigError, match="expected unix:///"):
            parse_address(bad)
    assert parse_address("tcp://h:7000") == ("tcp", "h:7000")
    sock = f"{tmp_path}/run/ckptd.sock"
    with pytest.raises(DaemonUnavailableError, match=f"no ckptd daemon socket at {sock}.*"
                                                     f"ckptd serve --socket {sock}"):
        DaemonTransport("unix://" + sock, job="j", rank=0, world_size=1, connect_timeout=0.5)
