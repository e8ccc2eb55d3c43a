"""Start a real ``ckptd serve`` subprocess and wait until it is SERVING.

Used by the tests, the benchmark and ``ckptd demo``::

    with start_daemon("file:///tmp/ckpt", "/tmp/ckptd-run/ckptd.sock") as d:
        client = CheckpointClient(job="j", daemon=d.address)

The daemon's stderr goes to ``log_path`` (default: a new temporary file, outside the socket
directory, which the daemon must create itself); :meth:`DaemonProcess.log` returns it, and
startup failures include it in the error.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Self

from ckptd.errors import DaemonUnavailableError


class DaemonProcess:
    def __init__(self, proc: subprocess.Popen, socket_path: str, log_path: str,
                 tcp_address: str | None) -> None:
        self.proc = proc
        self.socket = socket_path
        self.log_path = log_path
        self.tcp_address = tcp_address

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def address(self) -> str:
        """The client address: ``unix://<socket>``."""
        return "unix://" + self.socket

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (drain) and wait; SIGKILL if it does not exit in ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()

    def kill(self) -> int:
        """SIGKILL, as a crash would."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _identity(path: str) -> tuple[int, int] | None:
    """(inode, ctime in ns) of ``path``, or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


def wait_serving(socket_path: str, timeout: float, proc: subprocess.Popen | None = None,
                 log_path: str | None = None,
                 old_socket: tuple[int, int] | None = None) -> None:
    """Wait until the daemon on ``socket_path`` is SERVING; with ``proc``, until *that*
    process serves it (``old_socket``: identity of a socket file there before it started,
    e.g. the leftover of a killed daemon, which the new one replaces)."""
    from ckptd.daemon.cli import check_health

    deadline = time.monotonic() + timeout
    status = "not started"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            break
        ident = _identity(socket_path)
        if ident is not None and ident != old_socket:
            status = check_health("unix:" + socket_path, timeout=2.0)
            if status == "SERVING" and (proc is None or proc.poll() is None):
                return
        time.sleep(0.05)
    log = ""
    if log_path:
        try:
            with open(log_path, errors="replace") as f:
                log = f.read()[-4000:]
        except OSError:
            pass
    code = None if proc is None else proc.poll()
    raise DaemonUnavailableError(
        f"ckptd serve on {socket_path} did not become SERVING within {timeout:.0f}s (last "
        f"status: {status}; exit code: {code}). Daemon log:\n{log}")


def start_daemon(storage_uri: str, socket_path: str, *, staging_bytes: str | int = "1GiB",
                 write_concurrency: int = 8, metrics_port: int = 0,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 log_path: str | None = None, timeout: float = 60.0,
                 python: str | None = None, verbose: bool = False) -> DaemonProcess:
    """Start ``ckptd serve`` in a new process group and wait for health SERVING.

    ``env`` adds to (not replaces) this process's environment, e.g. test hooks such as
    ``CKPTD_TEST_WRITE_GATE``.  Raises DaemonUnavailableError (with the daemon's log) if it
    exits or does not become SERVING within ``timeout`` seconds.  ``verbose``: debug
    logging (e.g. the per-Save timing lines).
    """
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="ckptd-serve-", suffix=".log")
        os.close(fd)
    cmd = [python or sys.executable, "-m", "ckptd.cli", *(["-v"] if verbose else []),
           "serve", "--storage", storage_uri,
           "--socket", socket_path, "--staging-bytes", str(staging_bytes),
           "--write-concurrency", str(write_concurrency), "--metrics-port", str(metrics_port),
           *extra_args]
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("OMP_NUM_THREADS", "1")
    from ckptd.daemon.cli import check_health

    old_socket = _identity(socket_path)
    if old_socket is not None and check_health("unix:" + socket_path, timeout=2.0) == "SERVING":
        raise DaemonUnavailableError(
            f"another ckptd daemon is already serving on {socket_path}; stop it first")
    tcp = None
    if "--listen" in extra_args:
        tcp = list(extra_args)[list(extra_args).index("--listen") + 1]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=full_env, start_new_session=True)
    try:
        wait_serving(socket_path, timeout, proc, log_path, old_socket)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        raise
    return DaemonProcess(proc, socket_path, log_path, tcp)
