"""Storage backend conformance suite, plus S3- and local-specific behaviour.

:class:`StorageConformance` holds the contract tests; each backend subclasses it in a few
lines with a ``backend`` fixture.  The S3 half runs against a real SeaweedFS server (the
``s3_server``/``s3_uri`` fixtures from ``tests/s3fixture.py``) and, for exact HTTP request
counts under throttling, against a tiny in-process fake endpoint.  No timed assertions.
"""

from __future__ import annotations

import array
import errno
import http.server
import itertools
import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ckptd.errors import (
    ConfigError,
    StorageError,
    StoragePermissionError,
    TransientStorageError,
)
from ckptd.storage import LocalBackend, StorageBackend, open_storage
from ckptd.storage.testing import FailingBackend, FlakyBackend, SlowBackend, key_contains

MiB = 1 << 20


def _blob(n: int, seed: int = 0) -> bytes:
    return bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(n))


# =========================================================================================
# the contract
# =========================================================================================
class StorageConformance:
    """Contract tests; subclasses provide a ``backend`` fixture (an empty backend)."""

    # -- put / get ------------------------------------------------------------------------
    @pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "typed_memoryview"])
    def test_round_trip_single_buffer(self, backend: StorageBackend, kind: str) -> None:
        data = _blob(1000, 1)
        buf: Any = {
            "bytes": data,
            "bytearray": bytearray(data),
            "memoryview": memoryview(data),
            "typed_memoryview": memoryview(array.array("I", data)),
        }[kind]
        expected = bytes(memoryview(buf).cast("B"))
        backend.put("obj/one", buf)
        assert backend.get("obj/one") == expected

    def test_round_trip_list_of_buffers(self, backend: StorageBackend) -> None:
        parts = [b"head", bytearray(b""), memoryview(_blob(300, 2)), memoryview(b"0123456789")[3:7]]
        backend.put("obj/many", parts)
        assert backend.get("obj/many") == b"head" + _blob(300, 2) + b"3456"

    def test_empty_object(self, backend: StorageBackend) -> None:
        backend.put("empty", b"")
        backend.put("empty-list", [])
        for key in ("empty", "empty-list"):
            assert backend.get(key) == b""
            assert backend.get(key, 0) == b""
            assert backend.exists(key)
            assert backend.size(key) == 0
        assert backend.list_files("") == {"empty": 0, "empty-list": 0}

    def test_large_object_from_misaligned_buffers(self, backend: StorageBackend) -> None:
        # 11 MiB + a bit: several parts for the S3 suite's 5 MiB part size
        data = os.urandom(11 * MiB + 12345)
        view = memoryview(data)
        cuts = [0, 1, 3 * MiB + 7, 5 * MiB, 5 * MiB + 1, 10 * MiB + 3, len(data)]
        backend.put("big/blob", [view[a:b] for a, b in itertools.pairwise(cuts)])
        assert backend.size("big/blob") == len(data)
        assert backend.get("big/blob") == data
        assert (
            backend.get("big/blob", 5 * MiB - 10, 5 * MiB + 10) == data[5 * MiB - 10 : 5 * MiB + 10]
        )

    def test_ranged_get(self, backend: StorageBackend) -> None:
        data = bytes(range(100))
        backend.put("r", data)
        assert backend.get("r", 10, 20) == data[10:20]
        assert backend.get("r", 0, 1) == data[:1]
        assert backend.get("r", 90) == data[90:]
        assert backend.get("r", None, 5) == data[:5]
        assert backend.get("r", 95, 1000) == data[95:]
        assert backend.get("r", 100) == b""
        assert backend.get("r", 150) == b""
        assert backend.get("r", 7, 7) == b""
        assert backend.get("r", -3) == data[-3:]
        assert backend.get("r", -1000) == data
        assert backend.get("r", 10, -10) == data[10:-10]

    def test_get_into(self, backend: StorageBackend) -> None:
        data = bytes(range(100)) * 3
        backend.put("g/i", data)
        buf = bytearray(50)
        assert backend.get_into("g/i", memoryview(buf), 10) == 50
        assert bytes(buf) == data[10:60]
        # the object ends first: fewer bytes, the rest of the buffer untouched
        buf = bytearray(b"\xee" * 40)
        assert backend.get_into("g/i", memoryview(buf), 280) == 20
        assert buf[:20] == data[280:] and buf[20:] == b"\xee" * 20
        assert backend.get_into("g/i", memoryview(bytearray(10)), 300) == 0
        # into a slice of a larger buffer (as the daemon reads into a segment)
        big = bytearray(400)
        assert backend.get_into("g/i", memoryview(big)[64:364]) == 300
        assert big[64:364] == data and big[:64] == bytes(64) and big[364:] == bytes(36)
        with pytest.raises(FileNotFoundError):
            backend.get_into("absent", memoryview(bytearray(4)))
        with pytest.raises(FileNotFoundError):
            backend.get_into("absent", memoryview(bytearray(0)))
        with pytest.raises(ConfigError):
            backend.get_into("g/../x", memoryview(bytearray(4)))

    def test_exists_and_size(self, backend: StorageBackend) -> None:
        assert not backend.exists("x/y")
        backend.put("x/y", b"12345")
        assert backend.exists("x/y")
        assert backend.size("x/y") == 5
        assert not backend.exists("x")  # a prefix is not an object, on every backend

    def test_empty_key_is_not_an_object(self, backend: StorageBackend) -> None:
        backend.put("k", b"1")
        with pytest.raises(ConfigError):
            backend.get("")
        with pytest.raises(ConfigError):
            backend.delete([""])
        assert backend.get("k") == b"1"

    def test_put_after_its_directory_was_removed_elsewhere(self, backend: StorageBackend
                                                           ) -> None:
        backend.put("job/1/a", b"1")
        import shutil

        if isinstance(backend, LocalBackend):  # another process (gc) removed the directory
            shutil.rmtree(os.path.join(backend.root, "job"))
        else:
            backend.delete_prefix("job")
        backend.put("job/1/b", b"2")
        assert backend.get("job/1/b") == b"2"

    def test_delete_prefix_of_the_root_keeps_the_backend_usable(self, backend: StorageBackend
                                                                ) -> None:
        backend.put("a/b", b"1")
        backend.put("c", b"2")
        assert backend.delete_prefix("") == 2
        assert backend.list_files("") == {}
        backend.put("d", b"3")
        assert backend.get("d") == b"3"

    def test_missing_key(self, backend: StorageBackend) -> None:
        backend.put("present", b"1")
        assert not backend.exists("absent")
        assert not backend.exists("dir/absent")
        with pytest.raises(FileNotFoundError):
            backend.get("absent")
        with pytest.raises(FileNotFoundError):
            backend.get("dir/absent", 0, 10)
        with pytest.raises(FileNotFoundError):
            backend.get("absent", 3, 3)
        with pytest.raises(FileNotFoundError):
            backend.size("absent")

    def test_overwrite_replaces_whole_object(self, backend: StorageBackend) -> None:
        backend.put("ow", _blob(5000))
        backend.put("ow", b"short")
        assert backend.get("ow") == b"short"
        assert backend.size("ow") == 5
        assert backend.list_files("") == {"ow": 5}

    def test_overwrite_is_atomic_for_readers(self, backend: StorageBackend) -> None:
        a, b = b"A" * (256 * 1024), b"B" * (256 * 1024 - 1)
        backend.put("flip", a)
        done = threading.Event()
        seen: Counter[bytes] = Counter()
        bad: list[int] = []
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                while not done.is_set():
                    got = backend.get("flip")
                    if got == a or got == b:
                        seen[got[:1]] += 1
                    else:
                        bad.append(len(got))
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for i in range(30):
                backend.put("flip", b if i % 2 == 0 else a)
        finally:
            done.set()
            for t in threads:
                t.join()
        assert not errors, errors
        assert not bad, f"readers saw torn objects of sizes {bad[:5]}"
        assert sum(seen.values()) >= 2

    def test_concurrent_puts_from_threads(self, backend: StorageBackend) -> None:
        def work(t: int) -> None:
            for i in range(5):
                backend.put(f"c/t{t}/o{i}", f"{t}-{i}".encode())

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        files = backend.list_files("c")
        assert len(files) == 40
        assert backend.get("c/t7/o4") == b"7-4"

    # -- listing ---------------------------------------------------------------------------
    KEYS = ("a/b/c", "a/b/d", "a/e", "f", "ab/x", "a-1/y")

    def _fill(self, backend: StorageBackend) -> None:
        for i, key in enumerate(self.KEYS):
            backend.put(key, b"x" * (i + 1))

    def test_list_dir(self, backend: StorageBackend) -> None:
        assert backend.list_dir("") == []
        self._fill(backend)
        assert backend.list_dir("") == ["a", "a-1", "ab", "f"]
        assert backend.list_dir("a") == ["b", "e"]
        assert backend.list_dir("a/") == ["b", "e"]
        assert backend.list_dir("a/b") == ["c", "d"]
        assert backend.list_dir("nope") == []
        assert backend.list_dir("a/b/c") == []  # an object, not a directory

    def test_list_dir_many_entries(self, backend: StorageBackend) -> None:
        names = [f"k{i:02d}" for i in range(23)] + ["sub"]
        for n in names[:-1]:
            backend.put(f"many/{n}", b"1")
        for i in range(9):
            backend.put(f"many/sub/{i}", b"1")
        assert backend.list_dir("many") == sorted(names)
        assert len(backend.list_files("many")) == 32

    def test_list_objects_has_sizes_and_modification_times(self, backend: StorageBackend) -> None:
        assert backend.list_objects("") == {}
        t0 = time.time()
        self._fill(backend)
        t1 = time.time()
        objs = backend.list_objects("")
        assert {k: i.size for k, i in objs.items()} == backend.list_files("")
        assert set(backend.list_objects("a/b")) == {"a/b/c", "a/b/d"}
        for key, info in objs.items():
            # local files and S3 objects both know when they were written (S3 in whole
            # seconds, so allow for the truncation)
            assert info.mtime is not None and t0 - 2 <= info.mtime <= t1 + 2, (key, info)

    def test_list_files(self, backend: StorageBackend) -> None:
        assert backend.list_files("") == {}
        self._fill(backend)
        sizes = {k: i + 1 for i, k in enumerate(self.KEYS)}
        assert backend.list_files("") == sizes
        assert backend.list_files("a") == {k: sizes[k] for k in ("a/b/c", "a/b/d", "a/e")}
        assert backend.list_files("/a/") == backend.list_files("a")
        assert backend.list_files("a/b") == {"a/b/c": 1, "a/b/d": 2}
        assert backend.list_files("a/b/c") == {"a/b/c": 1}  # prefix naming an object
        assert backend.list_files("zz") == {}

    # -- delete ----------------------------------------------------------------------------
    def test_delete_many(self, backend: StorageBackend) -> None:
        keys = [f"d/{i:03d}" for i in range(35)]
        for k in keys:
            backend.put(k, b"1")
        backend.put("d2/keep", b"1")
        backend.put("d-keep", b"1")
        backend.delete([])
        backend.delete(iter(keys + ["d/missing", keys[0]]))
        assert backend.list_files("d") == {}
        assert backend.list_files("") == {"d2/keep": 1, "d-keep": 1}
        backend.delete(["d2/keep"])
        assert not backend.exists("d2/keep")

    def test_delete_prefix(self, backend: StorageBackend) -> None:
        for i in range(23):
            backend.put(f"x/{i % 3}/{i}", b"12")
        backend.put("xy/keep", b"1")
        backend.put("x-keep", b"1")
        assert backend.delete_prefix("x") == 23
        assert backend.list_files("x") == {}
        assert backend.list_files("") == {"xy/keep": 1, "x-keep": 1}
        assert backend.delete_prefix("nothing") == 0
        assert backend.delete_prefix("xy/keep") == 1  # a prefix naming one object
        assert backend.list_files("") == {"x-keep": 1}
        backend.put("x/again", b"1")  # the prefix is usable again
        assert backend.get("x/again") == b"1"

    # -- keys ------------------------------------------------------------------------------
    @pytest.mark.parametrize("key", ["../x", "/abs", "a/../b", "a//b", "./a", "a/.", "a/"])
    def test_unsafe_keys_rejected(self, backend: StorageBackend, key: str) -> None:
        with pytest.raises(ConfigError):
            backend.put(key, b"1")
        with pytest.raises(ConfigError):
            backend.get(key)
        with pytest.raises(ConfigError):
            backend.exists(key)
        with pytest.raises(ConfigError):
            backend.size(key)
        with pytest.raises(ConfigError):
            backend.delete([key])
        assert backend.list_files("") == {}

    @pytest.mark.parametrize("prefix", ["..", "a/../..", "../up"])
    def test_unsafe_prefixes_rejected(self, backend: StorageBackend, prefix: str) -> None:
        with pytest.raises(ConfigError):
            backend.list_dir(prefix)
        with pytest.raises(ConfigError):
            backend.list_files(prefix)
        with pytest.raises(ConfigError):
            backend.delete_prefix(prefix)

    def test_close_is_idempotent(self, backend: StorageBackend) -> None:
        backend.put("k", b"1")
        backend.close()
        backend.close()


# =========================================================================================
# local filesystem
# =========================================================================================
class TestLocalBackend(StorageConformance):
    @pytest.fixture
    def backend(self, tmp_path: Any) -> Iterator[LocalBackend]:
        b = LocalBackend(str(tmp_path / "root"))
        yield b
        b.close()

    def test_failed_fsync_raises_and_is_not_retried(
        self, backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        backend.put("dir/old", b"old")  # the directory exists: the next fsync is the file's
        real_fsync = os.fsync
        calls: list[int] = []

        def failing_fsync(fd: int) -> None:
            calls.append(fd)
            if len(calls) == 1:
                raise OSError(5, "Input/output error")
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", failing_fsync)
        with pytest.raises(StorageError, match="fsync") as info:
            backend.put("dir/new", b"new data")
        assert not isinstance(info.value, TransientStorageError)
        assert len(calls) == 1, "a failed fsync must not be retried"
        assert sorted(os.listdir(os.path.join(backend.root, "dir"))) == ["old"]  # no temp file
        assert not backend.exists("dir/new")
        backend.put("dir/new", b"new data")  # the next save works
        assert backend.get("dir/new") == b"new data"

    def test_put_while_another_process_removes_the_empty_parent_it_just_made(
        self, backend: LocalBackend, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Retention (``ckptd gc``, the daemon's --keep-last) removes step directories left
        empty with rmdir; one a save has just created, before its attempt directory, is
        empty too.  The save goes on instead of failing with FileNotFoundError."""
        import ckptd.storage.fsspec_backend as fb

        backend.put("job/000000000001/COMMITTED", b"{}")
        step = os.path.join(backend.root, "job", "000000000002")
        real = fb._fsync_dir
        removed: list[str] = []

        def fsync_then_prune(path: str) -> None:
            real(path)
            if not removed and os.path.isdir(step) and not os.listdir(step):
                os.rmdir(step)  # as _prune_empty_dirs does, between the two mkdirs
                removed.append(step)

        monkeypatch.setattr(fb, "_fsync_dir", fsync_then_prune)
        backend.put("job/000000000002/attempt/model/w/c/0", b"chunk")
        assert removed == [step]
        assert backend.get("job/000000000002/attempt/model/w/c/0") == b"chunk"

    def test_a_file_where_a_directory_belongs_is_named_with_what_to_do(
        self, backend: LocalBackend
    ) -> None:
        backend.put("job/keep", b"earlier")
        with open(os.path.join(backend.root, "job", "step"), "w") as f:
            f.write("not a directory")
        with pytest.raises(StorageError, match="Move it away") as info:
            backend.put("job/step/rank0", b"data")
        assert "writing job/step/rank0" in str(info.value)
        assert isinstance(info.value.__cause__, NotADirectoryError)  # not the temp cleanup's
        assert backend.get("job/keep") == b"earlier"

    @pytest.mark.parametrize("code, what", [
        (errno.ENOSPC, "no space left on the device. Free space or remove old checkpoints"),
        (errno.EDQUOT, ("the disk quota of this user .* exceeded. Free space within the quota "
                        r"\(remove old checkpoints with `ckptd gc`\) or ask for a larger quota")),
    ], ids=["ENOSPC", "EDQUOT"])
    def test_a_full_disk_or_quota_says_what_to_do(
        self, backend: LocalBackend, monkeypatch: pytest.MonkeyPatch, code: int, what: str
    ) -> None:
        backend.put("job/keep", b"earlier")

        def full(fd: int, data: Any) -> int:
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(os, "write", full)
        with pytest.raises(StorageError, match=f"writing job/new in file://.*: {what}") as info:
            backend.put("job/new", b"data")
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == code
        monkeypatch.undo()
        assert os.listdir(os.path.join(backend.root, "job")) == ["keep"]  # no temp file left

    def test_a_file_size_limit_names_the_limit_and_what_to_do(self, tmp_path: Any) -> None:
        """A real RLIMIT_FSIZE (in a child process: the limit is per process)."""
        script = textwrap.dedent(f"""
            import resource
            from ckptd.errors import StorageError
            from ckptd.storage import LocalBackend
            resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))
            try:
                LocalBackend({str(tmp_path)!r}).put("job/big", [b"x" * 600, b"y" * 600])
            except StorageError as exc:
                print(exc)
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             check=True).stdout
        assert "writing job/big in file://" in out, out
        assert ("the object is 1200 bytes but this process may write files of at most 1000 "
                "bytes (RLIMIT_FSIZE, `ulimit -f`). Raise the limit") in out, out
        assert os.listdir(os.path.join(tmp_path, "job")) == []  # no temp file left

    def test_open_storage_paths(self, tmp_path: Any) -> None:
        assert isinstance(open_storage(str(tmp_path)), LocalBackend)
        assert isinstance(open_storage(f"file://{tmp_path}"), LocalBackend)
        with pytest.raises(ConfigError):
            open_storage("file://relative/path")
        with pytest.raises(ConfigError):
            open_storage("gs://bucket/x")


# =========================================================================================
# fault-injection fakes (generic; run over a local backend)
# =========================================================================================
class TestFaultInjectionFakes:
    @pytest.fixture
    def inner(self, tmp_path: Any) -> LocalBackend:
        return LocalBackend(str(tmp_path))

    def test_flaky_fails_first_n_then_delegates(self, inner: LocalBackend) -> None:
        flaky = FlakyBackend(inner, fail_times=2, ops=("put", "get"))
        for _ in range(2):
            with pytest.raises(TransientStorageError, match="injected"):
                flaky.put("k", b"1")
        assert not inner.exists("k")  # failures happen before the inner call
        flaky.put("k", b"1")
        assert flaky.get("k") == b"1"
        assert flaky.failures == 2
        assert flaky.calls_of("put") == ["k", "k", "k"]

    def test_flaky_custom_exception_and_match(self, inner: LocalBackend) -> None:
        flaky = FlakyBackend(
            inner,
            fail_times=1,
            ops=("put",),
            match=key_contains("/_ranks/"),
            exc_factory=lambda op, key: ConnectionResetError(f"{op} {key}"),
        )
        flaky.put("a/meta", b"1")  # does not match: no failure used up
        with pytest.raises(ConnectionResetError):
            flaky.put("s/_ranks/0", b"1")
        flaky.put("s/_ranks/0", b"1")

    def test_failing_fails_matching_keys_forever(self, inner: LocalBackend) -> None:
        failing = FailingBackend(inner, ops=("put", "delete"), match=key_contains("/_ranks/"))
        failing.put("s/data", b"1")
        for _ in range(3):
            with pytest.raises(StorageError, match="injected permanent"):
                failing.put("s/_ranks/1", b"1")
        with pytest.raises(StorageError):
            failing.delete(["s/data", "s/_ranks/1"])
        assert failing.failures == 4
        assert failing.list_files("") == {"s/data": 1}
        assert failing.url == inner.url
        assert failing.root == inner.root  # other attributes pass through

    def test_slow_holds_calls_until_released(self, inner: LocalBackend) -> None:
        release = threading.Event()
        slow = SlowBackend(inner, ops=("put",), release=release)
        t = threading.Thread(target=slow.put, args=("k", b"1"))
        t.start()
        assert slow.wait_blocked(1)
        assert not inner.exists("k")
        release.set()
        t.join()
        assert inner.get("k") == b"1"

    def test_slow_times_out_instead_of_hanging(self, inner: LocalBackend) -> None:
        slow = SlowBackend(inner, ops=("get",), release=threading.Event(), timeout_s=0.01)
        inner.put("k", b"1")
        with pytest.raises(TimeoutError, match="release event"):
            slow.get("k")

    def test_unknown_op_rejected(self, inner: LocalBackend) -> None:
        with pytest.raises(ValueError):
            FlakyBackend(inner, ops=("write",))


# =========================================================================================
# S3 (SeaweedFS)
# =========================================================================================
class RequestLog:
    """Counts botocore ``before-call`` (API calls) and ``before-send`` (HTTP attempts).

    ``fail`` maps an operation name to a callable(request, attempt_no) that may raise to
    inject a failure before the request goes out.
    """

    def __init__(self, backend: Any) -> None:
        self.calls: Counter[str] = Counter()
        self.sends: Counter[str] = Counter()
        self.fail: dict[str, Callable[[Any, int], None]] = {}
        events = backend.client().meta.events
        events.register("before-call.s3", self._on_call)
        events.register("before-send.s3", self._on_send)

    def _on_call(self, event_name: str, **_: Any) -> None:
        self.calls[event_name.rsplit(".", 1)[-1]] += 1

    def _on_send(self, event_name: str, request: Any, **_: Any) -> None:
        op = event_name.rsplit(".", 1)[-1]
        self.sends[op] += 1
        if op in self.fail:
            self.fail[op](request, self.sends[op])


def _part_number(request: Any) -> int:
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(request.url).query)
    return int(query["partNumber"][0])


def _connection_error(request: Any) -> BaseException:
    from botocore.exceptions import EndpointConnectionError

    return EndpointConnectionError(endpoint_url=request.url)


def _client_error(code: str, status: int, op: str) -> BaseException:
    from botocore.exceptions import ClientError

    return ClientError(
        {"Error": {"Code": code, "Message": f"injected {code}"},
         "ResponseMetadata": {"HTTPStatusCode": status}},
        op,
    )  # fmt: skip


FAST_RETRY = {"retry_initial_wait_s": 0.001, "retry_max_wait_s": 0.01}


@pytest.mark.s3
class TestS3Backend(StorageConformance):
    @pytest.fixture
    def backend(self, s3_uri: str) -> Iterator[StorageBackend]:
        # configured from the environment only (as the s3_uri fixture sets it up); small
        # parts/pages/batches so multipart, pagination and batching are all exercised
        b = open_storage(
            s3_uri, part_size=5 * MiB, list_page_size=7, delete_batch_size=10, **FAST_RETRY
        )
        yield b
        b.close()

    def _prefix(self, backend: Any) -> str:
        return backend.prefix + "/"

    # -- one HTTP request per call; tenacity retries -----------------------------------
    def test_client_has_botocore_and_s3fs_retries_off(self, backend: Any) -> None:
        assert backend.fs.retries == 1
        assert backend.client().meta.config.retries == {
            "mode": "standard",
            "total_max_attempts": 1,
        }

    def test_every_api_call_is_one_http_request(self, backend: Any) -> None:
        log = RequestLog(backend)
        backend.put("k/small", b"1")
        backend.put("k/big", os.urandom(11 * MiB))
        backend.get("k/small", 0, 1)
        backend.exists("k/none")
        backend.list_dir("k")
        backend.list_files("")
        backend.delete_prefix("k")
        assert log.calls == log.sends
        assert log.calls["UploadPart"] == 3
        assert log.calls["CompleteMultipartUpload"] == 1

    def test_transient_failures_are_retried_by_tenacity(self, backend: Any) -> None:
        log = RequestLog(backend)

        def fail_twice(request: Any, n: int) -> None:
            if n <= 2:
                raise _connection_error(request)

        log.fail["PutObject"] = fail_twice
        log.fail["GetObject"] = fail_twice
        backend.put("r/k", b"payload")
        assert backend.get("r/k") == b"payload"
        # 3 API calls each (2 failed + 1 ok), each exactly one HTTP attempt: the retries
        # are tenacity's, not botocore's (more sends) nor s3fs's (more calls)
        assert log.calls["PutObject"] == log.sends["PutObject"] == 3
        assert log.calls["GetObject"] == log.sends["GetObject"] == 3
        assert backend.retry_count == 4

    def test_throttling_is_retried(self, backend: Any) -> None:
        log = RequestLog(backend)

        def throttle_once(request: Any, n: int) -> None:
            if n == 1:
                raise _client_error("SlowDown", 503, "ListObjectsV2")

        log.fail["ListObjectsV2"] = throttle_once
        backend.put("t/k", b"1")
        assert backend.list_files("t") == {"t/k": 1}
        assert log.calls["ListObjectsV2"] == 2

    def test_client_errors_are_not_retried(self, backend: Any) -> None:
        log = RequestLog(backend)

        def deny(request: Any, n: int) -> None:
            raise _client_error("AccessDenied", 403, "PutObject")

        log.fail["PutObject"] = deny
        with pytest.raises(StoragePermissionError, match="credentials"):
            backend.put("d/k", b"1")
        assert log.calls["PutObject"] == log.sends["PutObject"] == 1

    def test_retries_exhausted_raise_transient_error(self, backend: Any) -> None:
        log = RequestLog(backend)

        def always(request: Any, n: int) -> None:
            raise _connection_error(request)

        log.fail["HeadObject"] = always
        backend.retry_attempts = 4
        with pytest.raises(TransientStorageError) as info:
            backend.exists("e/k")
        assert log.calls["HeadObject"] == log.sends["HeadObject"] == 4
        msg = str(info.value)
        assert "4 attempt(s)" in msg and "checking e/k" in msg and "retry_attempts" in msg

    def test_unreachable_endpoint(self, s3_uri: str, s3_options: dict[str, str]) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # closed again below: nothing listens there
        opts = {**s3_options, "endpoint_url": f"http://127.0.0.1:{port}"}
        backend = open_storage(s3_uri, retry_attempts=3, connect_timeout_s=2, **opts, **FAST_RETRY)
        log = RequestLog(backend)
        with pytest.raises(TransientStorageError, match="3 attempt"):
            backend.put("k", b"1")
        assert log.calls["PutObject"] == log.sends["PutObject"] == 3
        backend.close()

    # -- multipart ------------------------------------------------------------------------
    def _uploads(self, s3_server: Any, backend: Any) -> list[dict[str, Any]]:
        out = s3_server.client().list_multipart_uploads(
            Bucket=backend.bucket, Prefix=self._prefix(backend)
        )
        return list(out.get("Uploads") or [])

    def test_multipart_list_control(self, backend: Any, s3_server: Any) -> None:
        # the "no upload left" assertions below are only meaningful if listing sees one
        client = s3_server.client()
        up = client.create_multipart_upload(Bucket=backend.bucket, Key=backend.prefix + "/ctl")
        assert [u["UploadId"] for u in self._uploads(s3_server, backend)] == [up["UploadId"]]
        client.abort_multipart_upload(
            Bucket=backend.bucket, Key=backend.prefix + "/ctl", UploadId=up["UploadId"]
        )
        assert self._uploads(s3_server, backend) == []

    def test_failed_multipart_upload_is_aborted(self, backend: Any, s3_server: Any) -> None:
        log = RequestLog(backend)

        def deny_part_2(request: Any, n: int) -> None:
            if _part_number(request) == 2:
                raise _client_error("AccessDenied", 403, "UploadPart")

        log.fail["UploadPart"] = deny_part_2
        with pytest.raises(StoragePermissionError):
            backend.put("mp/obj", os.urandom(16 * MiB))
        assert log.calls["AbortMultipartUpload"] == 1
        assert self._uploads(s3_server, backend) == []
        assert not backend.exists("mp/obj")

    def test_multipart_upload_aborted_after_retries_exhausted(
        self, backend: Any, s3_server: Any
    ) -> None:
        log = RequestLog(backend)
        part2 = []

        def drop_part_2(request: Any, n: int) -> None:
            if _part_number(request) == 2:
                part2.append(n)
                raise _connection_error(request)

        log.fail["UploadPart"] = drop_part_2
        backend.retry_attempts = 3
        with pytest.raises(TransientStorageError, match="part 2/4"):
            backend.put("mp/obj", os.urandom(16 * MiB))
        assert len(part2) == 3
        assert log.calls["AbortMultipartUpload"] == 1
        assert self._uploads(s3_server, backend) == []
        assert not backend.exists("mp/obj")

    def test_multipart_part_retried_alone(self, backend: Any, s3_server: Any) -> None:
        log = RequestLog(backend)

        def drop_part_3_once(request: Any, n: int) -> None:
            if _part_number(request) == 3 and not getattr(drop_part_3_once, "done", False):
                drop_part_3_once.done = True  # type: ignore[attr-defined]
                raise _connection_error(request)

        log.fail["UploadPart"] = drop_part_3_once
        data = os.urandom(16 * MiB)
        backend.put("mp/obj", data)
        assert log.calls["UploadPart"] == 5  # 4 parts + 1 retry of part 3
        assert log.calls["CreateMultipartUpload"] == 1
        assert backend.get("mp/obj") == data
        assert self._uploads(s3_server, backend) == []

    # -- batching ---------------------------------------------------------------------------
    def test_delete_uses_batches(self, backend: Any) -> None:
        keys = [f"b/{i}" for i in range(35)]
        for k in keys:
            backend.put(k, b"1")
        log = RequestLog(backend)
        backend.delete(keys)
        assert log.calls["DeleteObjects"] == 4  # batches of 10
        assert log.calls["DeleteObject"] == 0
        assert backend.list_files("b") == {}

    # -- configuration and errors --------------------------------------------------------
    def test_wrong_credentials(self, s3_uri: str, s3_options: dict[str, str]) -> None:
        backend = open_storage(s3_uri, **{**s3_options, "secret": "wrong-" + s3_options["secret"]})
        log = RequestLog(backend)
        with pytest.raises(StoragePermissionError) as info:
            backend.put("k", b"1")
        msg = str(info.value)
        assert "SignatureDoesNotMatch" in msg and "AWS_SECRET_ACCESS_KEY" in msg
        assert log.sends["PutObject"] == 1
        with pytest.raises(StoragePermissionError):
            backend.exists("k")
        with pytest.raises(StoragePermissionError):
            backend.list_files("")
        backend.close()

    def test_unknown_access_key(self, s3_uri: str, s3_options: dict[str, str]) -> None:
        backend = open_storage(s3_uri, **{**s3_options, "key": "nosuchkey123"})
        with pytest.raises(StoragePermissionError, match="InvalidAccessKeyId"):
            backend.get("k")
        backend.close()

    def test_no_credentials_at_all(
        self, s3_uri: str, s3_options: dict[str, str], tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """No credentials anywhere: the message said 'S3 refused' although nothing was sent."""
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                     "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                     "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_WEB_IDENTITY_TOKEN_FILE"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        opts = {k: v for k, v in s3_options.items() if k not in ("key", "secret")}
        backend = open_storage(s3_uri, **opts)
        for call in (lambda: backend.put("k", b"1"), lambda: backend.list_files("")):
            with pytest.raises(StoragePermissionError) as info:
                call()
            msg = str(info.value)
            assert "found none" in msg and "nothing was sent" in msg
            assert "AWS_ACCESS_KEY_ID" in msg and "refused" not in msg
        backend.close()

    def test_missing_bucket(self, s3_options: dict[str, str]) -> None:
        backend = open_storage("s3://ckptd-no-such-bucket/p", part_size=5 * MiB, **s3_options)
        log = RequestLog(backend)
        calls: list[Callable[[], Any]] = [
            lambda: backend.put("k", b"1"),
            lambda: backend.put("k", bytes(6 * MiB)),  # multipart: fails at create
            lambda: backend.get("k"),
            lambda: backend.exists("k"),
            lambda: backend.list_dir(""),
            lambda: backend.delete(["k"]),
        ]
        for call in calls:
            with pytest.raises(StorageError) as info:
                call()
            assert not isinstance(info.value, (TransientStorageError, StoragePermissionError))
            assert "'ckptd-no-such-bucket'" in str(info.value)
            assert "does not exist" in str(info.value) and "Create the bucket" in str(info.value)
        assert log.calls == log.sends
        assert log.calls["PutObject"] == 1
        backend.close()

    def test_use_after_close(self, backend: Any) -> None:
        backend.close()
        with pytest.raises(StorageError, match="after close"):
            backend.put("k", b"1")

    def test_prefix_is_isolated(self, backend: Any, s3_server: Any) -> None:
        backend.put("k", b"1")
        keys = s3_server.client().list_objects_v2(Bucket=backend.bucket, Prefix=backend.prefix)
        assert [o["Key"] for o in keys["Contents"]] == [backend.prefix + "/k"]

    def test_bucket_root_backend(self, s3_server: Any, s3_options: dict[str, str]) -> None:
        s3_server.create_bucket("ckptd-root-test")
        backend = open_storage("s3://ckptd-root-test", **s3_options)
        backend.put("top", b"1")
        backend.put("d/x", b"22")
        assert backend.list_dir("") == ["d", "top"]
        assert backend.list_files("") == {"top": 1, "d/x": 2}
        assert backend.delete_prefix("") == 2
        backend.close()


class _ErrorServer(http.server.ThreadingHTTPServer):
    """Answers every request with one fixed S3 error; counts requests."""

    daemon_threads = True

    def __init__(self, status: int, code: str) -> None:
        self.status, self.code, self.requests = status, code, 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _ErrorHandler)


class _ErrorHandler(http.server.BaseHTTPRequestHandler):
    server: _ErrorServer
    protocol_version = "HTTP/1.1"  # answers botocore's "Expect: 100-continue" on PUT

    def _answer(self) -> None:
        with self.server.lock:
            self.server.requests += 1
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            f"<Error><Code>{self.server.code}</Code><Message>injected</Message>"
            "<RequestId>1</RequestId></Error>"
        ).encode()
        self.send_response(self.server.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.s3
class TestS3RetryPolicyOverHTTP:
    """Exact HTTP request counts against an endpoint that always answers one error."""

    @pytest.fixture
    def error_server(self, request: pytest.FixtureRequest) -> Iterator[_ErrorServer]:
        status, code = request.param
        server = _ErrorServer(status, code)
        thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
        thread.start()
        yield server
        server.shutdown()
        server.server_close()

    def _backend(self, server: _ErrorServer) -> Any:
        return open_storage(
            "s3://bucket/p",
            endpoint_url=f"http://127.0.0.1:{server.server_address[1]}",
            key="k",
            secret="s",
            region="us-east-1",
            retry_attempts=3,
            **FAST_RETRY,
        )

    @pytest.mark.parametrize(
        "error_server",
        [
            (503, "SlowDown"),
            (500, "InternalError"),
            (503, "ServiceUnavailable"),
            (429, "TooManyRequests"),
        ],
        indirect=True,
    )
    def test_transient_errors_make_exactly_retry_attempts_requests(
        self, error_server: _ErrorServer
    ) -> None:
        backend = self._backend(error_server)
        with pytest.raises(TransientStorageError) as info:
            backend.put("k", b"payload")
        assert error_server.requests == 3  # tenacity's 3 attempts, nothing stacked below
        assert error_server.code in str(info.value)
        backend.close()

    @pytest.mark.parametrize(
        "error_server",
        [(403, "AccessDenied"), (404, "NoSuchBucket"), (400, "InvalidArgument")],
        indirect=True,
    )
    def test_client_errors_make_one_request(self, error_server: _ErrorServer) -> None:
        backend = self._backend(error_server)
        with pytest.raises(StorageError) as info:
            backend.put("k", b"payload")
        assert not isinstance(info.value, TransientStorageError)
        assert error_server.requests == 1
        if error_server.code == "AccessDenied":
            assert isinstance(info.value, StoragePermissionError)
        backend.close()


class _SilentServer:
    """A TCP endpoint that accepts connections and then neither reads nor answers: a hung
    S3 server or gateway.  Counts connections; closes them all on :meth:`close`."""

    def __init__(self) -> None:
        import socket

        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.conns: list[Any] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            c.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("body", ["bytes", "large view"])
def test_a_put_to_an_endpoint_that_never_answers_fails_instead_of_hanging(body: str) -> None:
    """aiohttp's read timeout starts only once the body is sent, and botocore sends puts
    with 'Expect: 100-continue': a put to a server that accepted the connection and then
    hung waited forever (the save, the reshard, the COMMITTED write with it).  Each attempt
    now fails after connect_timeout_s + read_timeout_s without progress and is retried."""
    server = _SilentServer()
    backend = open_storage(
        "s3://bucket/p", endpoint_url=server.url, key="k", secret="s", region="us-east-1",
        retry_attempts=2, connect_timeout_s=0.5, read_timeout_s=1, **FAST_RETRY,
    )
    # 32 MiB: more than the socket buffers take from a peer that never reads
    data: Any = b"payload" if body == "bytes" else memoryview(bytearray(32 << 20))
    try:
        with pytest.raises(TransientStorageError, match="stopped answering") as info:
            backend.put("k", data)
        assert "2 attempt(s)" in str(info.value)
        assert len(server.conns) == 2  # one connection per attempt, each given up
    finally:
        backend.close()
        server.close()


class TestS3Configuration:
    """Construction only: no server needed."""

    @pytest.fixture(autouse=True)
    def _clean_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in (
            "CKPTD_S3_ENDPOINT_URL",
            "AWS_ENDPOINT_URL_S3",
            "AWS_ENDPOINT_URL",
            "AWS_REGION",
            "AWS_DEFAULT_REGION",
        ):
            monkeypatch.delenv(name, raising=False)

    def test_endpoint_precedence(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from ckptd.storage.s3 import S3Backend

        assert S3Backend("s3://bkt/p").endpoint_url is None
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://generic:1")
        assert S3Backend("s3://bkt/p").endpoint_url == "http://generic:1"
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3specific:2")
        assert S3Backend("s3://bkt/p").endpoint_url == "http://s3specific:2"
        monkeypatch.setenv("CKPTD_S3_ENDPOINT_URL", "http://ckptd:3")
        b = S3Backend("s3://bkt/p")
        assert b.endpoint_url == "http://ckptd:3"
        assert b.region == "us-east-1"  # custom endpoint, no region set
        assert b.fs.config_kwargs["s3"] == {"addressing_style": "path"}
        assert S3Backend("s3://bkt/p", endpoint_url="http://opt:4").endpoint_url == "http://opt:4"

    def test_region_precedence(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from ckptd.storage.s3 import S3Backend

        monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
        assert S3Backend("s3://bkt").region == "eu-west-1"
        monkeypatch.setenv("AWS_REGION", "eu-central-1")
        assert S3Backend("s3://bkt").region == "eu-central-1"
        assert S3Backend("s3://bkt", region="ap-south-1").region == "ap-south-1"

    def test_retry_layers_configured(self) -> None:
        from ckptd.storage.s3 import S3Backend

        a, b = S3Backend("s3://bkt/p"), S3Backend("s3://bkt/p")
        assert a.fs is not b.fs  # no shared instance cache
        assert a.fs.retries == 1
        assert a.fs.config_kwargs["retries"] == {"mode": "standard", "total_max_attempts": 1}
        assert a.fs.dircache.use_listings_cache is False

    @pytest.mark.parametrize(
        "uri", ["s3://", "s3:///x", "s3://bkt/../x", "s3://bkt/a//b", "s3://b@d/x"]
    )
    def test_bad_uris(self, uri: str) -> None:
        with pytest.raises(ConfigError):
            open_storage(uri)

    @pytest.mark.parametrize(
        "opts",
        [
            {"part_size": 1 * MiB},
            {"retry_attempts": 0},
            {"delete_batch_size": 1001},
            {"s3fs_kwargs": {"retries": 10}},
            {"s3fs_kwargs": {"use_listings_cache": True}},
            {"s3fs_kwargs": {"endpoint_url": "http://x"}},
            {"retry_max_wait_s": -1},
        ],
    )
    def test_bad_options(self, opts: dict[str, Any]) -> None:
        with pytest.raises(ConfigError):
            open_storage("s3://bkt/p", **opts)

    def test_misspelled_option_is_a_config_error_naming_the_right_one(self) -> None:
        from ckptd_client import CheckpointClient

        with pytest.raises(ConfigError, match="'partsize' \\(did you mean 'part_size'\\?\\)"):
            open_storage("s3://bkt/p", partsize=8 * MiB)
        with pytest.raises(ConfigError, match="'bogus'.*expected some of endpoint_url"):
            CheckpointClient("j", storage="s3://bkt/p", storage_options={"bogus": 1})

    def test_url_and_keys(self) -> None:
        from ckptd.storage.s3 import S3Backend

        b = S3Backend("s3://bkt/some/prefix/")
        assert b.url == "s3://bkt/some/prefix"
        assert (b.bucket, b.prefix) == ("bkt", "some/prefix")
        assert S3Backend("s3://bkt").url == "s3://bkt"
