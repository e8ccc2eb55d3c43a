"""The one error hierarchy of ckptd.

Every error derives from :class:`CkptdError` and, where one fits, from the matching
built-in exception, so ``except FileNotFoundError`` keeps working for callers that do not
know ckptd.  Messages say what was expected, what was found, and what to do.

``GRPC_CODES`` maps each class to a gRPC status code name; the daemon uses it to send an
error and the client uses :func:`error_from_code` to raise the same class again.
"""

from __future__ import annotations


class CkptdError(Exception):
    """Root of all ckptd errors."""


class ConfigError(CkptdError, ValueError):
    """A setting, argument or URI is invalid."""


class StorageError(CkptdError, OSError):
    """A storage operation failed permanently (after retries, where retrying is safe)."""


class StoragePermissionError(StorageError, PermissionError):
    """The storage refused access (credentials, bucket policy, file mode)."""


class TransientStorageError(StorageError):
    """A storage operation failed in a way that may succeed when retried (throttling, 5xx)."""


class CheckpointNotFoundError(CkptdError, FileNotFoundError):
    """No committed checkpoint matches the request."""


class FormatVersionError(CkptdError, ValueError):
    """The stored checkpoint uses a format version this ckptd does not know."""


class CorruptCheckpointError(CkptdError, ValueError):
    """Stored bytes do not match their recorded checksum, size or manifest."""


class StateMismatchError(CkptdError, KeyError):
    """The model/optimizer and the checkpoint do not match (keys, shapes, dtypes)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class SaveFailedError(CkptdError, RuntimeError):
    """A save did not commit; earlier checkpoints are untouched."""


class BackpressureError(CkptdError, RuntimeError):
    """A save was refused because the previous one is still being written."""


class StagingError(CkptdError, ValueError):
    """A staging segment or manifest is invalid (bounds, sizes, dtypes, names)."""


class DaemonUnavailableError(CkptdError, ConnectionError):
    """The ckptd daemon cannot be reached or went away."""


class AuthenticationError(CkptdError, PermissionError):
    """The daemon refused the request's credentials."""


GRPC_CODES: dict[type[CkptdError], str] = {
    ConfigError: "INVALID_ARGUMENT",
    StagingError: "INVALID_ARGUMENT",
    StateMismatchError: "FAILED_PRECONDITION",
    FormatVersionError: "FAILED_PRECONDITION",
    CorruptCheckpointError: "DATA_LOSS",
    CheckpointNotFoundError: "NOT_FOUND",
    StoragePermissionError: "PERMISSION_DENIED",
    AuthenticationError: "UNAUTHENTICATED",
    TransientStorageError: "UNAVAILABLE",
    StorageError: "INTERNAL",
    BackpressureError: "RESOURCE_EXHAUSTED",
    SaveFailedError: "ABORTED",
    DaemonUnavailableError: "UNAVAILABLE",
    CkptdError: "UNKNOWN",
}


def grpc_code_name(exc: BaseException) -> str:
    """The gRPC status code name for ``exc`` (most specific class wins)."""
    for cls in type(exc).__mro__:
        if cls in GRPC_CODES:
            return GRPC_CODES[cls]  # type: ignore[index]
    return "INTERNAL"


def error_class_by_name(name: str) -> type[CkptdError]:
    """The ckptd error class called ``name``; CkptdError if unknown."""
    for cls in GRPC_CODES:
        if cls.__name__ == name:
            return cls
    return CkptdError
