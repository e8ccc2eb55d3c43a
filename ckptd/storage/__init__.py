"""Storage backends.  :func:`open_storage` turns a URI into a backend."""

from __future__ import annotations

import os
import re
from typing import Any

from ckptd.errors import ConfigError
from ckptd.storage.base import StorageBackend, check_key
from ckptd.storage.fsspec_backend import FsspecBackend, LocalBackend

__all__ = [
    "FsspecBackend",
    "LocalBackend",
    "StorageBackend",
    "bare_scheme",
    "check_key",
    "open_storage",
    "open_write_storage",
]

#: Seconds background writes retry a failing object store (see :func:`open_write_storage`).
BACKGROUND_RETRY_S = 300.0


def open_storage(uri: str, **options: Any) -> StorageBackend:
    """A backend for ``uri``: ``file:///abs/path`` (or ``file:/abs/path``), a plain path
    (``~`` expands to the home directory), or ``s3://bucket/prefix``.

    ``options`` go to the backend (for S3: ``endpoint_url``, ``key``, ``secret``, ...).
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(
            f"storage URI must be a non-empty string like 'file:///ckpt' or 's3://bucket/prefix'; "
            f"got {uri!r}"
        )
    uri = uri.strip()
    if uri.startswith("file://"):
        path = uri[len("file://"):]
        if not path.startswith("/"):
            raise ConfigError(
                f"file URI {uri!r} is not absolute: expected 'file:///absolute/path' (three "
                "slashes). Use an absolute path."
            )
        return LocalBackend(path)
    if uri.startswith("s3://"):
        from ckptd.storage.s3 import S3Backend

        _check_options(S3Backend, uri, options)
        return S3Backend(uri, **options)
    if "://" in uri:
        scheme = uri.split("://", 1)[0]
        raise ConfigError(
            f"storage URI scheme {scheme!r} is not supported: expected 'file://' or 's3://' in "
            f"{uri!r}"
        )
    if uri.startswith("file:/"):  # RFC 8089's short form of an absolute file URI
        return LocalBackend(uri[len("file:"):])
    scheme = bare_scheme(uri)
    if scheme:  # e.g. 's3:/bucket': a mistyped URI must not become a local directory
        raise ConfigError(
            f"storage {uri!r} looks like a URI with scheme {scheme!r} but lacks '//'; "
            "expected 'file:///absolute/path' or 's3://bucket/prefix'. For a local directory "
            "whose name contains ':', write it as './name' or as an absolute path."
        )
    return LocalBackend(os.path.expanduser(uri))


def _check_options(backend: type, uri: str, options: dict[str, Any]) -> None:
    """Unknown option names are a ConfigError naming the accepted ones (a misspelled option
    would otherwise be a bare TypeError from the backend's constructor)."""
    import difflib
    import inspect

    accepted = [
        name for name, p in inspect.signature(backend.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        hints = [
            f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name)
            for name in unknown
            for close in [difflib.get_close_matches(name, accepted, n=1)]
        ]
        raise ConfigError(
            f"storage option(s) {', '.join(hints)} not known for {uri!r}: expected some of "
            f"{', '.join(accepted)}. Fix or remove them (storage_options=/open_storage)."
        )


def bare_scheme(uri: str) -> str | None:
    """The scheme of ``uri`` if it starts like a URI (``s3:/b``, ``file:x``) without the
    ``//`` after it, else None (a plain path: no scheme, or a one-letter one such as ``C:``)."""
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]+):", uri)
    return m.group(1) if m else None


def open_write_storage(uri: str, reads: StorageBackend, *,
                       retry_window_s: float = BACKGROUND_RETRY_S,
                       **options: Any) -> StorageBackend:
    """A backend for writes that run in the background while training goes on (the daemon's
    write pipeline, the embedded client's writer thread); ``reads`` is the backend already
    open on ``uri`` (with ``options``) for callers who wait.

    The writes' bytes stay staged until durable, so on an object store a transient failure
    -- an outage, 5xx, throttling -- is retried for ``retry_window_s`` seconds (at most 100
    attempts, backoff up to 30 s) instead of the few attempts that suit a caller who waits
    (a load, a listing): a second backend with that policy.  Retry options the caller set
    explicitly win.  Elsewhere ``reads`` itself is returned: local disks do not retry
    (their errors are not transient).  Close the result only if it is not ``reads``.
    """
    if not uri.strip().startswith("s3://"):
        return reads
    options.setdefault("retry_attempts", 100)
    options.setdefault("retry_deadline_s", retry_window_s)
    options.setdefault("retry_max_wait_s", min(30.0, max(1.0, retry_window_s / 10)))
    return open_storage(uri, **options)
