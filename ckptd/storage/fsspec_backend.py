"""Storage backends: a generic one on any fsspec filesystem, and a local one (plain os calls,
fsync) that does not need fsspec."""

from __future__ import annotations

import datetime
import errno
import functools
import os
import resource
import stat
import threading
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from ckptd.errors import StorageError, StoragePermissionError
from ckptd.storage.base import Buffer, ObjectInfo, StorageBackend, check_key


def _as_list(data: Buffer | Sequence[Buffer]) -> list[Buffer]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [data]
    return list(data)


class FsspecBackend(StorageBackend):
    """Any fsspec filesystem below ``root``.

    Subclasses adjust how errors are classified (:meth:`_translate`) and how a call is
    retried (:meth:`_call`); the default calls once and maps OSErrors to ckptd errors.
    """

    def __init__(self, fs: Any, root: str, url: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url

    # -- helpers -------------------------------------------------------------------------
    def _path(self, key: str) -> str:
        if key == "":
            return self.root
        return f"{self.root}/{check_key(key)}"

    def _translate(self, exc: BaseException, what: str) -> BaseException:
        if isinstance(exc, FileNotFoundError):
            return exc
        if isinstance(exc, PermissionError):
            return StoragePermissionError(
                f"{what} in {self.url}: permission denied ({exc}). Check the credentials and "
                "the bucket or directory permissions."
            )
        if isinstance(exc, StorageError):
            return exc
        if isinstance(exc, (NotADirectoryError, IsADirectoryError, FileExistsError)):
            return StorageError(
                f"{what} in {self.url} failed: {type(exc).__name__}: {exc}. Expected a "
                "directory tree that only ckptd writes; a file or directory was put where the "
                "checkpoint layout needs the other kind. Move it away (or pick another "
                "storage URI) and save again."
            )
        return StorageError(f"{what} in {self.url} failed: {type(exc).__name__}: {exc}")

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise self._translate(exc, what) from exc

    # -- interface -----------------------------------------------------------------------
    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        parts = _as_list(data)
        blob = parts[0] if len(parts) == 1 else b"".join(parts)
        self._call(f"writing {key}", self.fs.pipe_file, self._path(key), bytes(blob))

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        path = self._path(key)
        if start is None and end is None:
            return self._call(f"reading {key}", self.fs.cat_file, path)
        return self._call(f"reading {key}", self.fs.cat_file, path, start=start, end=end)

    def exists(self, key: str) -> bool:
        return bool(self._call(f"checking {key}", self.fs.exists, self._path(key)))

    def size(self, key: str) -> int:
        return int(self._call(f"stat of {key}", self.fs.size, self._path(key)))

    def list_dir(self, prefix: str) -> list[str]:
        path = self._path(prefix.strip("/"))
        try:
            entries = self._call(f"listing {prefix}", self.fs.ls, path, detail=False)
        except FileNotFoundError:
            return []
        own = path.split("://", 1)[-1].rstrip("/")
        names = {
            e.split("://", 1)[-1].rstrip("/").rsplit("/", 1)[-1]
            for e in entries
            if e.split("://", 1)[-1].rstrip("/") != own
        }
        names.discard("")
        return sorted(names)

    def list_files(self, prefix: str) -> dict[str, int]:
        return {k: i.size for k, i in self.list_objects(prefix).items()}

    def list_objects(self, prefix: str) -> dict[str, ObjectInfo]:
        path = self._path(prefix.strip("/"))
        try:
            found = self._call(f"listing {prefix}", self.fs.find, path, detail=True)
        except FileNotFoundError:
            return {}
        out: dict[str, ObjectInfo] = {}
        base = self.root.split("://", 1)[-1].rstrip("/") + "/"
        for full, info in found.items():
            full = full.split("://", 1)[-1]
            if info.get("type") == "directory" or not full.startswith(base):
                continue
            m = info.get("mtime", info.get("LastModified", info.get("created")))
            if isinstance(m, datetime.datetime):
                m = m.timestamp()
            out[full[len(base):]] = ObjectInfo(
                int(info.get("size") or 0), float(m) if isinstance(m, (int, float)) else None)
        return out

    def delete(self, keys: Iterable[str]) -> None:
        paths = [self._path(k) for k in keys]
        if not paths:
            return
        try:
            self._call("deleting objects", self.fs.rm, paths)
        except FileNotFoundError:
            pass


def _local_write_hint(exc: OSError, data: Buffer | Sequence[Buffer]) -> str | None:
    """What went wrong and what to do, for the write errors a full or limited disk gives;
    None for other errors."""
    if exc.errno == errno.ENOSPC:
        return ("no space left on the device. Free space or remove old checkpoints with "
                "`ckptd gc`.")
    if exc.errno == errno.EDQUOT:
        return ("the disk quota of this user (or group/project) on that filesystem is "
                "exceeded. Free space within the quota (remove old checkpoints with `ckptd gc`) "
                "or ask for a larger quota (`quota -s` shows it).")
    if exc.errno == errno.EFBIG:
        size = sum(memoryview(part).nbytes for part in _as_list(data))
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return (f"the object is {size} bytes but this process may write files of at most "
                    f"{limit} bytes (RLIMIT_FSIZE, `ulimit -f`). Raise the limit (`ulimit -f "
                    "unlimited` where the training job or the daemon is launched).")
        return (f"the object is {size} bytes, more than the filesystem allows in one file. "
                "Store checkpoints on a filesystem that allows larger files.")
    return None


class LocalBackend(FsspecBackend):
    """A local (or network-mounted POSIX) directory.

    ``put`` writes a temporary file next to the target, fsyncs it, renames it into place
    and fsyncs the directory (and every directory it had to create), so a crash leaves
    either the whole object or none.  A failed fsync raises StorageError and is never
    retried: after a failed fsync the kernel may have dropped the dirty pages, so a retry
    that "succeeds" proves nothing.
    """

    def __init__(self, root: str) -> None:
        # every operation is an os call: importing fsspec would add ~40 ms to each
        # `ckptd` command's start-up for nothing (``fs`` is made on first use only)
        root = os.path.abspath(root)
        self.root = root.rstrip("/")
        self.url = f"file://{root}"
        self._dir_lock = threading.Lock()
        self._known_dirs: set[str] = set()

    @functools.cached_property
    def fs(self) -> Any:  # type: ignore[override]
        import fsspec

        return fsspec.filesystem("file")

    def _ensure_dir(self, path: str) -> None:
        if path in self._known_dirs:
            return
        with self._dir_lock:
            for tries in range(8):
                missing = []
                d = path
                while not os.path.isdir(d):
                    missing.append(d)
                    parent = os.path.dirname(d)
                    if parent == d:
                        break
                    d = parent
                try:
                    for m in reversed(missing):
                        try:
                            os.mkdir(m, 0o755)
                        except FileExistsError:
                            pass
                        _fsync_dir(os.path.dirname(m))
                except FileNotFoundError:
                    # a directory this just made, still empty, was removed by another
                    # process (retention's rmdir of an empty step directory): walk again
                    if tries == 7:
                        raise
                    continue
                break
            self._known_dirs.add(path)

    def put(self, key: str, data: Buffer | Sequence[Buffer]) -> None:
        path = self._path(key)
        parent = os.path.dirname(path)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            self._ensure_dir(parent)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:  # the directory was removed (e.g. by gc) since cached
                with self._dir_lock:
                    self._known_dirs = {d for d in self._known_dirs
                                        if not parent.startswith(d)}
                self._ensure_dir(parent)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for part in _as_list(data):
                    view = memoryview(part).cast("B")
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
                try:
                    os.fsync(fd)
                except OSError as exc:
                    raise StorageError(
                        f"fsync of {path} failed ({exc}); the write may not be durable, so this "
                        "checkpoint is failed. Check the disk and retry the save."
                    ) from exc
            finally:
                os.close(fd)
            os.replace(tmp, path)
            _fsync_dir(parent)
        except StorageError:
            _unlink_quiet(tmp)
            raise
        except OSError as exc:
            _unlink_quiet(tmp)
            hint = _local_write_hint(exc, data)
            if hint is not None:
                raise StorageError(f"writing {key} in {self.url}: {hint}") from exc
            raise self._translate(exc, f"writing {key}") from exc

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        path = self._path(check_key(key))
        try:
            with open(path, "rb", buffering=0) as f:
                if start is None and end is None:
                    return f.readall()
                size = os.fstat(f.fileno()).st_size
                lo = 0 if start is None else (max(size + start, 0) if start < 0 else start)
                hi = size if end is None else (max(size + end, 0) if end < 0 else min(end, size))
                if hi <= lo:
                    return b""
                buf = bytearray(hi - lo)
                n = self._pread_into(f.fileno(), memoryview(buf), lo)
                return bytes(buf[:n]) if n < len(buf) else bytes(buf)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise self._translate(exc, f"reading {key}") from exc

    @staticmethod
    def _pread_into(fd: int, view: memoryview, offset: int) -> int:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                break
            done += n
        return done

    def size(self, key: str) -> int:
        try:
            st = os.stat(self._path(check_key(key)))
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise self._translate(exc, f"stat of {key}") from exc
        if not stat.S_ISREG(st.st_mode):
            raise FileNotFoundError(f"{key} in {self.url} is a directory, not an object")
        return st.st_size

    def get_into(self, key: str, out: memoryview, start: int = 0) -> int:
        path = self._path(check_key(key))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise self._translate(exc, f"reading {key}") from exc
        try:
            return self._pread_into(fd, memoryview(out).cast("B"), start)
        except OSError as exc:
            raise self._translate(exc, f"reading {key}") from exc
        finally:
            os.close(fd)

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._path(check_key(key)))

    def list_dir(self, prefix: str) -> list[str]:
        path = self._path(prefix.strip("/"))
        try:
            names = os.listdir(path)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            return []
        except OSError as exc:
            raise self._translate(exc, f"listing {prefix}") from exc
        return sorted(n for n in names if ".tmp-" not in n)

    def list_objects(self, prefix: str) -> dict[str, ObjectInfo]:
        base = self._path(prefix.strip("/"))
        out: dict[str, ObjectInfo] = {}
        if os.path.isfile(base):
            st = os.stat(base)
            return {prefix.strip("/"): ObjectInfo(st.st_size, st.st_mtime)}
        for dirpath, _dirs, files in os.walk(base):
            for f in files:
                if ".tmp-" in f:  # a put in progress (or one that crashed): not an object
                    continue
                full = os.path.join(dirpath, f)
                try:
                    st = os.stat(full)
                except FileNotFoundError:  # deleted since the walk saw it
                    continue
                out[os.path.relpath(full, self.root).replace(os.sep, "/")] = ObjectInfo(
                    st.st_size, st.st_mtime)
        return out

    def delete(self, keys: Iterable[str]) -> None:
        for k in keys:
            _unlink_quiet(self._path(check_key(k)))

    def delete_prefix(self, prefix: str) -> int:
        import shutil

        path = self._path(prefix.strip("/"))
        n = len(self.list_files(prefix))
        if os.path.isdir(path) and path == self.root:
            for name in os.listdir(path):
                child = os.path.join(path, name)
                if os.path.isdir(child):
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    _unlink_quiet(child)
            _fsync_dir(path)
        elif os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            _fsync_dir(os.path.dirname(path))
        elif os.path.exists(path):
            _unlink_quiet(path)
        with self._dir_lock:
            self._known_dirs = {d for d in self._known_dirs if not d.startswith(path)}
        return n


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        raise StorageError(
            f"fsync of directory {path} failed ({exc}); new entries may not be durable, so "
            "this checkpoint is failed. Check the disk and retry the save."
        ) from exc
    finally:
        os.close(fd)


def _unlink_quiet(path: str) -> None:
    """Remove a temporary file on an error path, never masking that error: whatever
    fails here (the file was never created, its directory is gone or is a file) is moot."""
    try:
        os.unlink(path)
    except OSError:
        pass
