"""The storage seam: one small blocking interface that every backend implements.

Keys are ``/``-separated paths relative to the backend's root (no leading ``/``, no
``..``).  Every method is thread-safe and may be called from any thread; writers call
``put`` from a bounded thread pool.  A ``put`` is *durable and whole* when it returns: a
reader sees either the complete object or no object, never a prefix.  Retrying is the
backend's business and only ever for idempotent operations (all of these are).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Union

from ckptd.errors import ConfigError

Buffer = Union[bytes, bytearray, memoryview]


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a listing says of one object."""

    size: int
    mtime: float | None  # last modification, seconds since the epoch; None if unknown


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative key, else raise ConfigError."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ConfigError(
            f"storage key {key!r} is not a safe relative path: expected '/'-separated names "
            "without empty, '.' or '..' parts"
        )
    return key


class StorageBackend(abc.ABC):
    """Blocking object storage rooted at :attr:`url`."""

    url: str

    @abc.abstractmethod
    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        """Store ``data`` (one buffer, or several written back to back) under ``key``.

        Replaces an existing object atomically.  Durable when it returns.
        """

    @abc.abstractmethod
    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes ``[start, end)`` of the object; raises FileNotFoundError if it is absent."""

    def get_into(self, key: str, out: memoryview, start: int = 0) -> int:
        """Read bytes ``[start, start + len(out))`` of the object into ``out``; return how many
        were read (fewer when the object ends first).  FileNotFoundError if it is absent.

        The default reads with :meth:`get` and copies; backends that can read in place (a
        local file with ``preadv``) override it, so the daemon fills shared memory without an
        intermediate buffer.
        """
        data = self.get(key, start, start + len(out))
        n = len(data)
        out[:n] = data
        return n

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object ``key`` exists."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes of object ``key``; raises FileNotFoundError if it is absent."""

    @abc.abstractmethod
    def list_dir(self, prefix: str) -> list[str]:
        """Names directly below ``prefix`` (objects and 'directories'), sorted; [] if none."""

    @abc.abstractmethod
    def list_files(self, prefix: str) -> dict[str, int]:
        """Every object below ``prefix`` (recursively): key -> size in bytes."""

    def list_objects(self, prefix: str) -> dict[str, ObjectInfo]:
        """Like :meth:`list_files`, with each object's modification time where the backend
        knows it (``mtime=None`` otherwise, which ``gc`` treats as too young to delete)."""
        return {k: ObjectInfo(v, None) for k, v in self.list_files(prefix).items()}

    @abc.abstractmethod
    def delete(self, keys: Iterable[str]) -> None:
        """Delete the objects ``keys``; absent ones are ignored."""

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object below ``prefix``; returns how many were deleted."""
        keys = list(self.list_files(prefix))
        self.delete(keys)
        return len(keys)

    def close(self) -> None:
        """Release clients and connections.  Idempotent."""

    def join(self, *parts: str) -> str:
        """Join key parts with '/' (helper for callers)."""
        return "/".join(p.strip("/") for p in parts if p and p.strip("/"))
