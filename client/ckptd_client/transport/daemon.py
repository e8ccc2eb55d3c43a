"""Daemon transport: the node's ``ckptd serve`` writes this rank's shards.

Local daemon (``unix:///run/ckptd/ckptd.sock``): shared-memory staging.  The client
registers its rank (RegisterRank), attaches the session's fd connection (``<socket>.fds``;
it stays open for the client's lifetime and is how the daemon notices a dead client),
and acquires a segment (AcquireStaging): a sealed memfd the daemon created, received with
SCM_RIGHTS, mapped here once (pre-faulted with MAP_POPULATE, page-locked with
cudaHostRegister on CUDA hosts) and reused for every later save.  ``save_async`` copies the
shards into it and calls Save, which returns once the daemon owns the bytes; the segment
comes back (``segment_returned``) when the rank's chunks are durable.  At most two segments
per client (double buffering); when both are lent, ``acquire(block=False)`` reports busy
unless the node's budget gives another one.

Remote daemon (``host:port``, TLS + bearer token): the staged bytes, in a reused local
buffer, are streamed (SaveStream) into a daemon-side buffer charged to the same budget.

Every save is followed by a WatchSave stream on a background thread that resolves its
future (committed, or the daemon's typed error).  If the daemon dies before the rank's bytes
are durable the future fails with DaemonUnavailableError and the next save re-registers
with the restarted daemon.  ``storage()`` is a read-only proxy: loads read through the
daemon (which owns the storage credentials), restricted to this job's keys; on the daemon's
node the daemon reads checkpoint chunks straight into a shared-memory read segment
(ReadIntoSegment, :mod:`ckptd_client.transport.shmread`), remote clients stream them.

Threads: ``acquire``/``submit``/``close`` from the training thread (or the client's overlap
staging thread); watch threads only release leases and resolve futures.
"""

from __future__ import annotations

import fcntl
import json
import logging
import mmap
import os
import queue
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import grpc
import tenacity
import torch

from ckptd.daemon.config import STREAM_CHUNK_BYTES
from ckptd.daemon.rpcerrors import (
    REASON_BUSY,
    REASON_SESSION_UNKNOWN,
    error_from_rpc,
    reason_of,
)
from ckptd.errors import (
    AuthenticationError,
    CkptdError,
    ConfigError,
    DaemonUnavailableError,
    StagingError,
    StoragePermissionError,
)
from ckptd.format.plan import RankPlan
from ckptd.format.reader import ReadWindow
from ckptd.format.writer import SaveIdentity
from ckptd.storage.base import Buffer, StorageBackend
from ckptd.v1 import ckptd_pb2 as pb
from ckptd.v1 import ckptd_pb2_grpc as pb_grpc
from ckptd_client.staging import StagingBuffer
from ckptd_client.transport.base import Lease, Transport
from ckptd_client.transport.shmread import READ_TIMEOUT, SMALL_WINDOW, SegmentWindow

log = logging.getLogger("ckptd.client")

MAX_SEGMENTS = 2
CONNECT_TIMEOUT = 30.0
CALL_TIMEOUT = 60.0
MAX_MESSAGE = 64 << 20
STREAM_READ_ATTEMPTS = 4   # ReadObject calls whose connection broke are tried again
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class _Busy(Exception):
    """The daemon's staging budget is in use (wait=False)."""


def parse_address(address: str) -> tuple[str, str]:
    """``("unix", "/path")`` or ``("tcp", "host:port")``."""
    if not isinstance(address, str) or not address.strip():
        raise ConfigError(f"daemon address must be a non-empty string, got {address!r}")
    a = address.strip()
    if a.startswith("unix:"):
        path = a[len("unix:"):]
        path = path.removeprefix("//")
        if not path.startswith("/"):
            raise ConfigError(f"daemon address {address!r}: expected unix:///absolute/path")
        return "unix", path
    for prefix in ("tcp://", "grpcs://", "dns:///"):
        a = a.removeprefix(prefix)
    host, sep, port = a.rpartition(":")
    if not sep or not host or not port.isdigit() or "/" in a:
        raise ConfigError(
            f"daemon address {address!r} is invalid: expected unix:///run/ckptd/ckptd.sock or "
            "HOST:PORT (TCP with TLS)")
    return "tcp", a


def _token(token: str | None) -> str | None:
    if token:
        return token
    if os.environ.get("CKPTD_TOKEN"):
        return os.environ["CKPTD_TOKEN"]
    path = os.environ.get("CKPTD_TOKEN_FILE")
    if path:
        return _read_setting("CKPTD_TOKEN_FILE", path).decode(errors="replace").strip()
    return None


def _read_setting(variable: str, path: str) -> bytes:
    """The file a ``CKPTD_*`` variable names; a ConfigError naming both if unreadable."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{variable}={path} cannot be read ({exc.strerror or exc}); point it "
                          "at a readable file or unset it") from None


def _tcp_problem(target: str, ca_path: str | None, server_name: str | None,
                 timeout: float = 5.0) -> str:
    """Why a TLS connection to ``target`` fails, found with the ssl module (gRPC only says
    that the deadline passed); "" when a handshake succeeds."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    try:
        ctx = ssl.create_default_context(cafile=ca_path)
        ctx.set_alpn_protocols(["h2"])
        with socket.create_connection((host, int(port)), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=server_name or host):
            return ""
    except ssl.SSLCertVerificationError as exc:
        return (f"The daemon's TLS certificate is not accepted here ({exc.verify_message}): "
                "set CKPTD_TLS_CA to the PEM that signed it, and CKPTD_TLS_SERVER_NAME to a "
                "name in it if you connect by another name or address.")
    except ssl.SSLError as exc:
        return (f"The TLS handshake with {target} failed ({exc.reason or exc}): is this the "
                "daemon's --listen port?")
    except (OSError, ValueError) as exc:
        return (f"Nothing accepts TCP connections at {target} ({exc}): is `ckptd serve "
                f"--listen {target}` running there?")


@dataclass(eq=False)
class _Session:
    id: str
    gen: int
    conn: socket.socket | None
    storage_url: str
    budget: int


@dataclass(eq=False)
class _Segment:
    id: str
    size: int
    gen: int
    session_id: str
    mm: mmap.mmap | None
    tensor: torch.Tensor | None
    state: str = "staging"      # idle | staging | lent | dead
    pinned: bool = False


class _SegmentLease(Lease):
    def __init__(self, seg: _Segment, nbytes: int, release: Any) -> None:
        assert seg.tensor is not None
        super().__init__(seg.tensor[:nbytes], release)
        self.seg = seg


class _StreamLease(Lease):
    def __init__(self, buffer: torch.Tensor, reservation: str, session_id: str,
                 release: Any) -> None:
        super().__init__(buffer, release)
        self.reservation = reservation
        self.session_id = session_id
        self.consumed = False


def _pin(seg: _Segment) -> None:
    """Page-lock the mapped segment so device-to-host copies are fast and async (CUDA)."""
    if os.environ.get("CKPTD_PIN_STAGING", "1") == "0" or not torch.cuda.is_available():
        return
    assert seg.tensor is not None
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(seg.tensor.data_ptr(), seg.size, 0)
    if int(getattr(rc, "value", rc)) != 0:
        log.warning("ckptd: cudaHostRegister of a %d-byte staging segment failed (%s); "
                    "copies from the GPU will be slower", seg.size, rc)
        return
    seg.pinned = True


def _unmap(seg: _Segment) -> None:
    if seg.pinned and seg.tensor is not None:
        try:
            torch.cuda.cudart().cudaHostUnregister(seg.tensor.data_ptr())
        except Exception as exc:  # noqa: BLE001 - unmapping must go on
            log.debug("ckptd: cudaHostUnregister failed: %s", exc)
        seg.pinned = False
    seg.tensor = None
    mm, seg.mm = seg.mm, None
    if mm is not None:
        try:
            mm.close()
        except BufferError:
            pass  # a lease view is still referenced; the GC unmaps it


class _ThreadStarter:
    """Starts (daemon) threads on behalf of the training thread, which only enqueues.

    ``threading.Thread.start()`` waits until the new thread has run, which took 1-20 ms
    on this project's busy 2-core machine -- time the training loop would stall for in
    every copy-mode save.  One long-lived starter thread does that waiting instead.
    """

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.threads: set[threading.Thread] = set()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def start(self, target: Any, args: tuple, name: str, on_fail: Any) -> None:
        """Run ``target(*args)`` on a new daemon thread soon; ``on_fail(exc)`` if none can
        be started."""
        self._q.put((target, args, name, on_fail))

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            target, args, name, on_fail = item
            t = threading.Thread(target=target, args=args, name=name, daemon=True)
            with self._lock:
                self.threads = {w for w in self.threads if w.is_alive()} | {t}
            try:
                t.start()
            except BaseException as exc:  # noqa: BLE001 - e.g. "can't start new thread"
                with self._lock:
                    self.threads.discard(t)
                on_fail(exc)

    def close(self) -> list[threading.Thread]:
        """Start what is queued, stop the starter; returns the threads it started."""
        self._q.put(None)
        self._thread.join()
        with self._lock:
            return list(self.threads)


class DaemonTransport(Transport):
    def __init__(self, address: str, *, job: str, rank: int, world_size: int,
                 token: str | None = None, commit_timeout: float | None = 1800.0,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.address = address
        self.job, self.rank, self.world_size = job, rank, world_size
        self.commit_timeout = commit_timeout
        self.connect_timeout = connect_timeout
        kind, target = parse_address(address)
        self.local = kind == "unix"
        options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", MAX_MESSAGE),
                   ("grpc.max_send_message_length", MAX_MESSAGE),
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", 2000),
                   ("grpc.keepalive_time_ms", 30_000)]
        token = _token(token)
        if self.local:
            self._socket_path = target
            sock_dir = os.path.dirname(target)
            if os.path.isdir(sock_dir) and not os.access(sock_dir, os.X_OK):
                raise AuthenticationError(
                    f"this process (uid {os.getuid()}, groups {sorted(os.getgroups())}) may not "
                    f"enter the daemon's socket directory {sock_dir}; add the training user to "
                    "the daemon's socket group (see docs/OPERATIONS.md)")
            self._channel = grpc.insecure_channel("unix:" + target, options)
        else:
            ca = None
            if os.environ.get("CKPTD_TLS_CA"):
                ca = _read_setting("CKPTD_TLS_CA", os.environ["CKPTD_TLS_CA"])
            if os.environ.get("CKPTD_TLS_SERVER_NAME"):
                options.append(("grpc.ssl_target_name_override",
                                os.environ["CKPTD_TLS_SERVER_NAME"]))
            self._channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(ca),
                                                options)
        self._md: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ())
        self._stub = pb_grpc.CheckpointServiceStub(self._channel)
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._fd_lock = threading.Lock()
        self._session: _Session | None = None
        self._gen = 0
        self._segments: list[_Segment] = []
        self._stream_buf = StagingBuffer()
        self._stream_free = threading.Semaphore(1)
        self._closed = False
        self._starter = _ThreadStarter("ckptd-watch-starter")
        self.last_phases: dict[str, float] = {}
        self._plan_json: tuple[RankPlan, bytes] | None = None
        # saves of this rank that cannot commit (not handed over, or lost by a daemon that
        # died before they were durable) and are not yet recorded as failed: the daemon of
        # this rank's live session, else the next one it registers with, records them
        # (AbandonSave), so the ranks of other nodes stop waiting for a commit that cannot
        # happen (see abandon)
        self._lost: list[tuple[SaveIdentity, str]] = []
        with self._lock:
            try:
                session = self._ensure_session()
            except DaemonUnavailableError as exc:
                if self.local and not os.path.exists(target):
                    self._channel.close()
                    self._starter.close()
                    raise DaemonUnavailableError(
                        f"no ckptd daemon socket at {target} (waited {connect_timeout:.0f}s "
                        f"for it): start `ckptd serve --socket {target}` on this node, or pass "
                        "the socket it serves on as daemon='unix:///path/to/ckptd.sock'"
                    ) from exc
                hint = "" if self.local else _tcp_problem(
                    target, os.environ.get("CKPTD_TLS_CA") or None,
                    os.environ.get("CKPTD_TLS_SERVER_NAME") or None)
                if hint:
                    self._channel.close()
                    self._starter.close()
                    raise DaemonUnavailableError(f"{exc} {hint}") from exc
                raise
        self.url = session.storage_url
        self._storage = DaemonStorage(self)

    # -- calls ---------------------------------------------------------------------------
    def _call(self, method: str, request: Any, timeout: float | None,
              wait_for_ready: bool = False) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=timeout, metadata=self._md,
                                               wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            reason = reason_of(exc)
            if reason == REASON_BUSY:
                raise _Busy() from exc
            if reason == REASON_SESSION_UNKNOWN or exc.code() in (  # type: ignore[attr-defined]
                    grpc.StatusCode.UNAVAILABLE,):
                self._forget_session()
            raise error_from_rpc(exc, self.address) from None

    # -- session -------------------------------------------------------------------------
    def _session_alive(self, s: _Session) -> bool:
        if s.conn is None:
            return True
        try:
            readable, _, _ = select.select([s.conn], [], [], 0)
            if not readable:
                return True  # nothing to read: the daemon has not closed it
            return bool(s.conn.recv(1, socket.MSG_PEEK))
        except (OSError, ValueError):
            return False

    def _forget_session(self) -> None:
        with self._lock:
            s, self._session = self._session, None
            if s is not None and s.conn is not None:
                s.conn.close()
            for seg in self._segments:
                if seg.state == "idle":
                    seg.state = "dead"
                    _unmap(seg)
            self._segments = [g for g in self._segments if g.state != "dead"]
            self._cond.notify_all()

    def _ensure_session(self) -> _Session:
        """The live session, registering (again) if there is none or the daemon restarted.
        Called with ``self._lock`` held."""
        if self._closed:
            raise DaemonUnavailableError("this CheckpointClient was closed")
        s = self._session
        if s is not None and self._session_alive(s):
            if self._lost:  # the watch saw the loss after this session was registered
                self._report_lost(s)
            return s
        if s is not None:
            log.warning("ckptd: the daemon at %s restarted or closed this rank's session; "
                        "registering again", self.address)
            self._forget_session()
        resp = self._call("RegisterRank", pb.RegisterRankRequest(
            job=self.job, rank=self.rank, world_size=self.world_size, pid=os.getpid(),
            hostname=socket.gethostname()), timeout=self.connect_timeout, wait_for_ready=True)
        conn = None
        if self.local:
            conn = self._attach(resp)
        self._gen += 1
        self._session = _Session(resp.session_id, self._gen, conn, resp.storage_url,
                                 resp.staging_budget_bytes)
        if self._lost:
            self._report_lost(self._session)
        return self._session

    def _report_lost(self, s: _Session) -> None:
        """Record the saves a previous daemon lost as failed (``_lost``), through the
        daemon of session ``s``; called with the lock held."""
        lost, self._lost = self._lost, []
        for ident, error in lost:
            try:
                self._send_abandon(s.id, ident, error)
            except DaemonUnavailableError:
                self._lost.append((ident, error))  # gone again: tell the next one
            except Exception as exc:  # noqa: BLE001 - best effort, see abandon()
                log.warning("ckptd: could not record that step %d (rank %d) failed; the "
                            "other ranks wait for their commit timeout: %s", ident.step,
                            ident.rank, exc)

    def _attach(self, resp: pb.RegisterRankResponse) -> socket.socket:
        path = resp.fd_socket or self._socket_path + ".fds"
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.settimeout(self.connect_timeout)
        try:
            conn.connect(path)
            conn.send(json.dumps({"session": resp.session_id,
                                  "secret": resp.session_secret.hex()}).encode())
            reply = json.loads(conn.recv(4096) or b"{}")
        except (OSError, ValueError) as exc:
            conn.close()
            raise DaemonUnavailableError(
                f"cannot attach to the daemon's fd socket {path} ({exc}); is this process "
                "allowed to use the daemon's socket directory?") from exc
        if not reply.get("ok"):
            conn.close()
            raise StagingError(f"the daemon refused the fd connection: {reply.get('error')}")
        return conn

    # -- staging (shared memory) ---------------------------------------------------------
    def _take_idle(self, nbytes: int) -> _Segment | None:
        """An idle segment of at least ``nbytes`` (now 'staging'); frees idle ones too small.
        Called with the lock held."""
        s = self._ensure_session()
        best = None
        for seg in self._segments:
            if (seg.state == "idle" and seg.gen == s.gen and seg.size >= nbytes
                    and (best is None or seg.size < best.size)):
                best = seg
        if best is not None:
            best.state = "staging"
            return best
        for seg in list(self._segments):
            if seg.state == "idle" and seg.size < nbytes:
                self._drop_segment(seg)
        return None

    def _drop_segment(self, seg: _Segment) -> None:
        seg.state = "dead"
        self._segments.remove(seg)
        _unmap(seg)
        s = self._session
        if s is not None and seg.gen == s.gen:
            try:
                self._call("ReleaseStaging", pb.ReleaseStagingRequest(
                    session_id=s.id, segment_id=seg.id), timeout=CALL_TIMEOUT)
            except CkptdError as exc:
                log.debug("ckptd: releasing segment %s failed: %s", seg.id, exc)

    def _lease(self, seg: _Segment, nbytes: int) -> Lease:
        return _SegmentLease(seg, nbytes, lambda: self._give_back(seg))

    def _give_back(self, seg: _Segment) -> None:
        with self._cond:
            if seg.state == "dead" or self._session is None or seg.gen != self._session.gen:
                seg.state = "dead"
                if seg in self._segments:
                    self._segments.remove(seg)
                _unmap(seg)
            else:
                seg.state = "idle"
            self._cond.notify_all()

    def _new_segment(self, nbytes: int, wait: bool) -> _Segment:
        with self._lock:
            s = self._ensure_session()
        resp = self._call("AcquireStaging", pb.AcquireStagingRequest(
            session_id=s.id, nbytes=nbytes, wait=wait,
            transfer=pb.TRANSFER_SHARED_MEMORY), timeout=300.0 if wait else CALL_TIMEOUT)
        mm = self._map_segment(s, resp.segment_id, resp.size, writable=True)
        seg = _Segment(resp.segment_id, resp.size, s.gen, s.id, mm,
                       torch.frombuffer(mm, dtype=torch.uint8))
        _pin(seg)
        with self._lock:
            self._segments.append(seg)
        return seg

    def _map_segment(self, s: _Session, segment_id: str, size: int,
                     writable: bool) -> mmap.mmap:
        """Fetch segment ``segment_id`` of session ``s`` over the fd socket, check its size
        and seals, and map it: a save segment (``writable``) pre-faulted, since copying into
        it is training's stall; a read segment read-only and faulted in as it is read
        (MAP_POPULATE cost ~0.6 ms per MiB up front here, more than the segment's creation)."""
        assert s.conn is not None
        with self._fd_lock:
            try:
                s.conn.send(json.dumps({"fetch": segment_id}).encode())
                msg, fds, _flags, _addr = socket.recv_fds(s.conn, 4096, 1)
            except OSError as exc:
                self._forget_session()
                raise DaemonUnavailableError(
                    f"the daemon at {self.address} closed the fd connection ({exc})") from exc
        if not msg:
            self._forget_session()
            raise DaemonUnavailableError(f"the daemon at {self.address} went away")
        reply = json.loads(msg)
        if not reply.get("ok") or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise StagingError(f"the daemon did not hand over segment {segment_id}: "
                               f"{reply.get('error')}")
        fd = fds[0]
        try:
            st = os.fstat(fd)
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if st.st_size != size or seals & SEALS != SEALS:
                raise StagingError(
                    f"staging segment {segment_id} has size {st.st_size} and seals "
                    f"{seals:#x}; expected {size} bytes, sealed against resizing")
            if writable:
                return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                 prot=mmap.PROT_READ | mmap.PROT_WRITE)
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def acquire(self, nbytes: int, block: bool) -> Lease | None:
        if not self.local:
            return self._acquire_stream(nbytes, block)
        with self._lock:
            seg = self._take_idle(nbytes)
            live = sum(1 for g in self._segments if g.state != "dead")
        if seg is not None:
            return self._lease(seg, nbytes)
        if live < MAX_SEGMENTS:
            try:
                return self._lease(self._new_segment(nbytes, wait=False), nbytes)
            except _Busy:
                pass
        if not block:
            return None
        while True:
            with self._cond:
                seg = self._take_idle(nbytes)
                if seg is not None:
                    return self._lease(seg, nbytes)
                if any(g.state in ("lent", "staging") and g.size >= nbytes
                       for g in self._segments):
                    self._cond.wait(timeout=1.0)  # our own segment comes back when durable
                    continue
                busy = [g for g in self._segments if g.state in ("lent", "staging")]
                if len(busy) >= MAX_SEGMENTS:
                    self._cond.wait(timeout=1.0)
                    continue
            try:
                return self._lease(self._new_segment(nbytes, wait=True), nbytes)
            except _Busy:
                continue

    # -- staging (stream) ----------------------------------------------------------------
    def _acquire_stream(self, nbytes: int, block: bool) -> Lease | None:
        if not self._stream_free.acquire(blocking=block):
            return None
        try:
            while True:
                with self._lock:
                    s = self._ensure_session()
                try:
                    resp = self._call("AcquireStaging", pb.AcquireStagingRequest(
                        session_id=s.id, nbytes=nbytes, wait=block,
                        transfer=pb.TRANSFER_STREAM), timeout=300.0 if block else CALL_TIMEOUT)
                    break
                except _Busy:
                    if not block:
                        self._stream_free.release()
                        return None
            buf = self._stream_buf.ensure(nbytes)
        except BaseException:
            self._stream_free.release()
            raise

        lease: _StreamLease

        def release() -> None:
            if not lease.consumed:
                try:
                    self._call("ReleaseStaging", pb.ReleaseStagingRequest(
                        session_id=lease.session_id, segment_id=lease.reservation),
                        timeout=CALL_TIMEOUT)
                except CkptdError:
                    pass
            self._stream_free.release()

        lease = _StreamLease(buf, resp.segment_id, s.id, release)
        return lease

    # -- saving --------------------------------------------------------------------------
    def submit(self, ident: SaveIdentity, plan: RankPlan, lease: Lease, extra: Any,
               param_groups: list[dict]) -> Future:
        out: Future = Future()
        t0 = time.perf_counter()
        identity = pb.SaveIdentity(job=ident.job, step=ident.step, attempt=ident.attempt,
                                   rank=ident.rank, world_size=ident.world_size,
                                   framework=ident.framework)
        try:
            plan_json = self._encoded_plan(plan)
            extra_json = json.dumps(extra, separators=(",", ":")).encode()
            groups_json = json.dumps(param_groups or [], separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            lease.release()
            out.set_exception(ConfigError(f"save state is not JSON-serializable: {exc}"))
            self.abandon(ident, f"ConfigError: {out.exception()}")
            return out
        documents = len(plan_json) + len(extra_json) + len(groups_json)
        if documents > MAX_MESSAGE - (1 << 20):   # one Save message carries all three
            lease.release()
            out.set_exception(ConfigError(
                f"step {ident.step} was not saved: its plan, extra state and param groups "
                f"encode to {documents} bytes of JSON (extra state {len(extra_json)}), more "
                f"than the {(MAX_MESSAGE >> 20) - 1} MiB one message to the daemon may carry. "
                "Keep large data in extra as tensors or numpy arrays (staged like the model's "
                "tensors), not as strings or lists."))
            self.abandon(ident, f"ConfigError: {out.exception()}")
            return out
        timeout_s = float(self.commit_timeout or 0.0)
        if isinstance(lease, _SegmentLease):
            seg = lease.seg
            req = pb.SaveRequest(session_id=seg.session_id, segment_id=seg.id,
                                 identity=identity, plan_json=plan_json, extra_json=extra_json,
                                 param_groups_json=groups_json, commit_timeout_s=timeout_s)
            t1 = time.perf_counter()
            try:
                resp = self._call("Save", req, timeout=CALL_TIMEOUT)
            except (CkptdError, _Busy) as exc:
                if isinstance(exc, DaemonUnavailableError) or seg.gen != self._gen:
                    seg.state = "dead"
                lease.release()
                out.set_exception(self._handover_error(ident, exc))
                return out
            seg.state = "lent"
            self.last_phases = {"submit.encode": t1 - t0,
                                "submit.rpc": time.perf_counter() - t1}
        elif isinstance(lease, _StreamLease):
            req = pb.SaveRequest(session_id=lease.session_id, segment_id=lease.reservation,
                                 identity=identity, plan_json=plan_json, extra_json=extra_json,
                                 param_groups_json=groups_json, commit_timeout_s=timeout_s)
            try:
                resp = self._save_stream(req, lease.buffer, plan.nbytes)
                lease.consumed = True
            except CkptdError as exc:
                lease.release()
                out.set_exception(self._handover_error(ident, exc))
                return out
            lease.release()  # the daemon has the bytes; the local buffer is free again
            lease = Lease(lease.buffer, lambda: None)
        else:
            raise TypeError(f"lease {lease!r} was not acquired from this transport")
        tw = time.perf_counter()

        def no_watch(exc: BaseException) -> None:
            if isinstance(lease, _SegmentLease):
                lease.seg.state = "dead"  # still lent to the daemon: never reuse it
            lease.release()
            out.set_exception(DaemonUnavailableError(
                f"cannot follow step {ident.step} (rank {ident.rank}): no thread to watch it "
                f"({exc})"))

        self._starter.start(self._watch, (resp.save_id, identity, ident, lease, out),
                            f"ckptd-watch-{ident.step}", no_watch)
        self.last_phases["submit.watch"] = time.perf_counter() - tw
        return out

    def _encoded_plan(self, plan: RankPlan) -> bytes:
        """The plan as JSON; the client reuses an unchanged plan object across saves, so its
        encoding is reused too (the daemon likewise reuses its check of the same bytes)."""
        cached = self._plan_json
        if cached is not None and cached[0] is plan:
            return cached[1]
        data = json.dumps(plan.to_json(), separators=(",", ":")).encode()
        self._plan_json = (plan, data)
        return data

    def _handover_error(self, ident: SaveIdentity, exc: BaseException) -> BaseException:
        self.abandon(ident, f"{type(exc).__name__}: {exc}")
        if isinstance(exc, DaemonUnavailableError):
            return DaemonUnavailableError(
                f"step {ident.step} (rank {ident.rank}) was not handed over: {exc}")
        return exc

    def abandon(self, ident: SaveIdentity, error: str) -> None:
        """Have a daemon record that this rank's save ``ident`` failed (not handed over,
        or lost with a daemon that died), so the other ranks stop waiting for its commit:
        the daemon of the live session does it now; when the daemon is draining, gone or
        restarting, the one this rank registers with next (its next save, load, or
        ``close()``).  Nothing here waits for a daemon.  Best effort: a daemon that refuses,
        or none coming back, leaves the other ranks to their commit timeout."""
        if ident.world_size <= 1:
            return
        with self._lock:
            self._lost.append((ident, error))
            s = self._session
            if s is not None and not self._closed and self._session_alive(s):
                self._report_lost(s)

    def _send_abandon(self, session_id: str, ident: SaveIdentity, error: str) -> None:
        identity = pb.SaveIdentity(job=ident.job, step=ident.step, attempt=ident.attempt,
                                   rank=ident.rank, world_size=ident.world_size,
                                   framework=ident.framework)
        self._call("AbandonSave", pb.AbandonSaveRequest(
            session_id=session_id, identity=identity, error_message=error[:4000]),
            timeout=30.0)

    def _save_stream(self, req: pb.SaveRequest, buffer: torch.Tensor, nbytes: int) -> Any:
        mv = buffer.numpy().data.cast("B")[:nbytes]

        def messages() -> Iterator[pb.SaveStreamRequest]:
            yield pb.SaveStreamRequest(header=req)
            for off in range(0, nbytes, STREAM_CHUNK_BYTES):
                yield pb.SaveStreamRequest(data=bytes(mv[off:off + STREAM_CHUNK_BYTES]))

        try:
            return self._stub.SaveStream(messages(), timeout=600.0, metadata=self._md)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.address) from None

    def _watch(self, save_id: str, identity: pb.SaveIdentity, ident: SaveIdentity,
               lease: Lease, out: Future) -> None:
        from ckptd_client.client import CheckpointInfo

        req = pb.WatchSaveRequest(save_id=save_id, identity=identity,
                                  commit_timeout_s=float(self.commit_timeout or 0.0))
        deadline = None if self.commit_timeout is None else (
            time.monotonic() + self.commit_timeout + 120.0)
        returned = written = False
        error: BaseException | None = None
        delay = 0.2
        while True:
            lost = False  # the connection broke (as opposed to the daemon reporting a failure)
            remaining = None if deadline is None else max(1.0, deadline - time.monotonic())
            try:
                for st in self._stub.WatchSave(req, timeout=remaining, metadata=self._md,
                                               wait_for_ready=written):
                    if st.segment_returned and not returned:
                        returned = True
                        lease.release()
                    if st.state == pb.SAVE_STATE_WRITTEN:
                        written = True
                    elif st.state == pb.SAVE_STATE_COMMITTED:
                        out.set_result(CheckpointInfo(ident.job, ident.step, ident.attempt,
                                                      ident.world_size, ident.framework,
                                                      self.url, st.nbytes))
                        return
                    elif st.state == pb.SAVE_STATE_FAILED:
                        from ckptd.errors import error_class_by_name

                        error = error_class_by_name(st.error_class)(st.error_message)
                        break
                else:
                    lost = True
                    error = DaemonUnavailableError("the daemon ended the watch stream early")
            except grpc.RpcError as exc:
                error = error_from_rpc(exc, self.address)
                lost = isinstance(error, DaemonUnavailableError)
            if lost and (written or not self.local) and not self._closed and (
                    deadline is None or time.monotonic() < deadline):
                time.sleep(delay)   # the bytes are durable (or the link is remote): re-watch
                delay = min(2.0, delay * 2)
                error = None
                continue
            break
        if not returned:
            if isinstance(lease, _SegmentLease):
                lease.seg.state = "dead"
            lease.release()
        if lost and not written:
            error = DaemonUnavailableError(
                f"the ckptd daemon at {self.address} went away while step {ident.step} (job "
                f"{ident.job!r}, rank {ident.rank}) was being written: that step will not "
                "commit. Earlier checkpoints are untouched; the next save reconnects to the "
                f"restarted daemon. ({error})")
            self.abandon(ident, f"DaemonUnavailableError: {error}")
        assert error is not None
        out.set_exception(error)

    # -- reading -------------------------------------------------------------------------
    def storage(self) -> StorageBackend:
        return self._storage

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._lost:  # last chance to tell the other ranks (see _report_lost)
                try:
                    self._ensure_session()
                except CkptdError as exc:
                    log.warning("ckptd: the daemon at %s is not back; the other ranks wait "
                                "for their commit timeout for step(s) %s: %s", self.address,
                                sorted({i.step for i, _ in self._lost}), exc)
            self._closed = True
        for t in self._starter.close():
            t.join(timeout=5.0)
        self._storage.close_windows()
        with self._lock:
            s, self._session = self._session, None
            if s is not None and s.conn is not None:
                s.conn.close()
            for seg in self._segments:
                if seg.state != "lent":
                    _unmap(seg)
            self._segments = []
        self._channel.close()


class DaemonStorage(StorageBackend):
    """Read-only storage through the daemon, limited to the client's job.

    ``get`` streams an object's bytes over ReadObject.  ``read_window`` (used by
    :class:`ckptd.format.reader.CheckpointReader`) offers the shared-memory path on the
    daemon's node: a read segment the daemon reads objects into (ReadIntoSegment), see
    :mod:`ckptd_client.transport.shmread`.  ``read_bytes`` counts the object bytes read by
    each path (``shared_memory``, ``stream``).  ``CKPTD_SHM_READS=0`` turns the shared-memory
    path off.
    """

    def __init__(self, transport: DaemonTransport) -> None:
        self._t = transport
        self.url = transport.url
        self._count_lock = threading.Lock()
        self.read_bytes = {"shared_memory": 0, "stream": 0}
        self._windows: set[SegmentWindow] = set()

    def _count(self, transfer: str, nbytes: int) -> None:
        with self._count_lock:
            self.read_bytes[transfer] += nbytes

    def read_window(self, capacity: int) -> ReadWindow | None:
        """A shared-memory window of ``capacity`` bytes (rounded up by the daemon), or None
        where there is none: a remote daemon, ``CKPTD_SHM_READS=0``, or the node's staging
        budget cannot give it now (the load then streams; the budget is for saves first)."""
        t = self._t
        if not t.local or os.environ.get("CKPTD_SHM_READS", "1") == "0":
            return None
        # the size asked for, else a small window (fetches larger than it then stream)
        resp = None
        why = ""
        for size in [capacity] + ([SMALL_WINDOW] if capacity > SMALL_WINDOW else []):
            try:
                with t._lock:
                    s = t._ensure_session()
                resp = t._call("AcquireStaging", pb.AcquireStagingRequest(
                    session_id=s.id, nbytes=size, wait=False,
                    transfer=pb.TRANSFER_SHARED_MEMORY, use=pb.SEGMENT_USE_READ),
                    timeout=CALL_TIMEOUT)
                break
            except _Busy:
                why = "the node's staging budget is in use"
            except StagingError as exc:   # e.g. larger than the whole budget
                why = str(exc)
            except CkptdError as exc:
                why = str(exc)
                break
        if resp is None:
            log.info("ckptd: no shared-memory read segment from the daemon (%s); this load "
                     "streams its bytes", why)
            return None

        segment_id = resp.segment_id
        window: SegmentWindow | None = None

        def release() -> None:
            with self._count_lock:
                self._windows.discard(window)  # type: ignore[arg-type]
            try:
                t._call("ReleaseStaging", pb.ReleaseStagingRequest(
                    session_id=s.id, segment_id=segment_id), timeout=CALL_TIMEOUT)
            except CkptdError as exc:  # the session is gone: the daemon freed it already
                log.debug("ckptd: releasing read segment %s failed: %s", segment_id, exc)

        try:
            mm = t._map_segment(s, segment_id, resp.size, writable=False)
        except (CkptdError, OSError) as exc:
            log.info("ckptd: cannot map the read segment (%s); this load streams its bytes",
                     exc)
            release()
            return None
        window = SegmentWindow(
            session_id=s.id, segment_id=segment_id, mm=mm, address=t.address,
            call=lambda req: t._stub.ReadIntoSegment(req, timeout=READ_TIMEOUT,
                                                     metadata=t._md),
            stream_get=self.get, count=self._count, release=release)
        with self._count_lock:
            self._windows.add(window)
        return window

    def close_windows(self) -> None:
        """Give back every window still open (the transport closes)."""
        with self._count_lock:
            windows = list(self._windows)
        for w in windows:
            w.close()

    def _refuse(self) -> Any:
        raise StoragePermissionError(
            "storage is read-only through the ckptd daemon (the daemon owns the storage "
            "credentials and writes only through saves)")

    def _unary(self, method: str, request: Any) -> Any:
        return self._t._call(method, request, timeout=CALL_TIMEOUT, wait_for_ready=True)

    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        self._refuse()

    def delete(self, keys: Iterable[str]) -> None:
        self._refuse()

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        if start is not None and end is not None and end <= start:
            return b""
        req = pb.ReadObjectRequest(job=self._t.job, key=key)
        if start is not None:
            req.start = start
        if end is not None:
            req.end = end
        # wait_for_ready waits for a daemon that is down; a call that started on a connection
        # that broke (the daemon restarted under it) fails UNAVAILABLE and is tried again
        # (reads are idempotent)
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(
                lambda e: isinstance(e, grpc.RpcError)
                and e.code() == grpc.StatusCode.UNAVAILABLE),  # type: ignore[attr-defined]
            stop=tenacity.stop_after_attempt(STREAM_READ_ATTEMPTS),
            wait=tenacity.wait_random_exponential(multiplier=0.2, max=2.0), reraise=True)
        try:
            parts = retrying(lambda: [m.data for m in self._t._stub.ReadObject(
                req, timeout=600.0, metadata=self._t._md, wait_for_ready=True)])
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self._t.address) from None
        data = b"".join(parts)
        self._count("stream", len(data))
        return data

    def exists(self, key: str) -> bool:
        return bool(self._unary("StatObject", pb.StatObjectRequest(job=self._t.job,
                                                                   key=key)).exists)

    def size(self, key: str) -> int:
        r = self._unary("StatObject", pb.StatObjectRequest(job=self._t.job, key=key))
        if not r.exists:
            raise FileNotFoundError(key)
        return int(r.size)

    def list_dir(self, prefix: str) -> list[str]:
        r = self._unary("ListObjects", pb.ListObjectsRequest(job=self._t.job, prefix=prefix))
        return list(r.names)

    def list_files(self, prefix: str) -> dict[str, int]:
        r = self._unary("ListObjects", pb.ListObjectsRequest(job=self._t.job, prefix=prefix,
                                                             recursive=True))
        return dict(r.sizes)
