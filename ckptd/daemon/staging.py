"""The staging pool: client sessions, their segments, and the node-wide byte budget.

Lives on the daemon's event loop (not thread-safe); blocking work (creating and
pre-faulting a segment) runs in the default executor.

Lifecycle of a shared-memory segment (one client session, reused across saves)::

    AcquireStaging ──> NEW ──fetch over the fd socket──> IDLE ──Save──> LENT
                                                          ^               │ bytes durable
                                                          └───────────────┘ (give_back)
    ReleaseStaging / session closed: NEW or IDLE -> freed at once; LENT -> freed when the
    in-flight write gives it back (a segment a write still uses is never freed).

A read segment (kind ``read``, AcquireStaging with SEGMENT_USE_READ) is never lent: it is
NEW until fetched, then IDLE, and ReadIntoSegment calls write into it meanwhile.  Each
range being read holds it (``Slot.readers``, :meth:`StagingPool.begin_read` /
:meth:`StagingPool.end_read`); freeing it (ReleaseStaging, the session closing) while
ranges are still being read only marks it ``doomed``, and the last reader frees it: the
daemon never unmaps memory a read thread is writing.

A session is alive while its fd-socket connection is open; the connection closing (the
client exited or was killed) closes the session.  A stream reservation (remote clients)
holds budget bytes from AcquireStaging until its SaveStream's bytes are durable, or
expires unused after :data:`RESERVATION_TTL` seconds.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from dataclasses import dataclass, field

from ckptd.daemon import logs
from ckptd.daemon.budget import ByteBudget
from ckptd.daemon.config import MAX_SESSIONS
from ckptd.daemon.metrics import Metrics
from ckptd.daemon.rpcerrors import REASON_SESSION_UNKNOWN, RpcFailure
from ckptd.daemon.segments import Segment, StreamBuffer, read_segment_size, segment_size
from ckptd.errors import StagingError

RESERVATION_TTL = 600.0
ATTACH_TTL = 120.0          # a Unix session must attach its fd connection within this
REMOTE_SESSION_TTL = 6 * 3600.0
MAX_SEGMENTS_PER_SESSION = 4

NEW, IDLE, LENT, FREED = "new", "idle", "lent", "freed"


@dataclass(eq=False)
class Slot:
    """A segment (shared memory) or a stream reservation, charged to the budget."""

    id: str
    session: Session
    size: int
    kind: str                      # "shm" (save), "read" (ReadIntoSegment) or "stream"
    state: str = NEW
    segment: Segment | None = None
    stream: StreamBuffer | None = None
    created: float = field(default_factory=time.monotonic)
    readers: int = 0               # ranges of ReadIntoSegment calls writing into it now
    doomed: bool = False           # freed as soon as the last reader is done


@dataclass(eq=False)
class Session:
    id: str
    secret: bytes
    job: str
    rank: int
    world_size: int
    local: bool                    # registered over the Unix socket
    pid: int = 0
    host: str = ""
    attached: bool = False
    closed: bool = False
    peer_pid: int | None = None
    created: float = field(default_factory=time.monotonic)
    last_seen: float = field(default_factory=time.monotonic)
    slots: dict[str, Slot] = field(default_factory=dict)

    def describe(self) -> str:
        pid = self.peer_pid or self.pid
        return f"job {self.job} rank {self.rank}/{self.world_size} pid {pid}"


def _unknown_session(session_id: str) -> RpcFailure:
    return RpcFailure(
        "NOT_FOUND", StagingError,
        f"session {session_id[:12]}... is unknown to this daemon (it restarted, or the session "
        "expired or was closed); register again", REASON_SESSION_UNKNOWN)


class StagingPool:
    def __init__(self, budget: ByteBudget, metrics: Metrics) -> None:
        self.budget = budget
        self.metrics = metrics
        self.sessions: dict[str, Session] = {}
        metrics.staging_budget.set(budget.capacity)

    # -- sessions ------------------------------------------------------------------------
    def register(self, job: str, rank: int, world_size: int, *, local: bool, pid: int = 0,
                 host: str = "") -> Session:
        if len(self.sessions) >= MAX_SESSIONS:
            self.expire(force=True)
            if len(self.sessions) >= MAX_SESSIONS:
                raise RpcFailure("RESOURCE_EXHAUSTED", StagingError,
                                 f"the daemon already has {MAX_SESSIONS} sessions")
        s = Session(secrets.token_hex(16), secrets.token_bytes(32), job, rank, world_size,
                    local, pid, host)
        self.sessions[s.id] = s
        self.metrics.sessions.set(len(self.sessions))
        logs.event("session registered", event="session", state="registered", job=job,
                   rank=rank, world_size=world_size, pid=pid, host=host, local=local)
        return s

    def get(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None or s.closed:
            raise _unknown_session(session_id)
        s.last_seen = time.monotonic()
        return s

    def local_ranks(self, job: str, world_size: int) -> int:
        """How many ranks of ``job`` (at ``world_size``) stage in shared memory on this node:
        distinct ranks of its open sessions that hold a segment."""
        return len({s.rank for s in self.sessions.values()
                    if s.job == job and s.world_size == world_size and s.local and not s.closed
                    and any(x.kind == "shm" for x in s.slots.values())})

    def attach(self, session_id: str, secret: bytes, peer_pid: int | None) -> Session:
        s = self.sessions.get(session_id)
        if s is None or s.closed or not hmac.compare_digest(s.secret, secret):
            raise StagingError("unknown session or wrong session secret")
        if s.attached:
            raise StagingError("session already has an fd connection")
        s.attached = True
        s.peer_pid = peer_pid
        return s

    def close_session(self, s: Session, why: str) -> None:
        if s.closed:
            return
        s.closed = True
        self.sessions.pop(s.id, None)
        lent = 0
        total = len(s.slots)
        for slot in list(s.slots.values()):
            if slot.state == LENT:
                lent += 1       # freed by give_back when its write finishes
            else:
                self._free(slot)
        self.metrics.sessions.set(len(self.sessions))
        logs.event(f"session closed ({why})", event="session", state="closed", job=s.job,
                   rank=s.rank, pid=s.peer_pid or s.pid, reclaimed=total - lent,
                   still_writing=lent)

    def expire(self, force: bool = False) -> None:
        """Close sessions that never attached or went quiet; drop stale reservations."""
        now = time.monotonic()
        for s in list(self.sessions.values()):
            if s.local and not s.attached and now - s.created > ATTACH_TTL:
                self.close_session(s, "fd connection never attached")
            elif not s.local and not any(x.state == LENT for x in s.slots.values()) and (
                    now - s.last_seen > REMOTE_SESSION_TTL or force):
                self.close_session(s, "idle remote session")
            else:
                for slot in list(s.slots.values()):
                    if slot.kind == "stream" and slot.state == NEW and (
                            now - slot.created > RESERVATION_TTL):
                        self._free(slot)

    # -- slots ---------------------------------------------------------------------------
    async def acquire(self, s: Session, nbytes: int, wait: bool, shm: bool,
                      timeout: float | None, read: bool = False) -> Slot:
        """A segment (``shm``; for ReadIntoSegment if ``read``) or a stream reservation."""
        if nbytes < 0:
            raise StagingError(f"nbytes must be >= 0, got {nbytes}")
        if read and not shm:
            raise StagingError("a read segment is shared memory: use transfer="
                               "TRANSFER_SHARED_MEMORY with SEGMENT_USE_READ")
        if shm and not s.local:
            raise RpcFailure("FAILED_PRECONDITION", StagingError,
                             "shared-memory staging is only offered over the Unix socket; "
                             "use transfer=STREAM over TCP")
        if shm and not s.attached:
            raise RpcFailure("FAILED_PRECONDITION", StagingError,
                             "attach the session's fd connection before acquiring shared "
                             "memory")
        if len(s.slots) >= MAX_SEGMENTS_PER_SESSION:
            raise StagingError(
                f"session holds {len(s.slots)} staging segments already (at most "
                f"{MAX_SEGMENTS_PER_SESSION}); release one first")
        size = (read_segment_size(nbytes) if read else segment_size(nbytes)) if shm else nbytes
        if shm and not read:
            self._check_fits_next_to_job(s, size)
        await self.budget.acquire(size, wait=wait, timeout=timeout)  # BackpressureError: busy
        self.metrics.staging_in_use.set(self.budget.in_use)
        slot = Slot(secrets.token_hex(8), s, size,
                    ("read" if read else "shm") if shm else "stream")
        if shm:
            try:
                slot.segment = await asyncio.get_running_loop().run_in_executor(
                    None, Segment.create, slot.id, size,
                    f"{s.job}-{s.rank}{'-read' if read else ''}", read)
            except BaseException:
                self.budget.release(size)
                self.metrics.staging_in_use.set(self.budget.in_use)
                raise
            self.metrics.segments.inc()
        if s.closed:  # the client went away while we waited
            self._free(slot)
            raise _unknown_session(s.id)
        s.slots[slot.id] = slot
        return slot

    def _check_fits_next_to_job(self, s: Session, size: int) -> None:
        """A save segment for ``s`` must fit the budget next to the save segments the
        other ranks of its job on this node hold: clients keep theirs for reuse and never
        give them back while they train, so waiting for that room (or skipping until it
        frees) would wait forever -- the ranks of one job train in lockstep.  Only for a
        session's first save segment: one that holds a segment can wait for its own."""
        if any(x.kind == "shm" and x.state != FREED for x in s.slots.values()):
            return
        held: dict[int, int] = {}
        for o in self.sessions.values():
            if o is s or o.closed or o.job != s.job:
                continue
            n = sum(x.size for x in o.slots.values() if x.kind == "shm" and x.state != FREED)
            if n:
                held[o.rank] = held.get(o.rank, 0) + n
        if held and size + sum(held.values()) > self.budget.capacity:
            need = size + sum(held.values())
            raise StagingError(
                f"rank {s.rank} of job {s.job!r} needs a {size}-byte staging segment, and "
                f"ranks {sorted(held)} of the job on this node keep {sum(held.values())} bytes "
                f"of segments for their saves: {need} bytes, more than the node's staging "
                f"budget of {self.budget.capacity} bytes, so this rank could never stage. "
                "Raise `ckptd serve --staging-bytes` to at least the per-rank shard size times "
                "the ranks of the job on this node (x2 for two saves in flight)")

    def _slot(self, s: Session, slot_id: str) -> Slot:
        slot = s.slots.get(slot_id)
        if slot is None:
            raise RpcFailure("NOT_FOUND", StagingError,
                             f"staging segment {slot_id!r} does not belong to this session")
        return slot

    def fetch(self, s: Session, slot_id: str) -> Segment:
        """The segment to send to its client (once)."""
        slot = self._slot(s, slot_id)
        if slot.kind not in ("shm", "read") or slot.state != NEW or slot.segment is None:
            raise StagingError(f"segment {slot_id!r} was already fetched")
        slot.state = IDLE
        return slot.segment

    def begin_read(self, s: Session, slot_id: str) -> Slot:
        """Hold read segment ``slot_id`` of session ``s`` for one range that a read thread
        will write into; pair with one :meth:`end_read`."""
        slot = self._slot(s, slot_id)
        if slot.kind != "read":
            raise RpcFailure("FAILED_PRECONDITION", StagingError,
                             f"segment {slot_id!r} is a {slot.kind} segment, not a read segment: "
                             "acquire one with use=SEGMENT_USE_READ for ReadIntoSegment")
        if slot.state != IDLE or slot.doomed or slot.segment is None:
            now = "being released" if slot.doomed else slot.state
            raise RpcFailure("FAILED_PRECONDITION", StagingError,
                             f"read segment {slot_id!r} is {now}, expected idle: fetch it over "
                             "the fd socket first")
        slot.readers += 1
        return slot

    def end_read(self, slot: Slot) -> None:
        """A read thread is done writing into ``slot``; frees it if it was released meanwhile."""
        slot.readers -= 1
        if slot.readers == 0 and slot.doomed:
            self._free(slot)

    def release(self, s: Session, slot_id: str) -> None:
        slot = s.slots.get(slot_id)
        if slot is None:
            return
        if slot.state == LENT:
            raise RpcFailure("FAILED_PRECONDITION", StagingError,
                             f"segment {slot_id!r} is lent to an in-flight save; it comes back "
                             "when the save's bytes are durable")
        self._free(slot)

    def lend(self, s: Session, slot_id: str, kind: str) -> Slot:
        slot = self._slot(s, slot_id)
        if slot.kind != kind:
            raise StagingError(f"segment {slot_id!r} is a {slot.kind} slot, not {kind}")
        want = IDLE if kind == "shm" else NEW
        if slot.state != want:
            raise RpcFailure("FAILED_PRECONDITION", StagingError,
                             f"segment {slot_id!r} is {slot.state}, expected {want}: a save "
                             "may only hand over a segment the client holds")
        slot.state = LENT
        return slot

    def give_back(self, slot: Slot) -> None:
        """A save is done with ``slot`` (its bytes are durable, or it failed)."""
        if slot.state != LENT:
            return
        if slot.kind == "shm" and not slot.session.closed:
            slot.state = IDLE
            return
        self._free(slot)

    def _free(self, slot: Slot) -> None:
        if slot.state == FREED:
            return
        if slot.readers:
            slot.doomed = True   # end_read frees it: a read thread still writes into it
            return
        slot.state = FREED
        slot.session.slots.pop(slot.id, None)
        if slot.segment is not None:
            slot.segment.close()
            slot.segment = None
            self.metrics.segments.dec()
        if slot.stream is not None:
            slot.stream.close()
            slot.stream = None
        self.budget.release(slot.size)
        self.metrics.staging_in_use.set(self.budget.in_use)

    def close(self) -> None:
        for s in list(self.sessions.values()):
            for slot in list(s.slots.values()):
                if slot.state != LENT:
                    self._free(slot)
