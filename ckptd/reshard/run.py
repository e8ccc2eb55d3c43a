"""The reshard executor: runs a :class:`~ckptd.reshard.plan.ReshardPlan` against storage.

Order of work (one process, or every worker of a ``torchrun`` job):

1. resolve the committed source step and read its index; rank 0 of the workers picks a
   new attempt id and broadcasts it; every worker computes the same plan;
2. each worker runs its share of the tasks (:func:`~ckptd.reshard.plan.assign_tasks`:
   whole arrays and packs per worker) on a thread pool of ``threads`` tasks at a time.
   A task fetches its source byte ranges (``ahead`` fetches in flight), records the
   crc32c of every fetched unit segment, places the bytes into one reused output buffer,
   checksums it and writes the destination object;
3. each worker writes the ``zarr.json`` of its arrays and makes everything it wrote
   durable; the workers' results (object checksums, checksum parts) are gathered on
   worker 0, which checks that every source unit's parts combine to its recorded crc32c,
   writes the ``N`` rank manifests, and runs the commit protocol
   (:func:`ckptd.format.commit.try_commit`), which writes ``COMMITTED`` last.

Nothing is committed unless every object was written and every byte read was verified;
a crash at any point leaves at most an uncommitted attempt (removed by ``ckptd gc`` after
its grace period), and the source attempt is never written to.

Memory: each of the ``threads`` running tasks holds one output object (one destination
chunk = one rank's shard of one tensor at ``N``, or one rank's pack) plus at most
``ahead`` fetches of at most ``max_fetch`` bytes (32 MiB).  Peak is therefore about
``threads * (largest destination object + ahead * max_fetch)``, independent of the
checkpoint's size.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptd.errors import CkptdError, ConfigError, CorruptCheckpointError, StorageError
from ckptd.format import paths
from ckptd.format.checksum import crc32c, crc32c_zeros, zeros
from ckptd.format.commit import read_commit, read_index, resolve_step, try_commit
from ckptd.format.manifest import ChunkRecord, RankManifest, TensorRecord, dumps
from ckptd.format.plan import DEFAULT_PACK_THRESHOLD
from ckptd.format.zarr_meta import array_doc
from ckptd.reshard.crc import combine_parts
from ckptd.reshard.plan import (
    DEFAULT_MAX_FETCH,
    Fetch,
    ObjectTask,
    Place,
    ReshardPlan,
    Unit,
    VerifyTask,
    assign_tasks,
    plan_reshard,
)
from ckptd.storage.base import StorageBackend

log = logging.getLogger("ckptd.reshard")


# --------------------------------------------------------------------------- verification


class Verifier:
    """Collects (unit, lo, hi, crc32c) parts and checks each unit once it is complete.

    Thread-safe.  ``expected`` is the number of segments each unit has in the whole plan;
    a unit is checked as soon as that many parts arrived (so a local run fails fast), and
    :meth:`finish` checks that every unit is complete.
    """

    def __init__(self, units: list[Unit], expected: dict[int, int]) -> None:
        self.units = units
        self.expected = expected
        self._parts: dict[int, list[tuple[int, int, int]]] = {}
        self._done: set[int] = set()
        self._lock = threading.Lock()

    def add(self, unit: int, lo: int, hi: int, crc: int) -> None:
        with self._lock:
            parts = self._parts.setdefault(unit, [])
            parts.append((lo, hi - lo, crc))
            if len(parts) < self.expected.get(unit, 0):
                return
            self._done.add(unit)
            parts = self._parts.pop(unit)
        self._check(unit, parts)

    def _check(self, unit: int, parts: list[tuple[int, int, int]]) -> None:
        u = self.units[unit]
        parts.sort()
        try:
            crc, end = combine_parts(parts)
        except ValueError:
            raise CorruptCheckpointError(
                f"{u.what}: the reshard read overlapping or missing ranges of it (planner bug)"
            ) from None
        if end != u.nbytes:
            raise CorruptCheckpointError(
                f"{u.what}: read {end} bytes, expected {u.nbytes} ({u.key})"
            )
        if crc != u.crc32c:
            raise CorruptCheckpointError(
                f"checksum mismatch in {u.what} ({u.key}): expected crc32c {u.crc32c:#010x}, "
                f"found {crc:#010x}. The source checkpoint is corrupt; nothing was committed. "
                "Run `ckptd verify` on it."
            )

    @property
    def verified(self) -> int:
        with self._lock:
            return len(self._done)

    def pending_parts(self) -> list[tuple[int, int, int, int]]:
        with self._lock:
            return [(u, lo, lo + n, c) for u, ps in self._parts.items() for lo, n, c in ps]

    def finish(self) -> None:
        with self._lock:
            missing = [u for u in self.expected if u not in self._done]
        if missing:
            u = self.units[missing[0]]
            raise CorruptCheckpointError(
                f"{len(missing)} source ranges were not fully read and verified (first: "
                f"{u.what}); nothing was committed"
            )


def expected_segments(plan: ReshardPlan) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in plan.tasks:
        for f in t.fetches:
            for s in f.segments:
                out[s.unit] = out.get(s.unit, 0) + 1
    return out


# --------------------------------------------------------------------------- execution


class _Buffers(threading.local):
    buf: bytearray | None = None

    def get(self, n: int) -> memoryview:
        if self.buf is None or len(self.buf) < n:
            self.buf = None
            self.buf = bytearray(max(n, 1))  # touched once, then reused
        return memoryview(self.buf)[:n]


def _place(p: Place, data: memoryview, out: memoryview) -> None:
    if p.contiguous:
        d0, d1 = p.dst_byte_range()
        out[d0:d1] = data[p.src_offset:p.src_offset + (d1 - d0)]
        return
    import numpy as np  # only for boxes that are not one byte range (~60 ms of start-up)

    isz = p.itemsize
    n_src = int(np.prod(p.src_shape, dtype=np.int64)) * isz
    src = np.frombuffer(data, dtype=np.uint8, count=n_src, offset=p.src_offset).reshape(
        *p.src_shape, isz)
    n_dst = int(np.prod(p.dst_shape, dtype=np.int64)) * isz
    dst = np.frombuffer(out, dtype=np.uint8, count=n_dst, offset=p.dst_offset).reshape(
        *p.dst_shape, isz)
    s_sl = tuple(slice(o, o + s) for o, s in zip(p.src_box.offsets, p.src_box.shape))
    d_sl = tuple(slice(o, o + s) for o, s in zip(p.dst_box.offsets, p.dst_box.shape))
    dst[d_sl] = src[s_sl]


_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[[int], object] | None:
    """``sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)`` (Linux): start writing a file's
    dirty pages now without waiting, so the final fsyncs find little left to do.  Only a
    hint: its result is ignored (the fsyncs decide durability)."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return lambda fd: fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


_start_writeback = _load_sync_file_range()


class _DeferredLocalWriter:
    """Writes objects under a local root without an fsync per object, then makes them all
    durable at once (:meth:`sync`): every file and every directory on their paths is
    fsynced, 16 at a time.  Each object is still written to a temporary name and renamed
    into place, so a reader never sees a partial object.

    Only used for destination objects of a reshard, which nothing references until the
    manifests are written, and :meth:`sync` runs before that; per-object fsyncs made the
    copy ~25% slower on the project's machine.  A failed fsync fails the reshard (it is
    never retried).
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._files: list[str] = []

    def put(self, key: str, data: Any) -> None:
        from ckptd.storage.base import check_key

        path = os.path.join(self.root, check_key(key))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        parts = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                for part in parts:
                    view = memoryview(part).cast("B")
                    while view:
                        view = view[os.write(fd, view):]
                if _start_writeback is not None:
                    _start_writeback(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise StorageError(f"writing {key} under {self.root} failed: {exc}") from exc
        with self._lock:
            self._files.append(path)

    def sync(self, prefix: str) -> None:
        """fsync every file written and every directory from them up to ``root/prefix``'s
        parent (new directories' entries included)."""
        stop = os.path.dirname(os.path.join(self.root, prefix))
        dirs: set[str] = set()
        for f in self._files:
            d = os.path.dirname(f)
            while d.startswith(stop) and d not in dirs:
                dirs.add(d)
                if d == stop:
                    break
                d = os.path.dirname(d)

        def fsync(path: str) -> None:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
            try:
                os.fsync(fd)
            except OSError as exc:
                raise StorageError(
                    f"fsync of {path} failed ({exc}); the resharded objects may not be "
                    "durable, so nothing is committed. Check the disk and run it again."
                ) from exc
            finally:
                os.close(fd)

        with ThreadPoolExecutor(max_workers=16, thread_name_prefix="ckptd-reshard-sync") as p:
            list(p.map(fsync, self._files + sorted(dirs, key=len, reverse=True)))


@dataclasses.dataclass
class TaskResult:
    crc32c: int | None = None
    piece_crcs: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    read: int = 0
    written: int = 0


class Executor:
    """Runs tasks of one plan: reads from ``src`` under ``src_prefix``, writes to ``dst``
    under ``dst_prefix``.  ``threads`` tasks run at once; each keeps ``ahead`` fetches in
    flight on a shared I/O pool."""

    def __init__(self, src: StorageBackend, src_prefix: str, dst: StorageBackend | None,
                 dst_prefix: str, verifier: Verifier, *, threads: int = 8, ahead: int = 2,
                 on_bytes: Callable[[int], None] | None = None) -> None:
        self.src, self.src_prefix = src, src_prefix
        self.dst, self.dst_prefix = dst, dst_prefix
        self.verifier = verifier
        self.threads = max(1, threads)
        self.ahead = max(1, ahead)
        self.on_bytes = on_bytes
        self._buffers = _Buffers()
        from ckptd.storage.fsspec_backend import LocalBackend

        self._deferred = (_DeferredLocalWriter(dst.root) if isinstance(dst, LocalBackend)
                          else None)
        self._io = ThreadPoolExecutor(max_workers=self.threads * self.ahead,
                                      thread_name_prefix="ckptd-reshard-io")

    def close(self) -> None:
        self._io.shutdown(wait=True)

    def _get(self, f: Fetch, into: memoryview | None = None) -> memoryview:
        """Bytes ``[f.lo, f.hi)`` of the source object, with its unit segments' crc32c
        recorded.  ``into`` (``f.nbytes`` long) receives the bytes if given, through the
        backend's ``get_into`` (on a local disk: read in place, no intermediate buffer)."""
        key = f"{self.src_prefix}/{f.key}"
        n = f.hi - f.lo
        try:
            if into is not None:
                mv = into
                got = self.src.get_into(key, into, f.lo)
            else:
                data = self.src.get(key, f.lo, f.hi)
                got = len(data)
                mv = memoryview(data)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"source object {key} is missing; the checkpoint is damaged. Run `ckptd "
                "verify`; nothing was committed."
            ) from None
        if got != n:
            raise CorruptCheckpointError(
                f"source object {key}: expected bytes [{f.lo}, {f.hi}), got {got} bytes; "
                "the object is truncated. Nothing was committed."
            )
        for s in f.segments:
            a = self.verifier.units[s.unit].start + s.lo - f.lo
            self.verifier.add(s.unit, s.lo, s.hi, crc32c(mv[a:a + (s.hi - s.lo)]))
        return mv

    def fetch_all(self, fetches: list[Fetch],
                  consume: Callable[[int, memoryview], None] | None,
                  into: Callable[[int], memoryview | None] | None = None) -> int:
        """Fetch in order with ``ahead`` in flight; ``consume(i, data)`` in order.

        ``into(i)`` may name where fetch ``i``'s bytes go (then they are read there)."""
        pending: deque[tuple[int, Future]] = deque()
        nxt = 0
        total = 0
        try:
            while nxt < len(fetches) or pending:
                while nxt < len(fetches) and len(pending) < self.ahead:
                    dst = into(nxt) if into is not None else None
                    pending.append((nxt, self._io.submit(self._get, fetches[nxt], dst)))
                    nxt += 1
                i, fut = pending.popleft()
                data = fut.result()
                total += len(data)
                if consume is not None:
                    consume(i, data)
                del data
        finally:
            for _, fut in pending:
                fut.cancel()
            for _, fut in pending:
                try:
                    fut.result()
                except BaseException:  # noqa: BLE001, S110 - the first error is already raised
                    pass
        return total

    def fill(self, fetches: list[Fetch], places: list[Place], out: memoryview) -> int:
        """Fetch ``fetches`` and place their bytes into ``out``; returns bytes read.

        Bytes of ``out`` that no place covers are zeroed.  A fetch whose bytes are exactly
        one contiguous range of ``out`` is read straight into it."""
        by_fetch: dict[int, list[Place]] = {}
        covered = 0
        for p in places:
            by_fetch.setdefault(p.fetch, []).append(p)
            covered += p.nbytes
        if covered != len(out):  # pack alignment gaps must be zero
            out[:] = zeros(len(out))
        direct: dict[int, memoryview] = {}
        for i, ps in by_fetch.items():
            if len(ps) == 1 and ps[0].contiguous and ps[0].src_offset == 0 and (
                    ps[0].nbytes == fetches[i].nbytes):
                d0, d1 = ps[0].dst_byte_range()
                direct[i] = out[d0:d1]

        def consume(i: int, data: memoryview) -> None:
            if i in direct:
                return
            for p in by_fetch.get(i, ()):
                _place(p, data, out)

        return self.fetch_all(fetches, consume, direct.get)

    def run_object(self, t: ObjectTask) -> TaskResult:
        out = self._buffers.get(t.nbytes)
        read = self.fill(t.fetches, t.places, out)
        crc = crc32c(out)
        res = TaskResult(read=read)
        res.piece_crcs = [(name, pi, crc32c(out[lo:hi])) for name, pi, lo, hi in t.piece_crcs]
        key = f"{self.dst_prefix}/{t.key}"
        assert self.dst is not None
        put = self._deferred.put if self._deferred is not None else self.dst.put
        if t.pad:
            res.crc32c = crc32c_zeros(t.pad, crc)
            put(key, [out, zeros(t.pad)])
        else:
            res.crc32c = crc
            put(key, out)
        res.written = t.nbytes + t.pad
        if self.on_bytes is not None:
            self.on_bytes(res.written)
        return res

    def run_verify(self, t: VerifyTask) -> TaskResult:
        return TaskResult(read=self.fetch_all(t.fetches, None))

    def write_metadata(self, plan: ReshardPlan, arrays: set[str]) -> None:
        """The ``zarr.json`` of every array in ``arrays`` (the ones this worker wrote)."""
        metas: dict[str, Any] = {}
        for rp in plan.ranks:
            metas.update({k: m for k, m in rp.array_meta.items() if k in arrays})
        assert self.dst is not None
        put = self._deferred.put if self._deferred is not None else self.dst.put

        def one(item: tuple[str, Any]) -> None:
            name, m = item
            put(f"{self.dst_prefix}/{name}/zarr.json",
                dumps(array_doc(m.shape, m.dtype, m.chunk_shape)))

        list(self._io.map(one, sorted(metas.items())))

    def sync(self) -> None:
        """Make every object written so far durable (a no-op unless writes were deferred)."""
        if self._deferred is not None:
            self._deferred.sync(self.dst_prefix)

    def run_task(self, t: ObjectTask | VerifyTask) -> TaskResult:
        return self.run_object(t) if isinstance(t, ObjectTask) else self.run_verify(t)

    def run(self, tasks: list[ObjectTask | VerifyTask]) -> list[TaskResult]:
        """Run ``tasks``; raises the first error (after cancelling what has not started)."""
        with ThreadPoolExecutor(max_workers=self.threads,
                                thread_name_prefix="ckptd-reshard") as pool:
            futs = [pool.submit(self.run_task, t) for t in tasks]
            results: list[TaskResult] = []
            try:
                for f in futs:
                    results.append(f.result())
            except BaseException:
                for f in futs:
                    f.cancel()
                raise
        return results


# --------------------------------------------------------------------------- workers


@dataclasses.dataclass(frozen=True)
class Workers:
    """This process's place among the reshard workers (torchrun), or a single worker."""

    rank: int = 0
    size: int = 1

    @staticmethod
    def detect() -> Workers:
        """torch.distributed's rank/world if initialized; else start a gloo group when run
        under torchrun (``WORLD_SIZE`` > 1 and torchrun's ``TORCHELASTIC_RUN_ID``); else a
        single worker.  A single worker never imports torch (a group can only be initialized
        if torch is imported already).

        ``WORLD_SIZE`` alone is not enough: a training job's launcher (a Kubernetes
        PyTorchJob, a batch script) exports ``WORLD_SIZE``/``RANK``/``MASTER_*`` to every
        shell of its containers, and an operator's ``ckptd reshard`` there would wait for
        workers that never come, or join the training job's rendezvous store.
        """
        if "torch.distributed" in sys.modules:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return Workers(dist.get_rank(), dist.get_world_size())
        world = os.environ.get("WORLD_SIZE", "1") or "1"
        if world.isdigit() and int(world) > 1:
            if "TORCHELASTIC_RUN_ID" not in os.environ:
                log.warning(
                    "WORLD_SIZE=%s is set, but not by torchrun: running as a single reshard "
                    "worker (to split the work, run the command under torchrun)", world)
                return Workers()
            import torch.distributed as dist

            dist.init_process_group("gloo")
            return Workers(dist.get_rank(), dist.get_world_size())
        return Workers()

    def broadcast_str(self, value: str) -> str:
        if self.size == 1:
            return value
        import torch
        import torch.distributed as dist

        buf = torch.zeros(128, dtype=torch.uint8)
        if self.rank == 0:
            raw = value.encode()[:128]
            buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        dist.broadcast(buf, src=0)
        return bytes(buf.tolist()).rstrip(b"\0").decode()

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        if self.size == 1:
            return [data]
        import torch
        import torch.distributed as dist

        n = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(sizes, n)
        m = max(int(s.item()) for s in sizes)
        buf = torch.zeros(max(m, 1), dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        outs = [torch.zeros(max(m, 1), dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(outs, buf)
        return [bytes(o[:int(s.item())].tolist()) if int(s.item()) else b""
                for o, s in zip(outs, sizes)]


# --------------------------------------------------------------------------- the command


@dataclasses.dataclass
class ReshardResult:
    job: str
    step: int
    source_attempt: str
    source_world_size: int
    out: str  # destination storage URL
    out_job: str
    attempt: str
    world_size: int
    in_place: bool
    objects: int
    bytes_read: int
    bytes_written: int
    seconds: float
    workers: int
    phases: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["throughput_mb_s"] = round(self.bytes_written / 1e6 / max(self.seconds, 1e-9), 1)
        return d


def new_attempt_id(world_size: int) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    return paths.check_attempt(f"reshard-w{world_size}-{stamp}-{uuid.uuid4().hex[:8]}")


def reshard(
    src: StorageBackend,
    job: str,
    step: int | None,
    world_size: int,
    *,
    dst: StorageBackend | None = None,
    out_job: str | None = None,
    threads: int = 8,
    ahead: int = 2,
    pack_threshold: int = DEFAULT_PACK_THRESHOLD,
    max_fetch: int = DEFAULT_MAX_FETCH,
    workers: Workers | None = None,
    on_plan: Callable[[ReshardPlan, int], None] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> ReshardResult:
    """Rewrite committed ``step`` (latest if None) of ``job`` so its chunks align with
    ``world_size`` ranks, and commit it as a new attempt.

    ``dst``/``out_job`` default to the source storage and job: the step's ``COMMITTED``
    is then switched atomically to the new attempt (the old one stays until ``ckptd gc``).
    Otherwise the destination step must not be committed yet.  Every torchrun worker calls
    this with the same arguments (``workers`` detected from the environment if None).
    ``on_plan(plan, bytes)`` is called once with the plan and the bytes this worker will
    write; ``on_bytes(n)`` after each object it wrote.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(
            f"--to-world-size must be an integer >= 1, got {world_size!r}"
        )
    if threads < 1:
        raise ConfigError(f"the number of I/O threads must be >= 1, got {threads}")
    t0 = time.monotonic()
    wk = workers or Workers.detect()
    dst = dst or src
    out_job = paths.check_job(out_job or job)
    rec = resolve_step(src, job, step)
    in_place = dst.url == src.url and out_job == job
    if not in_place:
        src_dir, out_dir = f"{src.url.rstrip('/')}/{job}/", f"{dst.url.rstrip('/')}/{out_job}/"
        if out_dir.startswith(src_dir) or src_dir.startswith(out_dir):
            raise ConfigError(
                f"output {out_dir[:-1]} and source {src_dir[:-1]} are nested: one job would be "
                "stored inside the other's directory, where ckptd ls does not show it and gc "
                "or removing the job deletes it. Choose an --out beside the source job (e.g. "
                f"{src.url.rstrip('/')}/{job}-w{world_size}), or omit --out to reshard in place."
            )
        have = read_commit(dst, out_job, rec.step)
        if have is not None:
            raise ConfigError(
                f"output {dst.url}/{out_job} already has a committed step {rec.step} (attempt "
                f"{have.attempt}, world size {have.world_size}); refusing to replace it. Choose "
                "another --out, or omit --out to reshard in place."
            )
    index = read_index(src, rec)
    phases: dict[str, float] = {"index": time.monotonic() - t0}
    src_prefix = paths.attempt_prefix(job, rec.step, rec.attempt)
    attempt = wk.broadcast_str(new_attempt_id(world_size) if wk.rank == 0 else "")
    dst_prefix = paths.attempt_prefix(out_job, rec.step, attempt)
    t1 = time.monotonic()
    plan = plan_reshard(index, world_size, pack_threshold=pack_threshold, max_fetch=max_fetch)
    phases["plan"] = time.monotonic() - t1
    mine = assign_tasks(plan, wk.size)[wk.rank]
    tasks = plan.tasks
    if on_plan is not None:
        objs = plan.objects
        on_plan(plan, sum(objs[i].nbytes + objs[i].pad for i in mine if i < len(objs)))
    verifier = Verifier(plan.units, expected_segments(plan))
    ex = Executor(src, src_prefix, dst, dst_prefix, verifier, threads=threads, ahead=ahead,
                  on_bytes=on_bytes)
    local: dict[str, Any] = {"error": None, "objects": {}, "pieces": [], "parts": [],
                             "read": 0, "written": 0}
    try:
        t1 = time.monotonic()
        results = ex.run([tasks[i] for i in mine])
        ex.write_metadata(plan, {plan.objects[i].array for i in mine if i < len(plan.objects)})
        ex.sync()  # durable before worker 0 writes manifests that reference them
        phases["copy"] = time.monotonic() - t1
        for i, res in zip(mine, results):
            local["read"] += res.read
            local["written"] += res.written
            if i < len(plan.objects):
                local["objects"][str(i)] = res.crc32c
                o = plan.objects[i]
                local["pieces"] += [[o.rank, name, pi, c] for name, pi, c in res.piece_crcs]
        local["parts"] = verifier.pending_parts()
        local["verified"] = verifier.verified
    except CkptdError as exc:
        local["error"] = str(exc)
        local["error_type"] = type(exc).__name__
    except Exception as exc:  # noqa: BLE001 - reported to worker 0, then raised everywhere
        local["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        ex.close()
    gathered = [json.loads(b) for b in wk.all_gather_bytes(json.dumps(local).encode())]
    status = ""
    err_type = ""
    if wk.rank == 0:
        try:
            t1 = time.monotonic()
            _finish(plan, gathered, dst, out_job, rec.step, attempt, dst_prefix)
            phases["commit"] = time.monotonic() - t1
        except Exception as exc:
            # A write that reported an error may still have landed (a 5xx or a lost answer
            # after the store applied it): if that write was COMMITTED, the attempt is live
            # and removing it would leave a committed step (in place: the source step)
            # pointing at nothing.
            state = _commit_state(dst, out_job, rec.step, attempt)
            if state is True:
                log.warning("the commit of %s reported an error (%s), but COMMITTED names the "
                            "new attempt: the reshard is committed", dst_prefix, exc)
                phases["commit"] = time.monotonic() - t1
            else:
                status = (str(exc) if isinstance(exc, CkptdError)
                          else f"{type(exc).__name__}: {exc}")
                err_type = type(exc).__name__
                if state is False:
                    _cleanup(dst, dst_prefix)
                else:
                    status += (
                        f" Whether {dst.url}/{out_job} step {rec.step} is now committed to "
                        f"attempt {attempt} is unknown ({state}); nothing was removed. Check "
                        "with `ckptd ls` once the storage answers: if the step is not "
                        "committed to it, `ckptd gc` removes the attempt after its grace "
                        "period.")
                if wk.size == 1:
                    if state is False:
                        raise
                    raise StorageError(status) from exc
    status = wk.all_gather_bytes(
        ((err_type + "\n" + status) if status else "ok").encode() if wk.rank == 0 else b""
    )[0].decode()
    if status != "ok":
        kind, _, msg = status.partition("\n")
        raise CorruptCheckpointError(msg) if kind == "CorruptCheckpointError" else CkptdError(
            f"reshard failed on worker 0: {msg}")
    return ReshardResult(
        job=job, step=rec.step, source_attempt=rec.attempt, source_world_size=index.world_size,
        out=dst.url, out_job=out_job, attempt=attempt, world_size=world_size,
        in_place=in_place, objects=len(plan.objects),
        bytes_read=sum(int(g["read"]) for g in gathered),
        bytes_written=sum(int(g["written"]) for g in gathered),
        seconds=time.monotonic() - t0, workers=wk.size,
        phases={k: round(v, 3) for k, v in phases.items()},
    )


def _commit_state(dst: StorageBackend, job: str, step: int, attempt: str) -> bool | str:
    """Whether ``COMMITTED`` of ``step`` names ``attempt`` (True/False), or why that could
    not be read (a string)."""
    try:
        rec = read_commit(dst, job, step)
    except Exception as exc:  # noqa: BLE001 - the caller reports it
        return f"reading its COMMITTED failed: {exc}"
    return rec is not None and rec.attempt == attempt


def _cleanup(dst: StorageBackend, prefix: str) -> None:
    try:
        dst.delete_prefix(prefix)
    except Exception as exc:  # noqa: BLE001 - gc removes it later
        log.warning("could not remove the partial reshard output %s: %s", prefix, exc)


def _finish(plan: ReshardPlan, gathered: list[dict], dst: StorageBackend, job: str, step: int,
            attempt: str, prefix: str) -> None:
    """Worker 0: check every worker's result and every checksum, write the metadata and
    manifests, commit."""
    errors = [g for g in gathered if g.get("error")]
    if errors:
        first = errors[0]
        msg = f"{first['error']}" + (f" (and {len(errors) - 1} other workers failed)"
                                      if len(errors) > 1 else "")
        if first.get("error_type") == "CorruptCheckpointError":
            raise CorruptCheckpointError(msg)
        if first.get("error_type") == "ConfigError":
            raise ConfigError(msg)
        raise CkptdError(msg)
    # Units whose every range was read on one worker were verified there; the parts of
    # the others (read by several workers) are combined here.
    partial = {int(p[0]) for g in gathered for p in g["parts"]}
    verifier = Verifier(plan.units, {u: n for u, n in expected_segments(plan).items()
                                     if u in partial})
    for g in gathered:
        for u, lo, hi, c in g["parts"]:
            verifier.add(int(u), int(lo), int(hi), int(c))
    verifier.finish()
    if sum(int(g.get("verified", 0)) for g in gathered) + len(partial) != len(plan.units):
        raise CorruptCheckpointError(
            "not every source range was read and verified (executor bug); nothing committed")
    crcs: dict[int, int] = {}
    for g in gathered:
        crcs.update({int(k): int(v) for k, v in g["objects"].items()})
    if len(crcs) != len(plan.objects):
        raise CkptdError(f"{len(plan.objects) - len(crcs)} destination objects were not written")
    pieces: dict[tuple[int, str, int], int] = {}
    for g in gathered:
        for r, name, pi, c in g["pieces"]:
            pieces[(int(r), str(name), int(pi))] = int(c)
    chunk_crc: dict[tuple[int, str, str], int] = {}
    for i, o in enumerate(plan.objects):
        chunk_crc[(o.rank, o.array, o.chunk)] = crcs[i]
    manifests = []
    for r, rp in enumerate(plan.ranks):
        arrays = {
            name: dataclasses.replace(rec, chunks={
                cid: ChunkRecord(c.nbytes, chunk_crc[(r, name, cid)])
                for cid, c in rec.chunks.items()})
            for name, rec in rp.arrays.items()
        }
        tensors = {}
        for name, t in rp.tensors.items():
            ps = [dataclasses.replace(p, crc32c=pieces[(r, name, pi)]) if p.pack is not None
                  else p for pi, p in enumerate(t.pieces)]
            tensors[name] = TensorRecord(t.shape, t.dtype, ps)
        manifests.append(RankManifest(
            job=job, step=step, attempt=attempt, rank=r, world_size=plan.world_size,
            framework=plan.framework, created_at=plan.created_at, arrays=arrays,
            packs=dict(rp.packs), tensors=tensors, extra=plan.extras[r],
            param_groups=plan.param_groups,
        ))
    with ThreadPoolExecutor(max_workers=16, thread_name_prefix="ckptd-reshard-meta") as pool:
        list(pool.map(lambda m: dst.put(paths.rank_manifest_key(prefix, m.rank),
                                        dumps(m.to_json())), manifests))
    index = try_commit(dst, job, step, attempt, plan.world_size)
    if index is None:
        raise CkptdError(f"{prefix}: not every rank manifest is visible after writing them")


__all__ = ["Executor", "ReshardResult", "Verifier", "Workers", "plan_reshard", "reshard"]
