"""Settings of ``ckptd serve``: command-line flags, each also readable from the environment.

Every flag ``--some-flag`` has the variable ``CKPTD_SOME_FLAG``; a flag on the command line
wins over the variable, the variable over the default.  This module is the only place the
daemon reads ``CKPTD_*`` settings, including the test-only hooks at the end.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ckptd.daemon.priority import DEFAULT_IO_NICE, MAX_NICE
from ckptd.errors import ConfigError
from ckptd.storage import BACKGROUND_RETRY_S

DEFAULT_SOCKET = "/run/ckptd/ckptd.sock"
MAX_MESSAGE_BYTES = 64 << 20     # gRPC receive/send limit (plans and metadata; data is chunked)
STREAM_CHUNK_BYTES = 4 << 20     # bytes per SaveStream / ReadObject message
MAX_CONCURRENT_RPCS = 1024       # includes long-lived WatchSave streams
MAX_SESSIONS = 4096

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """``16GiB`` / ``512MiB`` / ``1e9`` / ``4096`` -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS or not math.isfinite(float(m.group(1))):
        raise ConfigError(
            f"size {text!r} is invalid: expected a number with an optional unit such as "
            "16GiB, 512MiB, 8GB or 4096"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _seconds(text: str) -> float:
    """A finite number of seconds (``nan`` and ``inf`` are refused)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number of seconds")
    return value


#: what each converter of ``_FLAGS`` expects, for the error message of a bad value
_EXPECTED = {int: "an integer", _seconds: "a finite number of seconds, e.g. 600 or 2.5",
             str: "a string"}


def _convert(conv: object, raw: str) -> object:
    """``conv(raw)``; a ConfigError that says what was expected and what was found."""
    try:
        return conv(raw)  # type: ignore[operator]
    except ConfigError:
        raise
    except ValueError:
        raise ConfigError(f"expected {_EXPECTED.get(conv, 'a valid value')}, got {raw!r}"
                          ) from None


def _argparse_type(conv: object) -> object:
    """``conv`` for argparse: its message, not argparse's "invalid <function> value"."""
    def convert(raw: str) -> object:
        try:
            return _convert(conv, raw)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    convert.__name__ = getattr(conv, "__name__", "value")
    return convert


def memory_limit() -> int | None:
    """Bytes of memory this process can have: the smaller of the node's MemTotal and the
    memory cgroup's limit (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``)."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    limits.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():
            limits.append(int(raw))
        break
    return min(limits) if limits else None


DEFAULT_STAGING_BYTES = 8 << 30


def default_staging_bytes(limit: int | None) -> int:
    """The budget when none is given: 8 GiB, or half of ``limit`` (the memory the daemon
    can have, :func:`memory_limit`) on a smaller node or container, so that the daemon
    starts with its defaults anywhere; an explicit budget beyond ``limit`` is refused."""
    if limit is None:
        return DEFAULT_STAGING_BYTES
    return max(1 << 20, min(DEFAULT_STAGING_BYTES, limit // 2))


def check_staging_fits(staging_bytes: int, limit: int | None = None) -> None:
    """Refuse a staging budget larger than the memory the daemon can have: segments are
    pre-faulted memory charged to the daemon, so such a budget is never a limit -- the
    kernel's OOM killer would be instead."""
    limit = memory_limit() if limit is None else limit
    if limit is not None and staging_bytes > limit:
        raise ConfigError(
            f"--staging-bytes {staging_bytes} ({staging_bytes / 2**30:.1f} GiB) is more than the "
            f"memory this daemon can have ({limit} bytes, {limit / 2**30:.1f} GiB: the node's "
            "MemTotal or the memory cgroup's limit). Staging segments are memory charged to the "
            "daemon; pick a budget well below that (the shard bytes of every rank on the node, "
            "x1-2; see docs/OPERATIONS.md)")


def _bool_env(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass
class DaemonConfig:
    storage: str = ""
    socket: str = DEFAULT_SOCKET
    socket_group: str | None = None
    listen: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    token_file: str | None = None
    staging_bytes: int = DEFAULT_STAGING_BYTES
    shm_dir: str | None = None
    write_concurrency: int = 8
    io_nice: int = DEFAULT_IO_NICE
    metrics_port: int = 9400
    keep_last: int | None = None
    keep_every: int | None = None
    drain_timeout: float = 600.0
    storage_retry_s: float = BACKGROUND_RETRY_S
    log_format: str = "text"
    # test-only hooks (documented in docs/DAEMON.md; never set them in production)
    test_write_delay: float = 0.0      # CKPTD_TEST_WRITE_DELAY: seconds to wait before each write
    test_write_gate: str | None = None  # CKPTD_TEST_WRITE_GATE: wait until this file exists
    test_read_gate: str | None = None   # CKPTD_TEST_READ_GATE: each ReadIntoSegment range too
    max_message_bytes: int = field(default=MAX_MESSAGE_BYTES)

    def validate(self) -> DaemonConfig:
        if not self.storage:
            raise ConfigError(
                "ckptd serve needs a storage URI: --storage s3://bucket/prefix or "
                "file:///path (or CKPTD_STORAGE)"
            )
        if not self.socket or not os.path.isabs(self.socket):
            raise ConfigError(f"--socket must be an absolute path, got {self.socket!r}")
        if len(os.fsencode(self.socket + ".fds")) > 100:
            raise ConfigError(
                f"--socket path {self.socket!r} is too long for a Unix socket (at most ~100 "
                "bytes including the '.fds' suffix); pick a shorter path"
            )
        if self.listen:
            if not (self.tls_cert and self.tls_key and self.token_file):
                raise ConfigError(
                    "--listen HOST:PORT (TCP) requires --tls-cert, --tls-key and --token-file: "
                    "the daemon never serves TCP without TLS and a bearer token"
                )
            host, sep, port = self.listen.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--listen must be HOST:PORT, got {self.listen!r}")
        if self.staging_bytes < (1 << 20):
            raise ConfigError(
                f"--staging-bytes {self.staging_bytes} is too small: at least 1MiB (normally "
                "the shard bytes of every rank on the node, x1-2)"
            )
        if not 1 <= self.write_concurrency <= 1024:
            raise ConfigError(
                f"--write-concurrency must be in [1, 1024], got {self.write_concurrency}")
        if not 0 <= self.io_nice <= MAX_NICE:
            raise ConfigError(f"--io-nice must be in [0, {MAX_NICE}] (nice levels below the "
                              f"daemon's own priority), got {self.io_nice}")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        for name in ("keep_last", "keep_every"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if self.keep_every is not None and self.keep_last is None:
            raise ConfigError("--keep-every needs --keep-last (retention keeps the last K "
                              "checkpoints plus every M-th step)")
        if not 0 <= self.storage_retry_s <= 3600:
            raise ConfigError(f"--storage-retry-s must be in [0, 3600] seconds, got "
                              f"{self.storage_retry_s}")
        if not (math.isfinite(self.drain_timeout) and self.drain_timeout >= 0):
            raise ConfigError(f"--drain-timeout must be a number of seconds >= 0, got "
                              f"{self.drain_timeout}")
        if self.log_format not in ("json", "text"):
            raise ConfigError(f"--log-format must be json or text, got {self.log_format!r}")
        return self

    @property
    def fd_socket(self) -> str:
        return self.socket + ".fds"


# flag name -> (type converter, help)
_FLAGS: dict[str, tuple[object, str]] = {
    "storage": (str, "checkpoint storage URI: s3://bucket/prefix or file:///path"),
    "socket": (str, (f"Unix socket path (default {DEFAULT_SOCKET}); its directory is "
                     "created mode 0750 if missing")),
    "socket_group": (str, ("group (name or gid) allowed to use the socket (default: the "
                           "daemon's primary group)")),
    "listen": (str, "also serve TCP on HOST:PORT (requires --tls-cert, --tls-key, --token-file)"),
    "tls_cert": (str, "PEM server certificate (chain) for --listen"),
    "tls_key": (str, "PEM private key for --listen"),
    "token_file": (str, "file holding the bearer token TCP clients must send"),
    "staging_bytes": (parse_size, ("node-wide staging budget, e.g. 16GiB (default 8GiB, or "
                                   "half the node's or container's memory if less)")),
    "shm_dir": (str, ("accepted for compatibility; staging segments are memfd-backed and do "
                      "not live in a directory (see docs/DAEMON.md)")),
    "write_concurrency": (int, "concurrent object writes (default 8)"),
    "io_nice": (int, (f"nice levels the threads that checksum and write saves run below the "
                      f"daemon, so they yield the cores to training (0-{MAX_NICE}, default "
                      f"{DEFAULT_IO_NICE}; 0 = same priority)")),
    "metrics_port": (int, "Prometheus /metrics port (default 9400; 0 = off)"),
    "keep_last": (int, "retention after each commit: keep the last K checkpoints"),
    "keep_every": (int, "retention after each commit: also keep every M-th step"),
    "drain_timeout": (_seconds, "seconds SIGTERM waits for in-flight saves (default 600)"),
    "storage_retry_s": (_seconds, ("seconds a failing object-store write or delete is retried "
                                "before its save fails (S3; default 300; at most 100 attempts): the daemon holds the "
                                "bytes, so an outage shorter than this loses no checkpoint")),
    "log_format": (str, "json or text (default text)"),
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the flags; defaults stay None so :func:`from_args` can tell them apart."""
    for name, (conv, help_) in _FLAGS.items():
        flag = "--" + name.replace("_", "-")
        kwargs: dict = {"dest": name, "default": None,
                        "help": f"{help_} [env CKPTD_{name.upper()}]"}
        if conv is not str:
            kwargs["type"] = _argparse_type(conv)
        if name == "log_format":
            kwargs["choices"] = ["json", "text"]
        parser.add_argument(flag, **kwargs)


def from_args(args: argparse.Namespace | None = None,
              env: Mapping[str, str] | None = None) -> DaemonConfig:
    """The daemon's settings: flags over ``CKPTD_*`` variables over defaults."""
    env = os.environ if env is None else env
    cfg = DaemonConfig()
    given_staging = False
    for name, (conv, _help) in _FLAGS.items():
        value = getattr(args, name, None) if args is not None else None
        if value is None:
            raw = env.get(f"CKPTD_{name.upper()}")
            if raw is None or raw == "":
                continue
            try:
                value = _convert(conv, raw)
            except ConfigError as exc:
                raise ConfigError(f"CKPTD_{name.upper()}={raw!r} is invalid: {exc}") from None
        setattr(cfg, name, value)
        given_staging = given_staging or name == "staging_bytes"
    cfg.staging_bytes = (parse_size(cfg.staging_bytes) if given_staging
                         else default_staging_bytes(memory_limit()))
    delay = env.get("CKPTD_TEST_WRITE_DELAY")
    if delay:
        cfg.test_write_delay = float(delay)
    gate = env.get("CKPTD_TEST_WRITE_GATE")
    if gate:
        cfg.test_write_gate = gate
    read_gate = env.get("CKPTD_TEST_READ_GATE")
    if read_gate:
        cfg.test_read_gate = read_gate
    return cfg.validate()
