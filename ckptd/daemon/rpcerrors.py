"""How ckptd errors travel over gRPC, both ways.

The daemon aborts a call with the status code of the exception's class
(:data:`ckptd.errors.GRPC_CODES`), the exception's message as the status details, and the
class name in the trailing metadata ``ckptd-error-class`` (plus ``ckptd-reason`` for a few
states a client acts on).  The client raises the same class with the same message.
"""

from __future__ import annotations

from typing import Any

import grpc

from ckptd import errors
from ckptd.errors import CkptdError

ERROR_CLASS_KEY = "ckptd-error-class"
REASON_KEY = "ckptd-reason"

# reasons a client acts on
REASON_BUSY = "staging-busy"              # budget in use (wait=false): backpressure
REASON_SESSION_UNKNOWN = "session-unknown"  # daemon restarted or session expired: re-register
REASON_DRAINING = "draining"


class RpcFailure(Exception):
    """An error the daemon reports with an explicit status code (not one of GRPC_CODES)."""

    def __init__(self, code: str, error_class: type[CkptdError], message: str,
                 reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.error_class = error_class
        self.reason = reason


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str, str, str]:
    """(code, class name, message, reason) for an exception raised by a handler."""
    if isinstance(exc, RpcFailure):
        return (getattr(grpc.StatusCode, exc.code), exc.error_class.__name__, str(exc),
                exc.reason)
    if isinstance(exc, CkptdError):
        reason = REASON_BUSY if isinstance(exc, errors.BackpressureError) else ""
        return (getattr(grpc.StatusCode, errors.grpc_code_name(exc)), type(exc).__name__,
                str(exc), reason)
    if isinstance(exc, FileNotFoundError):
        return (grpc.StatusCode.NOT_FOUND, "CheckpointNotFoundError", f"not found: {exc}", "")
    return (grpc.StatusCode.INTERNAL, "CkptdError",
            f"internal error in the ckptd daemon: {type(exc).__name__}: {exc}", "")


def trailing_metadata(class_name: str, reason: str) -> tuple[tuple[str, str], ...]:
    md = [(ERROR_CLASS_KEY, class_name)]
    if reason:
        md.append((REASON_KEY, reason))
    return tuple(md)


def _metadata(err: grpc.RpcError) -> dict[str, str]:
    try:
        md = err.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not a call error
        return {}
    return {k: v for k, v in md if isinstance(v, str)}


def reason_of(err: grpc.RpcError) -> str:
    return _metadata(err).get(REASON_KEY, "")


_FALLBACK: dict[grpc.StatusCode, type[CkptdError]] = {
    grpc.StatusCode.UNAVAILABLE: errors.DaemonUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DaemonUnavailableError,
    grpc.StatusCode.CANCELLED: errors.DaemonUnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: errors.AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: errors.AuthenticationError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errors.StagingError,
    grpc.StatusCode.INVALID_ARGUMENT: errors.ConfigError,
    grpc.StatusCode.NOT_FOUND: errors.CheckpointNotFoundError,
}


def error_from_rpc(err: grpc.RpcError, where: str = "") -> CkptdError:
    """The ckptd exception a failed call stands for (same class and message as raised in
    the daemon; a transport failure becomes DaemonUnavailableError naming ``where``)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    details = (err.details() if hasattr(err, "details") else "") or ""  # type: ignore[attr-defined]
    name = _metadata(err).get(ERROR_CLASS_KEY)
    if name:
        return errors.error_class_by_name(name)(details)
    cls = _FALLBACK.get(code, errors.CkptdError)
    if cls is errors.DaemonUnavailableError:
        return cls(
            f"the ckptd daemon{' at ' + where if where else ''} is not reachable "
            f"({code.name}: {details}). Check that `ckptd serve` runs on this node "
            "(`ckptd health`) and that this process may use its socket."
        )
    if cls is errors.StagingError and code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return cls(f"the daemon refused the request as too large ({details})")
    return cls(f"{code.name}: {details}")


def raise_from_rpc(err: grpc.RpcError, where: str = "") -> Any:
    raise error_from_rpc(err, where) from err
