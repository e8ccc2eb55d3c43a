"""Helpers of the daemon tests: real `ckptd serve` subprocesses, raw gRPC sessions, and the
per-rank functions that multi-process tests run (importable from spawned ranks)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "integration"))

import test_torch_fsdp as fsdp
from test_torch_fsdp import assert_equal_state

from ckptd.daemon.testing import DaemonProcess, start_daemon
from ckptd.v1 import ckptd_pb2 as pb
from ckptd.v1 import ckptd_pb2_grpc as pb_grpc


class Daemons:
    """Starts daemons for one test (short socket paths under /tmp) and kills them after."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.run_dir = tempfile.mkdtemp(prefix="ckd-", dir="/tmp")
        self.procs: list[DaemonProcess] = []
        self.n = 0

    def socket_path(self, name: str | None = None) -> str:
        if name is None:
            self.n += 1
            name = f"d{self.n}"
        return os.path.join(self.run_dir, name, "ckptd.sock")

    def start(self, *, storage: str | None = None, socket_path: str | None = None,
              staging_bytes: str = "256MiB", env: dict[str, str] | None = None,
              extra_args: tuple[str, ...] = ()) -> DaemonProcess:
        sock = socket_path or self.socket_path()
        log_path = os.path.join(self.root, f"daemon-{len(self.procs)}.log")
        d = start_daemon(storage or f"file://{self.root}/store", sock,
                         staging_bytes=staging_bytes, env=env, extra_args=extra_args,
                         log_path=log_path, write_concurrency=4)
        self.procs.append(d)
        return d

    def close(self) -> None:
        for d in self.procs:
            if d.alive():
                d.kill()
        shutil.rmtree(self.run_dir, ignore_errors=True)


@dataclass
class RawSession:
    stub: Any
    channel: grpc.Channel
    session: Any
    conn: socket.socket | None

    def fetch(self, segment_id: str) -> tuple[dict, list[int]]:
        assert self.conn is not None
        self.conn.send(json.dumps({"fetch": segment_id}).encode())
        msg, fds, _, _ = socket.recv_fds(self.conn, 4096, 1)
        return json.loads(msg), fds

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.channel.close()


def raw_channel(socket_path: str) -> tuple[grpc.Channel, Any]:
    channel = grpc.insecure_channel("unix:" + socket_path)
    return channel, pb_grpc.CheckpointServiceStub(channel)


@contextmanager
def raw_session(socket_path: str, job: str = "raw", rank: int = 0,
                world_size: int = 1) -> Iterator[RawSession]:
    channel, stub = raw_channel(socket_path)
    resp = stub.RegisterRank(pb.RegisterRankRequest(job=job, rank=rank, world_size=world_size),
                             timeout=10)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.settimeout(10)
    conn.connect(resp.fd_socket)
    conn.send(json.dumps({"session": resp.session_id,
                          "secret": resp.session_secret.hex()}).encode())
    assert json.loads(conn.recv(4096))["ok"]
    s = RawSession(stub, channel, resp, conn)
    try:
        yield s
    finally:
        s.close()


def error_class(err: grpc.RpcError) -> str:
    return dict(err.trailing_metadata() or ()).get("ckptd-error-class", "")


# -- rank functions (run by tests.distributed.run_world) -----------------------------------
def save_rank(rank: int, world: int, root: str, job: str, addresses: list[str], step: int) -> None:
    """Train FSDP2 a little, save ``step`` through daemon ``addresses[rank % n]``."""
    from ckptd_client import CheckpointClient

    model, opt = fsdp.build("fsdp2", world, seed=1)
    fsdp.train(model, opt, 3, rank)
    expected = fsdp.full_state(model, opt)
    client = CheckpointClient(job, daemon=addresses[rank % len(addresses)], pack_threshold=96)
    info = client.save_async(model, optimizer=opt, step=step, extra={"world": world}).result(120)
    assert info.step == step and info.world_size == world
    if rank == 0:
        torch.save(expected, os.path.join(root, f"{job}.expected.pt"))
    client.close()


def load_rank(rank: int, world: int, root: str, jobs: list[str], sources: list[str]) -> None:
    """Load every job at this world size from each source (a daemon address or 'file://')."""
    from ckptd_client import CheckpointClient

    for job in jobs:
        want = torch.load(os.path.join(root, f"{job}.expected.pt"), weights_only=True)
        for src in sources:
            model, opt = fsdp.build("fsdp2", world, seed=2)
            if src.startswith("file://"):
                client = CheckpointClient(job, storage=src)
            else:
                client = CheckpointClient(job, daemon=src)
            info = client.load(model, optimizer=opt)
            assert info.extra == {"world": 2}
            assert_equal_state(fsdp.full_state(model, opt), want, f"{job} via {src} rank {rank}")
            fsdp.train(model, opt, 1, rank)
            client.close()
    dist.barrier()


def daemon_crash_rank(rank: int, world: int, root: str, sock: str, gate: str,
                      log_dir: str) -> None:
    """Save step 1; kill the daemon while step 2 is handed over but not written; restart it;
    save step 3 with the same client; check what committed and that step 1 loads."""
    from ckptd_client import CheckpointClient

    from ckptd.errors import DaemonUnavailableError
    from ckptd.format.commit import committed_steps
    from ckptd.storage import open_storage

    store = f"file://{root}/store"
    job = "crash"
    daemon = None
    if rank == 0:
        open(gate, "w").close()
        daemon = start_daemon(store, sock, staging_bytes="256MiB",
                              env={"CKPTD_TEST_WRITE_GATE": gate},
                              log_path=os.path.join(log_dir, "daemon-a.log"))
    try:
        dist.barrier()
        model, opt = fsdp.build("fsdp2", world, seed=1)
        fsdp.train(model, opt, 2, rank)
        expected1 = fsdp.full_state(model, opt)
        client = CheckpointClient(job, daemon="unix://" + sock)
        client.save_async(model, optimizer=opt, step=1).result(60)
        fsdp.train(model, opt, 1, rank)
        if rank == 0:
            os.unlink(gate)  # the daemon now holds every write before it starts
        dist.barrier()
        h2 = client.save_async(model, optimizer=opt, step=2)  # returns: the daemon has it
        dist.barrier()
        if rank == 0:
            assert daemon is not None
            daemon.kill()  # SIGKILL mid-save
        dist.barrier()
        try:
            h2.result(60)
        except DaemonUnavailableError as exc:
            assert "will not commit" in str(exc) and "step 2" in str(exc), str(exc)
        else:
            raise AssertionError("step 2 must fail when the daemon dies before writing it")
        if rank == 0:
            open(gate, "w").close()
            daemon = start_daemon(store, sock, staging_bytes="256MiB",
                                  env={"CKPTD_TEST_WRITE_GATE": gate},
                                  log_path=os.path.join(log_dir, "daemon-b.log"))
        dist.barrier()
        fsdp.train(model, opt, 1, rank)
        info = client.save_async(model, optimizer=opt, step=3).result(60)  # reconnects
        assert info.step == 3
        dist.barrier()
        if rank == 0:
            assert committed_steps(open_storage(store), job) == [1, 3]
        model1, opt1 = fsdp.build("fsdp2", world, seed=5)
        client.load(model1, optimizer=opt1, step=1)
        assert_equal_state(fsdp.full_state(model1, opt1), expected1, f"step 1 rank {rank}")
        client.close()
        dist.barrier()
    finally:
        if daemon is not None:
            daemon.stop()


def backpressure_ranks_rank(rank: int, world: int, root: str, address: str) -> None:
    """Rank 1 alone has no free staging (it holds both of its segments, or the embedded
    buffer): with 'skip' every rank skips that step, with 'error' every rank raises; the
    rank that had room does not hand over a step that could never commit."""
    from ckptd_client import CheckpointClient

    from ckptd.errors import BackpressureError
    from ckptd.format.commit import committed_steps
    from ckptd.storage import open_storage

    torch.manual_seed(0)
    m = torch.nn.Linear(64, 64)
    store = f"file://{root}/store"
    for mode in ("daemon", "embedded"):
        job = f"bp-ranks-{mode}"
        where = {"daemon": address} if mode == "daemon" else {"storage": store}
        c = CheckpointClient(job, backpressure="skip", commit_timeout=30, **where)
        held = []
        if rank == 1:
            for _ in range(2 if mode == "daemon" else 1):
                held.append(c._transport.acquire(1 << 16, block=False))
            assert all(held)
        h = c.save_async(m, step=1)
        assert h.result(60).skipped, f"{mode} rank {rank}: step 1 must be skipped everywhere"
        assert c.stats["skipped"] == 1
        c.backpressure = "error"
        try:
            c.save_async(m, step=2)
            raise AssertionError(f"{mode} rank {rank}: step 2 must raise on every rank")
        except BackpressureError:
            pass
        for lease in held:
            lease.release()
        c.backpressure = "skip"
        assert not c.save_async(m, step=3).result(60).skipped
        dist.barrier()
        assert committed_steps(open_storage(store), job) == [3]
        m2 = torch.nn.Linear(64, 64)
        assert c.load(m2).step == 3
        assert torch.equal(m2.weight, m.weight) and torch.equal(m2.bias, m.bias)
        c.close()
