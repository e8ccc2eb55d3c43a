"""Small deterministic storage fakes for fault-injection tests.

Each wraps any :class:`~ckptd.storage.base.StorageBackend` and delegates to it, except
for the calls it is told to disturb:

* :class:`FlakyBackend` fails the first ``fail_times`` matching calls with a transient
  error, then behaves;
* :class:`FailingBackend` fails every matching call, forever (e.g. every ``put`` whose key
  contains ``/_ranks/``);
* :class:`SlowBackend` holds matching calls until a :class:`threading.Event` is set (and/or
  for a fixed delay), so a test can catch an operation in flight.

A call "matches" when its operation name is in ``ops`` and ``match(key)`` is true.  The key
of ``put``/``get``/``exists``/``size`` is the key; of ``list_dir``/``list_files``/
``delete_prefix`` the prefix; a ``delete`` matches when any of its keys does.  Injected
failures happen *before* the inner backend is called, so nothing is written.  All are
thread-safe; ``calls`` records every ``(op, key)`` seen, in order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ckptd.errors import StorageError, TransientStorageError
from ckptd.storage.base import Buffer, ObjectInfo, StorageBackend

ALL_OPS = ("put", "get", "exists", "size", "list_dir", "list_files", "delete", "delete_prefix")

KeyPredicate = Callable[[str], bool]
ExcFactory = Callable[[str, str], BaseException]


def key_contains(fragment: str) -> KeyPredicate:
    """A predicate: the key contains ``fragment``."""
    return lambda key: fragment in key


def _any_key(_key: str) -> bool:
    return True


class FaultInjectingBackend(StorageBackend):
    """Delegates everything to ``inner``; subclasses disturb matching calls in :meth:`_on_call`."""

    def __init__(
        self,
        inner: StorageBackend,
        *,
        ops: Iterable[str] = ("put",),
        match: KeyPredicate | None = None,
    ) -> None:
        ops = tuple(ops)
        unknown = sorted(set(ops) - set(ALL_OPS))
        if unknown:
            raise ValueError(f"unknown storage operations {unknown}; expected some of {ALL_OPS}")
        self.inner = inner
        self.url = inner.url
        self.ops = ops
        self.match = match or _any_key
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def _matches(self, op: str, keys: Sequence[str]) -> bool:
        return op in self.ops and any(self.match(k) for k in keys)

    def _enter(self, op: str, *keys: str) -> None:
        with self._lock:
            self.calls.extend((op, k) for k in keys)
        if self._matches(op, keys):
            self._on_call(op, keys[0] if keys else "")

    def _on_call(self, op: str, key: str) -> None:  # pragma: no cover - overridden
        """Called (from the caller's thread) for each matching call, before delegating."""

    def calls_of(self, op: str) -> list[str]:
        """Keys of the recorded calls of ``op``."""
        with self._lock:
            return [k for o, k in self.calls if o == op]

    # -- delegation -----------------------------------------------------------------
    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        self._enter("put", key)
        self.inner.put(key, data)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self._enter("get", key)
        return self.inner.get(key, start, end)

    def exists(self, key: str) -> bool:
        self._enter("exists", key)
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        self._enter("size", key)
        return self.inner.size(key)

    def list_dir(self, prefix: str) -> list[str]:
        self._enter("list_dir", prefix)
        return self.inner.list_dir(prefix)

    def list_files(self, prefix: str) -> dict[str, int]:
        self._enter("list_files", prefix)
        return self.inner.list_files(prefix)

    def list_objects(self, prefix: str) -> dict[str, ObjectInfo]:
        self._enter("list_files", prefix)
        return self.inner.list_objects(prefix)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if keys:
            self._enter("delete", *keys)
        self.inner.delete(keys)

    def delete_prefix(self, prefix: str) -> int:
        self._enter("delete_prefix", prefix)
        return self.inner.delete_prefix(prefix)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # anything else: the inner backend's
        if name == "inner":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class FlakyBackend(FaultInjectingBackend):
    """Fails the first ``fail_times`` matching calls, then delegates.

    ``exc_factory(op, key)`` builds each error; by default a
    :class:`~ckptd.errors.TransientStorageError`.  ``failures`` counts those raised.
    """

    def __init__(
        self,
        inner: StorageBackend,
        fail_times: int = 1,
        ops: Iterable[str] = ("put",),
        *,
        match: KeyPredicate | None = None,
        exc_factory: ExcFactory | None = None,
    ) -> None:
        super().__init__(inner, ops=ops, match=match)
        self.fail_times = fail_times
        self.failures = 0
        self.exc_factory = exc_factory or self._default_exc

    def _default_exc(self, op: str, key: str) -> BaseException:
        return TransientStorageError(
            f"injected transient failure {self.failures}/{self.fail_times} of {op}({key!r}) on "
            f"{self.url} (FlakyBackend); expected callers to retry or fail the checkpoint"
        )

    def _on_call(self, op: str, key: str) -> None:
        with self._lock:
            if self.failures >= self.fail_times:
                return
            self.failures += 1
        raise self.exc_factory(op, key)


class FailingBackend(FaultInjectingBackend):
    """Fails every matching call with ``exc_factory(op, key)`` (default StorageError).

    >>> FailingBackend(inner, ops=("put",), match=key_contains("/_ranks/"))  # doctest: +SKIP
    """

    def __init__(
        self,
        inner: StorageBackend,
        ops: Iterable[str] = ("put",),
        *,
        match: KeyPredicate | None = None,
        exc_factory: ExcFactory | None = None,
    ) -> None:
        super().__init__(inner, ops=ops, match=match)
        self.failures = 0
        self.exc_factory = exc_factory or self._default_exc

    def _default_exc(self, op: str, key: str) -> BaseException:
        return StorageError(
            f"injected permanent failure of {op}({key!r}) on {self.url} (FailingBackend); "
            "expected the checkpoint to fail with this reason"
        )

    def _on_call(self, op: str, key: str) -> None:
        with self._lock:
            self.failures += 1
        raise self.exc_factory(op, key)


class SlowBackend(FaultInjectingBackend):
    """Holds matching calls, then delegates.

    Each matching call sleeps ``delay_s`` (if given) and then waits for ``release`` (if
    given) -- up to ``timeout_s``, after which it raises TimeoutError so a broken test
    cannot hang forever.  ``wait_blocked(n)`` waits until ``n`` calls have been held.
    """

    def __init__(
        self,
        inner: StorageBackend,
        ops: Iterable[str] = ("put",),
        *,
        match: KeyPredicate | None = None,
        release: threading.Event | None = None,
        delay_s: float = 0.0,
        timeout_s: float = 60.0,
    ) -> None:
        super().__init__(inner, ops=ops, match=match)
        self.release = release
        self.delay_s = delay_s
        self.timeout_s = timeout_s
        self.blocked = 0
        self._cond = threading.Condition(self._lock)

    def _on_call(self, op: str, key: str) -> None:
        with self._cond:
            self.blocked += 1
            self._cond.notify_all()
        if self.delay_s:
            threading.Event().wait(self.delay_s)
        if self.release is not None and not self.release.wait(self.timeout_s):
            raise TimeoutError(
                f"SlowBackend held {op}({key!r}) for {self.timeout_s}s and the release event "
                "was never set; expected the test to set it"
            )

    def wait_blocked(self, n: int = 1, timeout: float = 30.0) -> bool:
        """Wait until at least ``n`` matching calls have entered; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self.blocked >= n, timeout)
