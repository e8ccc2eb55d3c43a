"""S3 storage backend: s3fs/aiobotocore underneath, tenacity the only retry layer.

URI form: ``s3://bucket`` or ``s3://bucket/prefix``.  Keys are stored as
``prefix/key`` in ``bucket``.

Where settings come from (first one set wins):

* endpoint: ``endpoint_url=`` option, ``CKPTD_S3_ENDPOINT_URL``, ``AWS_ENDPOINT_URL_S3``,
  ``AWS_ENDPOINT_URL``; none means AWS itself.  A custom endpoint gets path-style
  addressing unless ``addressing_style=`` says otherwise.
* credentials: ``key=``/``secret=``/``token=`` options, else botocore's usual chain
  (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, profiles,
  instance roles).
* region: ``region=`` option, ``AWS_REGION``, ``AWS_DEFAULT_REGION``; ``us-east-1`` when a
  custom endpoint is set and nothing else is.

Retries.  s3fs retries on its own (``S3FileSystem.retries``, 5 by default, in
``s3fs.core._error_wrapper``) and so does botocore (legacy/standard modes, several
attempts); stacked, one throttled put made dozens of HTTP requests.  This backend turns
both off -- ``fs.retries = 1`` (a class attribute, not an ``__init__`` argument) runs
``_error_wrapper``'s loop exactly once, and
botocore gets ``retries={"mode": "standard", "total_max_attempts": 1}`` -- so every S3
API call is one HTTP request, and wraps each request (each part of a multipart upload,
each listing page, each delete batch) in tenacity: full-jitter exponential backoff
(``retry_initial_wait_s`` doubling, each wait capped at ``retry_max_wait_s``), at most
``retry_attempts`` attempts and ``retry_deadline_s`` seconds.  Only transient errors are
retried: throttling (SlowDown, Throttling, RequestLimitExceeded, HTTP 429/503), server
errors (InternalError, ServiceUnavailable, other 5xx except 501) and connection
failures/timeouts.  4xx errors are never retried and map to the ckptd hierarchy:
AccessDenied/InvalidAccessKeyId/SignatureDoesNotMatch -> StoragePermissionError,
NoSuchBucket -> StorageError, NoSuchKey -> FileNotFoundError.  Retries exhausted ->
TransientStorageError.

Stalls.  aiohttp's read timeout starts only once a request's body is sent, and botocore
sends every PUT/POST with ``Expect: 100-continue``: an endpoint that accepts a request
and then never answers (a hung server or gateway) held a put forever, and so does one
that stops reading a large body.  Each attempt therefore runs under a watchdog that
cancels it, as a transient ``TimeoutError``, when nothing moved for ``connect_timeout_s +
read_timeout_s`` (progress: request body bytes taken for sending, response body bytes
received); at most ``max_pool_connections`` attempts run at once, so an attempt never
waits for a pooled connection under that clock.

Threading: every public method is blocking and thread-safe; the requests run on fsspec's
I/O event loop thread through one long-lived S3FileSystem (one aiobotocore client with a
connection pool) per backend.  :meth:`close` releases the client.

Semantics versus LocalBackend: identical for objects; :meth:`exists` is true for objects
only (a "directory" that is just a common key prefix is not an object).
"""

from __future__ import annotations

import asyncio
import bisect
import contextvars
import io
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, TypeVar

from ckptd.errors import (
    CkptdError,
    ConfigError,
    StorageError,
    StoragePermissionError,
    TransientStorageError,
)
from ckptd.storage.base import Buffer, ObjectInfo, check_key
from ckptd.storage.fsspec_backend import FsspecBackend, _as_list

logger = logging.getLogger(__name__)

T = TypeVar("T")

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PARTS = 10_000  # S3's maximum number of parts of one upload
_READ_CHUNK = 4 * MiB  # a response body is read (and its progress seen) in pieces of this

#: Error codes that mean "slow down": always worth retrying after a backoff.
THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "ProvisionedThroughputExceededException",
        "EC2ThrottledException",
        "PriorRequestNotComplete",
    }
)
#: Server-side error codes that a retry may clear.
SERVER_ERROR_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "RequestTimeoutException",
        "OperationAborted",  # "a conflicting conditional operation is in progress; try again"
        "500",
        "502",
        "503",
        "504",
    }
)
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
PERMISSION_CODES = frozenset(
    {
        "AccessDenied",
        "AccountProblem",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "InvalidSecurity",
        "NotSignedUp",
        "RequestTimeTooSkewed",
        "403",
    }
)
MISSING_CODES = frozenset({"NoSuchKey", "NotFound", "404"})

#: s3fs options this backend sets itself; overriding them would break its guarantees.
_RESERVED_S3FS_KWARGS = frozenset(
    {"retries", "skip_instance_cache", "use_listings_cache", "asynchronous", "loop"}
)


def _env_first(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def settings_from_env() -> dict[str, str | None]:
    """The S3 settings this backend reads from the environment (the one place it does)."""
    return {
        "endpoint_url": _env_first(
            "CKPTD_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"
        ),
        "region": _env_first("AWS_REGION", "AWS_DEFAULT_REGION"),
    }


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` -> (bucket, prefix without surrounding slashes)."""
    if not uri.startswith("s3://"):
        raise ConfigError(f"S3 URI must look like 's3://bucket/prefix'; got {uri!r}")
    rest = uri[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket or not all(c.isascii() and (c.isalnum() or c in "._-") for c in bucket):
        raise ConfigError(
            f"S3 URI {uri!r} has bucket name {bucket!r}: expected a bucket name (letters, "
            "digits, '.', '-', '_'). Use a URI like 's3://my-bucket/checkpoints'."
        )
    if prefix:
        check_key(prefix)
    return bucket, prefix


# ---------------------------------------------------------------------------------------
# error classification
# ---------------------------------------------------------------------------------------
def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def s3_error_code(exc: BaseException) -> tuple[str | None, int | None, str]:
    """(S3 error code, HTTP status, server message) of ``exc`` or what it was raised from.

    s3fs translates botocore ``ClientError`` into builtin OSErrors with the ClientError as
    ``__cause__``; this looks through that.
    """
    from botocore.exceptions import ClientError

    for e in _chain(exc):
        if isinstance(e, _DeleteBatchError):
            return e.code, None, e.message
        if isinstance(e, ClientError):
            resp = getattr(e, "response", None) or {}
            err = resp.get("Error") or {}
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            code = err.get("Code")
            return (str(code) if code else None), status, str(err.get("Message") or e)
    return None, None, str(exc)


def _transient_network_types() -> tuple[type[BaseException], ...]:
    from botocore import exceptions as bce
    from botocore.parsers import ResponseParserError

    types: list[type[BaseException]] = [
        bce.HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ProxyConnectionError...
        bce.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError
        bce.IncompleteReadError,
        bce.ResponseStreamingError,
        ResponseParserError,  # truncated/garbled response body
        ConnectionError,  # builtin: resets, refused, broken pipe
        TimeoutError,  # asyncio timeouts; s3fs maps RequestTimeout here too
    ]
    try:
        import aiohttp

        types.append(aiohttp.ClientError)  # ClientPayloadError, ServerDisconnectedError, ...
    except ImportError:  # pragma: no cover - aiobotocore depends on aiohttp
        pass
    try:
        from fsspec.exceptions import FSTimeoutError

        types.append(FSTimeoutError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(types)


_NETWORK_TYPES: tuple[type[BaseException], ...] | None = None


def _code_is_transient(code: str | None) -> bool:
    return code in THROTTLE_CODES or code in SERVER_ERROR_CODES


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` (as raised through s3fs/botocore) may succeed when retried."""
    global _NETWORK_TYPES
    if isinstance(exc, CkptdError) and not isinstance(exc, _DeleteBatchError):
        return isinstance(exc, TransientStorageError)
    code, status, _ = s3_error_code(exc)
    if code is not None or status is not None:
        if _code_is_transient(code):
            return True
        if code in PERMISSION_CODES or code in MISSING_CODES or code == "NoSuchBucket":
            return False
        return status in TRANSIENT_STATUS
    if _NETWORK_TYPES is None:
        _NETWORK_TYPES = _transient_network_types()
    return isinstance(exc, _NETWORK_TYPES)


class _DeleteBatchError(StorageError):
    """Some keys of a DeleteObjects request failed (the request itself succeeded)."""

    def __init__(self, code: str, message: str, keys: list[str]) -> None:
        super().__init__(f"{code}: {message} ({len(keys)} keys, e.g. {keys[0]!r})")
        self.code = code
        self.message = message
        self.keys = keys


# ---------------------------------------------------------------------------------------
# progress of one attempt (for the stall watchdog)
# ---------------------------------------------------------------------------------------
class _Progress:
    """When the running attempt last moved a byte (``time.monotonic()``); updated from
    aiohttp's body-reading executor threads too (a float assignment)."""

    __slots__ = ("last", "stalled")

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.stalled = False

    def touch(self) -> None:
        self.last = time.monotonic()


#: The progress of the attempt running in the current task (set by ``S3Backend._attempt``).
_PROGRESS: contextvars.ContextVar[_Progress | None] = contextvars.ContextVar(
    "ckptd_s3_progress", default=None
)

# ---------------------------------------------------------------------------------------
# zero-copy request body
# ---------------------------------------------------------------------------------------
class _ViewReader(io.RawIOBase):
    """A read-only, seekable file over byte views, back to back, without copying them.

    botocore accepts bytes or file objects as a request body, not memoryviews; this lets
    a part of a multipart upload (or a put of several buffers) be sent straight from the
    caller's buffers.  One reader per attempt: aiohttp closes it after sending.  Each
    read counts as progress of the attempt that created the reader.
    """

    def __init__(self, views: Sequence[memoryview]) -> None:
        super().__init__()
        self._progress = _PROGRESS.get()
        self._views = [v for v in views if v.nbytes]
        self._starts: list[int] = []
        total = 0
        for v in self._views:
            self._starts.append(total)
            total += v.nbytes
        self._size = total
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END:
            pos = self._size + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self._pos = pos
        return pos

    def __len__(self) -> int:
        return self._size

    def readinto(self, buf: Any) -> int:
        if self._progress is not None:
            self._progress.touch()
        out = memoryview(buf).cast("B")
        n = 0
        while n < out.nbytes and self._pos < self._size:
            i = bisect.bisect_right(self._starts, self._pos) - 1
            view = self._views[i]
            off = self._pos - self._starts[i]
            k = min(out.nbytes - n, view.nbytes - off)
            out[n : n + k] = view[off : off + k]
            n += k
            self._pos += k
        return n

    def read(self, size: int | None = -1) -> bytes:
        remaining = max(0, self._size - self._pos)
        if size is None or size < 0 or size > remaining:
            size = remaining
        buf = bytearray(size)
        n = self.readinto(buf)
        return bytes(memoryview(buf)[:n]) if n != size else bytes(buf)

    def readall(self) -> bytes:
        return self.read(-1)


def _slice_views(views: Sequence[memoryview], lo: int, hi: int) -> list[memoryview]:
    """Views covering bytes [lo, hi) of the concatenation of ``views`` (no copies)."""
    out: list[memoryview] = []
    pos = 0
    for v in views:
        end = pos + v.nbytes
        if end > lo and pos < hi:
            out.append(v[max(lo, pos) - pos : min(hi, end) - pos])
        pos = end
        if pos >= hi:
            break
    return out


def _body(views: Sequence[memoryview]) -> Any:
    """The request body for ``views``: a reader, also for one bytes object, so that the
    stall watchdog sees the body being sent."""
    return _ViewReader(views) if views else b""


# ---------------------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------------------
class S3Backend(FsspecBackend):
    """Objects in ``s3://bucket/prefix`` (see the module docstring for settings/retries).

    ``put`` of more than ``part_size`` bytes is a multipart upload whose parts go up
    ``max_concurrency`` at a time, each retried on its own; if the upload fails it is
    aborted, so no parts are left behind.  ``delete``/``delete_prefix`` use DeleteObjects
    in batches of ``delete_batch_size`` (S3 allows 1000), ``max_concurrency`` at a time.

    Options: ``endpoint_url``, ``key``, ``secret``, ``token``, ``region``,
    ``addressing_style`` ("path"/"virtual"/"auto"), ``part_size`` (default 64 MiB, at
    least 5 MiB), ``max_concurrency`` (requests in flight per put/delete, default 8),
    ``retry_attempts`` (6), ``retry_initial_wait_s`` (0.5), ``retry_max_wait_s`` (20),
    ``retry_deadline_s`` (120), ``connect_timeout_s`` (10), ``read_timeout_s`` (60),
    ``delete_batch_size`` (1000), ``list_page_size`` (1000), and ``s3fs_kwargs`` -- any
    other :class:`s3fs.S3FileSystem` arguments (``s3_additional_kwargs`` for SSE,
    ``config_kwargs``, ``client_kwargs``, ...) except the retry/cache ones set here.
    """

    def __init__(
        self,
        uri: str,
        *,
        endpoint_url: str | None = None,
        key: str | None = None,
        secret: str | None = None,
        token: str | None = None,
        region: str | None = None,
        addressing_style: str | None = None,
        part_size: int = 64 * MiB,
        max_concurrency: int = 8,
        retry_attempts: int = 6,
        retry_initial_wait_s: float = 0.5,
        retry_max_wait_s: float = 20.0,
        retry_deadline_s: float = 120.0,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
        delete_batch_size: int = 1000,
        list_page_size: int = 1000,
        s3fs_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        import s3fs

        bucket, prefix = parse_s3_uri(uri.strip())
        _check_int("part_size", part_size, MIN_PART_SIZE, 5 * 1024 * MiB)
        _check_int("max_concurrency", max_concurrency, 1, 1024)
        _check_int("retry_attempts", retry_attempts, 1, 100)
        _check_int("delete_batch_size", delete_batch_size, 1, 1000)
        _check_int("list_page_size", list_page_size, 1, 1000)
        for name, value in (
            ("retry_initial_wait_s", retry_initial_wait_s),
            ("retry_max_wait_s", retry_max_wait_s),
            ("retry_deadline_s", retry_deadline_s),
            ("connect_timeout_s", connect_timeout_s),
            ("read_timeout_s", read_timeout_s),
        ):
            if not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"S3 option {name} must be a number >= 0; got {value!r}")
        extra = dict(s3fs_kwargs or {})
        reserved = sorted(_RESERVED_S3FS_KWARGS & set(extra))
        if reserved:
            raise ConfigError(
                f"s3fs_kwargs may not set {reserved}: the S3 backend sets them itself "
                "(tenacity is the only retry layer; listings are never cached). Remove them."
            )
        explicit = sorted({"endpoint_url", "key", "secret", "token"} & set(extra))
        if explicit:
            raise ConfigError(
                f"s3fs_kwargs sets {explicit}; expected them as the backend's own options "
                f"(e.g. open_storage(uri, {explicit[0]}=...)). Move them out of s3fs_kwargs."
            )

        env = settings_from_env()
        self.endpoint_url = endpoint_url or env["endpoint_url"]
        self.region = region or env["region"] or ("us-east-1" if self.endpoint_url else None)
        self.bucket = bucket
        self.prefix = prefix
        self.part_size = int(part_size)
        self.max_concurrency = int(max_concurrency)
        self.retry_attempts = int(retry_attempts)
        self.retry_initial_wait_s = float(retry_initial_wait_s)
        self.retry_max_wait_s = float(retry_max_wait_s)
        self.retry_deadline_s = float(retry_deadline_s)
        self.delete_batch_size = int(delete_batch_size)
        self.list_page_size = int(list_page_size)
        #: Retries performed so far (all operations); for metrics and tests.
        self.retry_count = 0

        config_kwargs = dict(extra.pop("config_kwargs", None) or {})
        config_kwargs["retries"] = {"mode": "standard", "total_max_attempts": 1}
        config_kwargs.setdefault("connect_timeout", connect_timeout_s)
        config_kwargs.setdefault("read_timeout", read_timeout_s)
        config_kwargs.setdefault("max_pool_connections", max(10, 4 * self.max_concurrency))
        #: An attempt counts as stalled after this many seconds without progress (0: never).
        self.stall_s = float(connect_timeout_s) + float(read_timeout_s) if read_timeout_s else 0.0
        # One attempt per pooled connection: an attempt never queues for a connection
        # while its stall clock runs.
        self._slots = asyncio.Semaphore(int(config_kwargs["max_pool_connections"]))
        style = addressing_style or ("path" if self.endpoint_url else None)
        if style:
            s3_conf = dict(config_kwargs.get("s3") or {})
            s3_conf.setdefault("addressing_style", style)
            config_kwargs["s3"] = s3_conf
        client_kwargs = dict(extra.pop("client_kwargs", None) or {})
        if self.region:
            client_kwargs.setdefault("region_name", self.region)

        fs_kwargs: dict[str, Any] = {"cache_regions": False}
        fs_kwargs.update(extra)
        fs = s3fs.S3FileSystem(
            endpoint_url=self.endpoint_url,
            key=key,
            secret=secret,
            token=token,
            config_kwargs=config_kwargs,
            client_kwargs=client_kwargs,
            skip_instance_cache=True,  # our own client, never one shared via fsspec's cache
            use_listings_cache=False,  # list-after-write must see the write
            asynchronous=False,
            **fs_kwargs,
        )
        # ``retries`` is a class attribute of S3FileSystem, not an __init__ argument (passed
        # there it would land in AioSession(**kwargs) and fail); _call_s3 hands it to
        # _error_wrapper, which loops ``range(retries)``: 1 = one try, no s3fs retry.
        fs.retries = 1
        url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        super().__init__(fs, f"{bucket}/{prefix}" if prefix else bucket, url)
        self._closed = False
        self._close_lock = threading.Lock()
        self._bucket_checked = False

    # -- key helpers -----------------------------------------------------------------
    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _dir(self, prefix: str) -> str:
        """The S3 key prefix (ending in '/', or '' for the bucket root) below ``prefix``."""
        p = prefix.strip("/")
        if not p:
            return f"{self.prefix}/" if self.prefix else ""
        return self._key(p) + "/"

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    # -- running and retrying ------------------------------------------------------------
    def _run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        if self._closed:
            raise StorageError(
                f"S3 backend {self.url} was used after close(); expected an open backend. "
                "Open a new one with ckptd.storage.open_storage()."
            )
        from fsspec.asyn import sync

        return sync(self.fs.loop, fn, *args)

    async def _s3(self, method: str, **kwargs: Any) -> Any:
        """One S3 API call = one HTTP request (s3fs and botocore retries are off)."""
        return await self.fs._call_s3(method, **kwargs)

    async def _retry(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` until it succeeds, retrying transient errors; map the final error."""
        import tenacity

        started = time.monotonic()
        attempts = 0

        def before_sleep(state: tenacity.RetryCallState) -> None:
            self.retry_count += 1
            exc = state.outcome.exception() if state.outcome else None
            code, status, msg = s3_error_code(exc) if exc else (None, None, "")
            logger.warning(
                "%s in %s: transient error on attempt %d/%d (%s%s: %s), retrying in %.2fs",
                what,
                self.url,
                state.attempt_number,
                self.retry_attempts,
                code or (type(exc).__name__ if exc else "?"),
                f", HTTP {status}" if status else "",
                msg,
                state.upcoming_sleep,
            )

        # stop_before_delay (tenacity >= 8.3) also refuses a sleep that would overrun.
        stop_delay = getattr(tenacity, "stop_before_delay", tenacity.stop_after_delay)
        retrying = tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(self.retry_attempts)
            | stop_delay(self.retry_deadline_s),
            wait=tenacity.wait_random_exponential(
                multiplier=self.retry_initial_wait_s, max=self.retry_max_wait_s
            ),
            retry=tenacity.retry_if_exception(is_transient),
            before_sleep=before_sleep,
            reraise=True,
        )

        async def counted() -> T:
            nonlocal attempts
            attempts += 1
            return await self._attempt(fn)

        try:
            return await retrying(counted)
        except Exception as exc:
            mapped = self._map_error(exc, what, attempts, time.monotonic() - started)
            if mapped is exc:
                raise
            raise mapped from exc

    async def _attempt(self, fn: Callable[[], Awaitable[T]]) -> T:
        """One attempt of ``fn`` under the stall watchdog (see the module docstring)."""
        async with self._slots:
            progress = _Progress()
            token = _PROGRESS.set(progress)
            try:
                if self.stall_s <= 0:
                    return await fn()
                async with asyncio.timeout(None) as deadline:
                    watchdog = asyncio.create_task(self._watchdog(deadline, progress))
                    try:
                        return await fn()
                    finally:
                        watchdog.cancel()
            except TimeoutError:
                if not progress.stalled:
                    raise
                raise TimeoutError(
                    f"nothing was sent or received for {self.stall_s:.0f}s "
                    "(connect_timeout_s + read_timeout_s): the endpoint accepted the request "
                    "but stopped answering or reading it"
                ) from None
            finally:
                _PROGRESS.reset(token)

    async def _watchdog(self, deadline: asyncio.Timeout, progress: _Progress) -> None:
        loop = asyncio.get_running_loop()
        while (left := progress.last + self.stall_s - time.monotonic()) > 0:
            await asyncio.sleep(left)
        progress.stalled = True
        deadline.reschedule(loop.time())  # cancels the attempt, raising TimeoutError

    def _map_error(
        self, exc: BaseException, what: str, attempts: int, elapsed: float
    ) -> BaseException:
        code, status, msg = s3_error_code(exc)
        found = code or type(exc).__name__
        if isinstance(exc, CkptdError) and not isinstance(exc, _DeleteBatchError):
            return exc
        if is_transient(exc):
            return TransientStorageError(
                f"{what} in {self.url}: expected success within {self.retry_attempts} "
                f"attempts / {self.retry_deadline_s:.0f}s, but {attempts} attempt(s) over "
                f"{elapsed:.1f}s all failed with transient errors (last: {found}: {msg}). "
                f"The endpoint {self.endpoint_url or 'AWS S3'} is throttling, failing or "
                "unreachable: check it is up, lower the write concurrency, or raise "
                "retry_attempts/retry_deadline_s."
            )
        if code == "NoSuchBucket":
            return StorageError(
                f"{what} in {self.url}: expected bucket {self.bucket!r} to exist at "
                f"{self.endpoint_url or 'AWS S3'}, but it does not exist (NoSuchBucket). Create "
                "the bucket (e.g. `aws s3 mb s3://" + self.bucket + "`) or fix the URI."
            )
        if _is_no_credentials(exc):
            return StoragePermissionError(
                f"{what} in {self.url}: expected S3 credentials, but found none to sign the "
                f"request with ({type(exc).__name__}: {msg}); nothing was sent to S3. Set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the key=/secret= options, an "
                "AWS profile, or an instance/pod role)."
            )
        if code in PERMISSION_CODES or isinstance(exc, PermissionError):
            return StoragePermissionError(
                f"{what} in {self.url}: expected the credentials to allow it, but S3 refused "
                f"({found}: {msg}). Check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or the "
                "key=/secret= options), the endpoint, the clock, and the bucket policy."
            )
        if code in MISSING_CODES or (code is None and isinstance(exc, FileNotFoundError)):
            return FileNotFoundError(
                f"{what} in {self.url}: expected the object to exist, but it does not ({found})"
            )
        if code == "NoSuchUpload":
            return StorageError(
                f"{what} in {self.url}: the multipart upload vanished (NoSuchUpload: {msg}); "
                "it was aborted or expired (bucket lifecycle rule?). Retry the save."
            )
        if isinstance(exc, ConfigError):
            return exc
        return StorageError(
            f"{what} in {self.url}: expected success, but S3 answered {found}"
            f"{f' (HTTP {status})' if status else ''}: {msg}. This error is not retried; "
            "check the request and the endpoint."
        )

    async def _check_bucket(self, what: str) -> None:
        """HEAD answers a bare 404 for a missing bucket too; tell the two apart once."""
        if self._bucket_checked:
            return
        try:
            await self._retry(what, lambda: self._s3("head_bucket", Bucket=self.bucket))
        except FileNotFoundError as exc:
            raise StorageError(
                f"{what} in {self.url}: expected bucket {self.bucket!r} to exist at "
                f"{self.endpoint_url or 'AWS S3'}, but it does not exist. Create the bucket (e.g. "
                f"`aws s3 mb s3://{self.bucket}`) or fix the URI."
            ) from exc
        self._bucket_checked = True

    # -- head --------------------------------------------------------------------------
    async def _head(self, key: str) -> int | None:
        what = f"checking {key}"
        try:
            out = await self._retry(
                what, lambda: self._s3("head_object", Bucket=self.bucket, Key=self._key(key))
            )
        except FileNotFoundError:
            await self._check_bucket(what)
            return None
        self._bucket_checked = True
        return int(out["ContentLength"])

    def exists(self, key: str) -> bool:
        self._key(key)
        return self._run(self._head, key) is not None

    def size(self, key: str) -> int:
        self._key(key)
        n = self._run(self._head, key)
        if n is None:
            raise FileNotFoundError(
                f"stat of {key} in {self.url}: expected the object to exist, but it does not"
            )
        return n

    # -- put -----------------------------------------------------------------------------
    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        full = self._key(key)
        views = [memoryview(b).cast("B") for b in _as_list(data)]
        total = sum(v.nbytes for v in views)
        if total <= self.part_size:
            self._run(self._put_single, key, full, views)
        else:
            self._run(self._put_multipart, key, full, views, total)

    async def _put_single(self, key: str, full: str, views: list[memoryview]) -> None:
        await self._retry(
            f"writing {key}",
            lambda: self._s3("put_object", Bucket=self.bucket, Key=full, Body=_body(views)),
        )
        self._bucket_checked = True

    def _part_size_for(self, total: int) -> int:
        size = self.part_size
        if math.ceil(total / size) > MAX_PARTS:
            size = math.ceil(math.ceil(total / MAX_PARTS) / MiB) * MiB
        return size

    async def _put_multipart(
        self, key: str, full: str, views: list[memoryview], total: int
    ) -> None:
        part_size = self._part_size_for(total)
        created = await self._retry(
            f"starting multipart upload of {key}",
            lambda: self._s3("create_multipart_upload", Bucket=self.bucket, Key=full),
        )
        self._bucket_checked = True
        upload_id = created["UploadId"]
        bounds = [(lo, min(lo + part_size, total)) for lo in range(0, total, part_size)]
        n_parts = len(bounds)
        try:
            sem = asyncio.Semaphore(self.max_concurrency)
            etags: list[str] = [""] * n_parts

            async def upload(i: int, lo: int, hi: int) -> None:
                async with sem:
                    out = await self._retry(
                        f"uploading part {i + 1}/{n_parts} of {key}",
                        lambda: self._s3(
                            "upload_part",
                            Bucket=self.bucket,
                            Key=full,
                            UploadId=upload_id,
                            PartNumber=i + 1,
                            Body=_ViewReader(_slice_views(views, lo, hi)),
                        ),
                    )
                    etags[i] = out["ETag"]

            try:
                async with asyncio.TaskGroup() as tg:  # first failure cancels the rest
                    for i, (lo, hi) in enumerate(bounds):
                        tg.create_task(upload(i, lo, hi))
            except BaseExceptionGroup as group:
                raise _first_error(group) from None

            parts = [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]
            tries = 0

            async def complete() -> None:
                nonlocal tries
                tries += 1
                try:
                    await self._s3(
                        "complete_multipart_upload",
                        Bucket=self.bucket,
                        Key=full,
                        UploadId=upload_id,
                        MultipartUpload={"Parts": parts},
                    )
                except FileNotFoundError as exc:
                    # NoSuchUpload on a retry: the earlier attempt completed, its answer lost.
                    if tries > 1 and s3_error_code(exc)[0] == "NoSuchUpload":
                        out = await self._s3("head_object", Bucket=self.bucket, Key=full)
                        if int(out["ContentLength"]) == total:
                            return
                    raise

            await self._retry(f"completing multipart upload of {key}", complete)
        except BaseException as exc:
            await self._abort(key, full, upload_id, exc)
            raise

    async def _abort(self, key: str, full: str, upload_id: str, cause: BaseException) -> None:
        async def attempt() -> None:
            try:
                await self._s3(
                    "abort_multipart_upload", Bucket=self.bucket, Key=full, UploadId=upload_id
                )
            except FileNotFoundError as exc:
                if s3_error_code(exc)[0] != "NoSuchUpload":
                    raise  # NoSuchUpload: already gone, which is what we want

        try:
            await self._retry(f"aborting multipart upload of {key}", attempt)
        except Exception as exc:  # noqa: BLE001 - reported on the original error
            logger.error(
                "could not abort multipart upload %s of %s in %s: %s", upload_id, key, self.url, exc
            )
            cause.add_note(
                f"The failed multipart upload {upload_id} of {key} could not be aborted ({exc}); "
                "its parts still take space. Abort it (`aws s3api abort-multipart-upload`) or "
                "add an AbortIncompleteMultipartUpload lifecycle rule to the bucket."
            )

    # -- get -----------------------------------------------------------------------------
    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self._key(key)
        return self._run(self._get, key, start, end)

    async def _get(self, key: str, start: int | None, end: int | None) -> bytes:
        full = self._key(key)
        what = f"reading {key}"
        rng: str | None = None
        if start is not None or end is not None:
            if (end is not None and end < 0) or (
                start is not None and start < 0 and end is not None
            ):
                size = await self._head(key)
                if size is None:
                    raise FileNotFoundError(
                        f"{what} in {self.url}: expected the object to exist, but it does not"
                    )
                if start is not None and start < 0:
                    start = max(0, size + start)
                if end is not None and end < 0:
                    end = max(0, size + end)
            if start is not None and start < 0:
                rng = f"bytes={start}"  # suffix: the last -start bytes
            else:
                lo = start or 0
                if end is not None and end <= lo:
                    if await self._head(key) is None:
                        raise FileNotFoundError(
                            f"{what} in {self.url}: expected the object to exist, but it does not"
                        )
                    return b""
                rng = f"bytes={lo}-{end - 1}" if end is not None else f"bytes={lo}-"

        async def attempt() -> bytes:
            kwargs: dict[str, Any] = {"Range": rng} if rng else {}
            try:
                resp = await self._s3("get_object", Bucket=self.bucket, Key=full, **kwargs)
            except OSError as exc:
                if rng and s3_error_code(exc)[0] == "InvalidRange":
                    return b""  # start at or past the end (or an empty object)
                raise
            body = resp["Body"]
            progress = _PROGRESS.get()
            chunks: list[bytes] = []
            try:
                while chunk := await body.read(_READ_CHUNK):
                    chunks.append(chunk)
                    if progress is not None:
                        progress.touch()
            finally:
                body.close()
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)

        data = await self._retry(what, attempt)
        self._bucket_checked = True
        return data

    # -- listing -------------------------------------------------------------------------
    async def _list(
        self, s3_prefix: str, delimiter: bool
    ) -> tuple[list[dict[str, Any]], list[str]]:
        objects: list[dict[str, Any]] = []
        prefixes: list[str] = []
        token: str | None = None
        page = 0
        while True:
            page += 1
            kwargs: dict[str, Any] = {
                "Bucket": self.bucket,
                "Prefix": s3_prefix,
                "MaxKeys": self.list_page_size,
            }
            if delimiter:
                kwargs["Delimiter"] = "/"
            if token:
                kwargs["ContinuationToken"] = token
            out = await self._retry(
                f"listing {s3_prefix or '/'} (page {page})",
                lambda kw=kwargs: self._s3("list_objects_v2", **kw),
            )
            objects.extend(out.get("Contents") or [])
            prefixes.extend(p["Prefix"] for p in out.get("CommonPrefixes") or [])
            token = out.get("NextContinuationToken")
            if not out.get("IsTruncated") or not token:
                break
        self._bucket_checked = True
        return objects, prefixes

    def list_dir(self, prefix: str) -> list[str]:
        base = self._dir(prefix)
        objects, prefixes = self._run(self._list, base, True)
        names = {o["Key"][len(base) :] for o in objects}
        names.update(p[len(base) :].rstrip("/") for p in prefixes)
        names.discard("")
        return sorted(n for n in names if "/" not in n)

    def list_files(self, prefix: str) -> dict[str, int]:
        return {k: i.size for k, i in self.list_objects(prefix).items()}

    def list_objects(self, prefix: str) -> dict[str, ObjectInfo]:
        base = self._dir(prefix)
        objects, _ = self._run(self._list, base, False)
        out = {}
        for o in objects:
            if o["Key"].endswith("/"):
                continue
            lm = o.get("LastModified")
            out[self._rel(o["Key"])] = ObjectInfo(
                int(o.get("Size") or 0), lm.timestamp() if isinstance(lm, datetime) else None)
        p = prefix.strip("/")
        if not out and p:
            size = self._run(self._head, p)  # ``prefix`` may name an object itself
            if size is not None:
                out[p] = ObjectInfo(size, None)
        return out

    # -- delete --------------------------------------------------------------------------
    def delete(self, keys: Iterable[str]) -> None:
        full = list(dict.fromkeys(self._key(k) for k in keys))
        if full:
            self._run(self._delete, full)

    async def _delete(self, full: list[str]) -> None:
        sem = asyncio.Semaphore(self.max_concurrency)
        batches = [
            full[i : i + self.delete_batch_size]
            for i in range(0, len(full), self.delete_batch_size)
        ]

        async def one(n: int, batch: list[str]) -> None:
            pending = batch

            async def attempt() -> None:
                nonlocal pending
                out = await self._s3(
                    "delete_objects",
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in pending], "Quiet": True},
                )
                errors = [e for e in out.get("Errors") or [] if e.get("Code") != "NoSuchKey"]
                if not errors:
                    return
                first = errors[0]
                err = _DeleteBatchError(
                    str(first.get("Code") or "Unknown"),
                    str(first.get("Message") or ""),
                    [str(e.get("Key")) for e in errors],
                )
                if all(_code_is_transient(str(e.get("Code"))) for e in errors):
                    pending = err.keys  # retry only the keys that failed
                raise err

            async with sem:
                await self._retry(
                    f"deleting {len(batch)} objects (batch {n + 1}/{len(batches)})", attempt
                )

        try:
            async with asyncio.TaskGroup() as tg:
                for n, batch in enumerate(batches):
                    tg.create_task(one(n, batch))
        except BaseExceptionGroup as group:
            raise _first_error(group) from None
        self._bucket_checked = True

    def delete_prefix(self, prefix: str) -> int:
        keys = list(self.list_files(prefix))
        self.delete(keys)
        return len(keys)

    # -- lifecycle -------------------------------------------------------------------------
    def client(self) -> Any:
        """The aiobotocore S3 client (connecting if needed), e.g. to register event hooks."""
        return self._run(self.fs.set_session)

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        creator = getattr(self.fs, "_s3creator", None)
        if self.fs._s3 is None or creator is None:
            return
        from fsspec.asyn import sync

        try:
            sync(self.fs.loop, creator.__aexit__, None, None, None, timeout=10)
        except Exception as exc:  # noqa: BLE001 - closing is best effort
            logger.debug("closing the S3 client of %s: %s", self.url, exc)
        self.fs._s3 = None

    def __repr__(self) -> str:
        return f"S3Backend({self.url!r}, endpoint_url={self.endpoint_url!r})"


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """The first real error of a TaskGroup failure (not the CancelledErrors it caused)."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first_error(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]


def _is_no_credentials(exc: BaseException) -> bool:
    from botocore.exceptions import NoCredentialsError, PartialCredentialsError

    return any(isinstance(e, (NoCredentialsError, PartialCredentialsError)) for e in _chain(exc))


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ConfigError(f"S3 option {name} must be an integer in [{lo}, {hi}]; got {value!r}")
