"""``ckptd serve``: assemble the daemon and run it until SIGTERM.

Startup: open storage; create the socket directory (mode 0750, group ``--socket-group``)
under umask 027 and refuse a directory other users can enter; bind the gRPC socket and the
fd socket under umask 117 (sockets 0660; never chmod after bind); optionally TCP with TLS
and a bearer token; Prometheus metrics; health SERVING.

Shutdown: the first SIGTERM (or SIGINT) sets health NOT_SERVING, refuses new saves and
drains in-flight ones (until each was written and had its commit attempt) for up to
``--drain-timeout`` seconds, then exits 0.  A second SIGTERM, or the timeout, aborts the
remaining saves -- no manifest or COMMITTED is written after that point -- and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import grp
import hmac
import logging
import os
import signal
import socket
import ssl
import stat
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ckptd import __version__
from ckptd.daemon import logs
from ckptd.daemon.budget import ByteBudget
from ckptd.daemon.config import MAX_CONCURRENT_RPCS, DaemonConfig, check_staging_fits
from ckptd.daemon.fdsocket import FdServer
from ckptd.daemon.metrics import Metrics, serve_metrics
from ckptd.daemon.pipeline import WritePipeline
from ckptd.daemon.priority import background_nice, set_this_thread
from ckptd.daemon.rpcerrors import trailing_metadata
from ckptd.daemon.service import Servicer
from ckptd.daemon.staging import StagingPool
from ckptd.errors import AuthenticationError, ConfigError
from ckptd.storage import open_storage, open_write_storage
from ckptd.storage.base import StorageBackend
from ckptd.v1 import ckptd_pb2_grpc as pb_grpc

log = logging.getLogger("ckptd.daemon")

SERVICE_NAME = "ckptd.v1.CheckpointService"
HEALTH_PREFIX = "/grpc.health.v1.Health/"


# -- socket directory ------------------------------------------------------------------------
@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _gid(group: str | None) -> int | None:
    if group is None or group == "":
        return None
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"--socket-group {group!r} is not a known group") from None


def prepare_socket_dir(sock_path: str, group: str | None) -> None:
    """Create (or check) the socket's directory: only its owner and group may enter."""
    d = os.path.dirname(sock_path)
    gid = _gid(group)
    with umask(0o027):
        if not os.path.lexists(d):
            os.makedirs(d, mode=0o750, exist_ok=True)
            log.info("created socket directory %s (mode 0750)", d)
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise ConfigError(f"socket directory {d} is not a directory (or is a symlink)")
        if st.st_mode & 0o1002 == 0o1002:
            # /tmp, /var/tmp, /dev/shm: tightening it (below) would lock every other user
            # out of a directory the whole machine shares
            raise ConfigError(
                f"socket directory {d} is a shared directory (mode "
                f"{stat.S_IMODE(st.st_mode):04o}: every user may create files in it), so it "
                "cannot be limited to the daemon's users and ckptd does not change its mode. "
                f"Put the socket in a directory of its own, e.g. --socket {d.rstrip('/')}"
                "/ckptd/ckptd.sock (created with mode 0750).")
        mine = st.st_uid == os.geteuid()
        if gid is not None and st.st_gid != gid:
            if not mine:
                raise ConfigError(f"socket directory {d} is not owned by this user; cannot set "
                                  f"its group to {group}")
            os.chown(d, -1, gid)
        mode = stat.S_IMODE(st.st_mode)
        want = (mode & ~0o027) | (0o2000 if gid is not None else 0)
        if mode & 0o007 or (gid is not None and not mode & 0o2000):
            if not mine:
                raise ConfigError(
                    f"socket directory {d} has mode {mode:04o}: every user could reach the "
                    "daemon. Make it 0750 (group = the users allowed to checkpoint) or use a "
                    "new directory")
            os.chmod(d, want)  # the directory, before anything is bound in it
            log.warning("socket directory %s had mode %04o; set to %04o", d, mode, want)


def _clear_stale(path: str, kind: int) -> None:
    if not os.path.lexists(path):
        return
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{path} exists and is not a socket; remove it or pick another --socket")
    probe = socket.socket(socket.AF_UNIX, kind)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # nobody listens: a leftover of a daemon that died
        return
    finally:
        probe.close()
    raise ConfigError(f"another ckptd daemon is already serving on {path}; stop it first or "
                      "pick another --socket")


# -- TCP authentication ----------------------------------------------------------------------
class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Every call except the health service must carry ``authorization: Bearer <token>``."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation: Callable, details: Any) -> Any:
        if details.method.startswith(HEALTH_PREFIX):
            return await continuation(details)
        got = ""
        for k, v in details.invocation_metadata or ():
            if k == "authorization" and isinstance(v, str):
                got = v
        if hmac.compare_digest(got.encode(), self._expected):
            return await continuation(details)
        handler = await continuation(details)
        return _deny(handler, "missing bearer token" if not got else "wrong bearer token")


def _deny(handler: Any, why: str) -> Any:
    msg = (f"{why}: this daemon's TCP port requires `authorization: Bearer <token>` "
           "(CheckpointClient(token=...) or CKPTD_TOKEN / CKPTD_TOKEN_FILE)")

    async def abort(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        context.set_trailing_metadata(trailing_metadata(AuthenticationError.__name__, ""))
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, msg)

    async def abort_stream(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(_request, context)
        yield  # pragma: no cover - makes this an async generator

    if handler is None:
        return None
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort_stream)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort)
    return grpc.stream_stream_rpc_method_handler(abort_stream)


# -- retention -------------------------------------------------------------------------------
def make_retention(cfg: DaemonConfig, storage: StorageBackend,
                   executor: ThreadPoolExecutor) -> Callable[[str, int], None] | None:
    if cfg.keep_last is None:
        return None
    keep_last = cfg.keep_last
    try:
        from ckptd.tools import gc as gc_tool
        apply = gc_tool.apply_retention
    except (ImportError, AttributeError):
        log.warning("retention (--keep-last/--keep-every) is unavailable in this build "
                    "(ckptd.tools.gc.apply_retention is missing); no checkpoint is deleted. "
                    "Run `ckptd gc` instead.")
        return None

    def run(job: str, step: int) -> None:
        def work() -> None:
            try:
                # the step just committed is this job's newest checkpoint even when the
                # job resumed from an older step and saves below the ones it rolled back from
                report = apply(storage, job, keep_last=keep_last, keep_every=cfg.keep_every,
                               keep_steps=(step,))
                logs.event(f"retention applied to job {job} after step {step}", event="retention",
                           job=job, step=step, kept=report.kept_steps,
                           deleted=report.deleted_steps, objects_deleted=report.objects_deleted)
            except Exception:
                log.exception("retention for job %s after step %d failed", job, step)

        executor.submit(work)

    return run


# -- main ------------------------------------------------------------------------------------
def _grpc_options(cfg: DaemonConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ]


def _check_local_storage(storage: Any) -> None:
    """A local storage root must be a directory this daemon can write (created if missing):
    found at start-up instead of by the first save.  (S3 is not probed: an outage at
    start-up is ridden out by the write retries, see --storage-retry-s.)"""
    from ckptd.storage.fsspec_backend import LocalBackend

    if not isinstance(storage, LocalBackend):
        return
    root = storage.root
    probe = os.path.join(root, f".ckptd-serve-probe-{os.getpid()}")
    try:
        os.makedirs(root, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigError(
            f"--storage {storage.url}: the daemon cannot write there ({exc.strerror or exc}); "
            "expected a directory (or a creatable path) writable by the daemon's user. Fix its "
            "permissions or mount, or choose another --storage."
        ) from None


def _tls_material(cfg: DaemonConfig) -> tuple[bytes, bytes, str]:
    assert cfg.tls_cert and cfg.tls_key and cfg.token_file
    files = {}
    for flag, path in (("--tls-key", cfg.tls_key), ("--tls-cert", cfg.tls_cert),
                       ("--token-file", cfg.token_file)):
        try:
            with open(path, "rb") as f:
                files[flag] = f.read()
        except OSError as exc:
            raise ConfigError(f"{flag} {path} cannot be read ({exc.strerror})") from exc
    key, cert = files["--tls-key"], files["--tls-cert"]
    try:   # grpc reports a bad certificate or key only as "failed to bind"
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            cfg.tls_cert, cfg.tls_key)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"--tls-cert {cfg.tls_cert} and --tls-key {cfg.tls_key} are not a PEM certificate "
            f"(chain) and its private key ({exc.reason or exc})") from exc
    token = files["--token-file"].decode(errors="replace").strip()
    if len(token) < 16:
        raise ConfigError(f"the token in {cfg.token_file} is shorter than 16 characters; "
                          "use a long random token (e.g. `openssl rand -hex 32`)")
    return key, cert, token


async def run(cfg: DaemonConfig) -> int:
    # The event loop answers Save while writer threads run: switch the GIL more often than
    # the default 5 ms so an acknowledgement is not queued behind them.
    sys.setswitchinterval(0.001)
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(
        lambda _l, ctx: log.error("unhandled error in the event loop: %s", ctx.get("message"),
                                  exc_info=ctx.get("exception")))
    if cfg.shm_dir:
        log.info("--shm-dir %s ignored: staging segments are sealed memfds (no directory)",
                 cfg.shm_dir)
    check_staging_fits(cfg.staging_bytes)
    tls = _tls_material(cfg) if cfg.listen else None
    storage = open_storage(cfg.storage)
    _check_local_storage(storage)
    # the write pipeline and retention ride out a storage outage for --storage-retry-s
    # while the daemon holds the bytes; reads keep the short policy, so a waiting load or
    # listing fails within its RPC deadline with the storage's error
    write_storage = open_write_storage(cfg.storage, storage, retry_window_s=cfg.storage_retry_s)
    metrics = Metrics()
    budget = ByteBudget(cfg.staging_bytes)
    pool = StagingPool(budget, metrics)
    background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-retention",
                                    initializer=functools.partial(
                                        set_this_thread, background_nice(cfg.io_nice)))
    pipeline = WritePipeline(write_storage, metrics, write_concurrency=cfg.write_concurrency,
                             io_nice=cfg.io_nice,
                             test_write_delay=cfg.test_write_delay,
                             test_write_gate=cfg.test_write_gate,
                             on_committed=make_retention(cfg, write_storage, background))
    read_pool = ThreadPoolExecutor(max_workers=max(4, cfg.write_concurrency),
                                   thread_name_prefix="ckptd-read")
    health_servicer = health.aio.HealthServicer()

    def make_server(local: bool, interceptors: list[Any]) -> grpc.aio.Server:
        server = grpc.aio.server(options=_grpc_options(cfg), interceptors=interceptors,
                                 maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS)
        pb_grpc.add_CheckpointServiceServicer_to_server(
            Servicer(pool, pipeline, storage, local=local, fd_socket=cfg.fd_socket,
                     read_pool=read_pool, max_message_bytes=cfg.max_message_bytes,
                     test_read_gate=cfg.test_read_gate), server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        return server

    # the TCP port and the metrics port are bound before the Unix socket (which clients and
    # `ckptd health` look for), and whatever was started is stopped again if a later step
    # fails: a daemon that cannot start says why and leaves nothing serving
    servers: list[grpc.aio.Server] = []
    metrics_server = None
    fd_server = FdServer(pool, cfg.fd_socket)
    try:
        tcp_server = None
        if cfg.listen:
            assert tls is not None
            key, cert, token = tls
            tcp_server = make_server(False, [TokenInterceptor(token)])
            servers.append(tcp_server)
            try:
                bound = tcp_server.add_secure_port(
                    cfg.listen, grpc.ssl_server_credentials([(key, cert)]))
            except RuntimeError:   # grpcio >= 1.60 raises instead of returning 0
                bound = 0
            if bound == 0:
                raise ConfigError(
                    f"cannot listen on --listen {cfg.listen}: the port is in use or the host "
                    "is not an address of this node; pick another HOST:PORT")
        if cfg.metrics_port:
            try:
                metrics_server = serve_metrics(metrics, cfg.metrics_port)
            except OSError as exc:
                raise ConfigError(
                    f"cannot serve /metrics on --metrics-port {cfg.metrics_port} ({exc}); pick "
                    "a free port, or 0 to turn metrics off") from exc
        prepare_socket_dir(cfg.socket, cfg.socket_group)
        _clear_stale(cfg.socket, socket.SOCK_STREAM)
        _clear_stale(cfg.fd_socket, socket.SOCK_SEQPACKET)
        unix_server = make_server(True, [])
        servers.insert(0, unix_server)
        with umask(0o117):
            if unix_server.add_insecure_port("unix:" + cfg.socket) == 0:
                raise ConfigError(f"cannot listen on unix:{cfg.socket}")
            fd_server.bind()
            await unix_server.start()
        fd_server.start()
        if tcp_server is not None:
            await tcp_server.start()
    except BaseException:
        await fd_server.close()
        for s in servers:
            await s.stop(None)
        if metrics_server is not None:
            metrics_server.shutdown()  # type: ignore[attr-defined]
        raise

    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    logs.event(f"ckptd {__version__} serving on unix:{cfg.socket}"
               + (f" and {cfg.listen} (TLS)" if cfg.listen else ""), event="daemon",
               state="serving", storage=storage.url, staging_bytes=cfg.staging_bytes,
               write_concurrency=cfg.write_concurrency, metrics_port=cfg.metrics_port,
               pid=os.getpid())

    stop = asyncio.Event()
    abort = asyncio.Event()
    terms = 0

    def on_signal(signame: str) -> None:
        nonlocal terms
        terms += 1
        if terms == 1:
            log.info("%s: draining (up to %.0fs); send it again to abort in-flight saves",
                     signame, cfg.drain_timeout)
            stop.set()
        else:
            log.warning("%s again: aborting in-flight saves", signame)
            abort.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)

    async def housekeeping() -> None:
        while True:
            await asyncio.sleep(15)
            pool.expire()

    keeper = loop.create_task(housekeeping())
    await stop.wait()

    pipeline.accepting = False
    await health_servicer.enter_graceful_shutdown()
    logs.event("draining", event="daemon", state="draining", in_flight=pipeline.in_flight)
    drain = loop.create_task(pipeline.drain(cfg.drain_timeout))
    aborted = loop.create_task(abort.wait())
    await asyncio.wait([drain, aborted], return_when=asyncio.FIRST_COMPLETED)
    if not (drain.done() and drain.result()):
        n = pipeline.abort()
        logs.event(f"aborted {n} in-flight saves; they will not commit", logging.WARNING,
                   event="daemon", state="aborted", aborted=n)
        sys.stderr.flush()
        os._exit(1)  # worker threads may be blocked in storage calls; do not wait for them
    aborted.cancel()
    keeper.cancel()
    await fd_server.close()
    for s in servers:
        await s.stop(grace=2.0)
    if metrics_server is not None:
        with contextlib.suppress(Exception):
            metrics_server.shutdown()  # type: ignore[attr-defined]
    pipeline.close()
    pool.close()
    read_pool.shutdown(wait=False, cancel_futures=True)
    background.shutdown(wait=True)
    storage.close()
    if write_storage is not storage:
        write_storage.close()
    logs.event("stopped", event="daemon", state="stopped")
    return 0


def serve(cfg: DaemonConfig, verbose: bool = False) -> int:
    logs.setup(cfg.log_format, verbose)
    try:
        return asyncio.run(run(cfg))
    except ConfigError:
        raise
    except OSError as exc:
        raise ConfigError(f"ckptd serve could not start: {exc}") from exc
