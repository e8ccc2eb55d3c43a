"""Staging memory owned by the daemon.

:class:`Segment` is a shared-memory segment for a client on this node: an anonymous
``memfd`` created here, sized, pre-faulted (``posix_fallocate``, so its pages are charged
to the daemon's memory cgroup and the client's first copy does not fault) and sealed with
``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`` so nobody -- in particular the client it is
handed to -- can resize it.  A client therefore cannot make the daemon's mapping fault
(SIGBUS), which a file the client could truncate would allow.  For a save segment the
daemon keeps its own read-only mapping and writes chunks straight from it; for a read
segment (``writable``) its mapping is writable and ReadIntoSegment reads storage objects
straight into it (:meth:`Segment.write_view`), while the client maps it read-only.

:class:`StreamBuffer` is the daemon-side buffer of a remote client's streamed save (an
anonymous private mapping, freed when the save's bytes are durable).

Both are created and closed from worker threads or the event loop; neither is shared
between threads while in use.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat

from ckptd.errors import StagingError

log = logging.getLogger("ckptd.daemon")

SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
ALIGN = 1 << 20


def segment_size(nbytes: int) -> int:
    """Size of a segment for a save of ``nbytes``: 1/64 headroom (extra state grows a
    little between saves), rounded up to 1 MiB, at least 1 MiB."""
    want = nbytes + (nbytes >> 6)
    return max(ALIGN, -(-want // ALIGN) * ALIGN)


def read_segment_size(nbytes: int) -> int:
    """Size of a read segment (ReadIntoSegment's target): ``nbytes`` rounded up to 1 MiB."""
    return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)


class Segment:
    """A sealed memfd segment and the daemon's read-only mapping of it."""

    def __init__(self, segment_id: str, size: int, fd: int, mm: mmap.mmap,
                 writable: bool = False) -> None:
        self.id = segment_id
        self.size = size
        self.fd = fd
        self.mm: mmap.mmap | None = mm
        self.writable = writable

    @classmethod
    def create(cls, segment_id: str, size: int, name: str, writable: bool = False) -> Segment:
        """Create, pre-fault and seal a segment (blocking: call from a worker thread).
        ``writable``: the daemon's mapping may be written (a read segment)."""
        fd = os.memfd_create(f"ckptd-{name}"[:240], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise StagingError(
                    f"cannot allocate a {size}-byte staging segment ({exc}); the node is out "
                    "of memory for staging: lower --staging-bytes or free memory"
                ) from exc
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        except BaseException:
            os.close(fd)
            raise
        return cls(segment_id, size, fd, mm, writable)

    def check(self) -> None:
        """Verify (fstat, seals) that the segment still has the size the daemon maps."""
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != self.size:
            raise StagingError(
                f"staging segment {self.id} has size {st.st_size}, expected {self.size}")
        seals = fcntl.fcntl(self.fd, fcntl.F_GET_SEALS)
        if seals & SEALS != SEALS:
            raise StagingError(f"staging segment {self.id} lost its seals ({seals:#x})")

    def view(self, nbytes: int) -> memoryview:
        if self.mm is None:
            raise StagingError(f"staging segment {self.id} was already freed")
        if nbytes > self.size:
            raise StagingError(
                f"save needs {nbytes} bytes but staging segment {self.id} holds {self.size}")
        return memoryview(self.mm)[:nbytes]

    def write_view(self, offset: int, length: int) -> memoryview:
        """The writable bytes ``[offset, offset + length)`` of a read segment."""
        if self.mm is None:
            raise StagingError(f"staging segment {self.id} was already freed")
        if not self.writable:
            raise StagingError(f"staging segment {self.id} is a save segment, not a read "
                               "segment")
        if offset < 0 or length < 0 or offset + length > self.size:
            raise StagingError(
                f"bytes [{offset}, {offset + length}) lie outside staging segment {self.id} of "
                f"{self.size} bytes")
        return memoryview(self.mm)[offset:offset + length]

    def close(self) -> None:
        """Unmap and close.  A mapping still exported (a view kept by a traceback) is left
        to the garbage collector instead of raising."""
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                log.debug("segment %s: mapping still referenced; freed by the GC", self.id)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class StreamBuffer:
    """Daemon-side buffer receiving a remote client's staged bytes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.mm: mmap.mmap | None = mmap.mmap(-1, max(1, size))
        self.filled = 0

    def append(self, data: bytes) -> None:
        if self.mm is None:
            raise StagingError("stream buffer was already freed")
        end = self.filled + len(data)
        if end > self.size:
            raise StagingError(
                f"SaveStream sent more than the {self.size} bytes its header declared")
        self.mm[self.filled:end] = data
        self.filled = end

    def view(self, nbytes: int) -> memoryview:
        assert self.mm is not None
        return memoryview(self.mm)[:nbytes]

    def close(self) -> None:
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass
