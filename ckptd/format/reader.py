"""Reading logical tensors (any region, any layout) from a committed checkpoint.

:class:`CheckpointReader` fills :class:`LoadTarget` s.  For each target it finds the pieces
that overlap it, fetches the chunks (whole chunks, so the checksum can be verified) with
bounded concurrency and a bounded window of bytes in flight, verifies crc32c, and copies
the overlapping parts into the target.  Save and load layouts may differ arbitrarily:
this is load-time resharding.

A storage backend may offer a :class:`ReadWindow` (``read_window(capacity)``; the ckptd
daemon's client does, backed by a shared-memory segment the daemon reads objects into).
The reader then reserves room in the window for each fetch in fetch order, hands batches of
fetches to the backend (one call per batch, several batches in flight) and works on views
into the window, releasing each fetch's room once every copy from it is done.  A fetch
that cannot get room (larger than the window, or the window is full with nothing in
flight) goes through ``storage.get`` as without a window.
"""

from __future__ import annotations

import abc
import math
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Self

import torch

from ckptd.errors import CorruptCheckpointError
from ckptd.format.checksum import crc32c
from ckptd.format.dtypes import dtype_from_name
from ckptd.format.items import LoadTarget
from ckptd.format.layout import (
    Region,
    chunk_region,
    chunks_overlapping,
    flat_range_rows,
    intersect,
    is_row_range,
)
from ckptd.format.manifest import Index, Piece, TensorRecord
from ckptd.format.plan import chunk_id, chunk_key
from ckptd.storage.base import StorageBackend

warnings.filterwarnings("ignore", message="The given buffer is not writable")

WINDOW_MIN = 32 << 20   # a read window of at least this (or the whole load, if smaller)
#: packed entries read as one range when the bytes between them are at most this many ...
COALESCE_GAP = 64 << 10
#: ... and the range stays at most this long (one storage call instead of one per entry)
COALESCE_MAX = 4 << 20


def _slices(region: Region, origin: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o - g, o - g + s) for o, g, s in zip(region.offsets, origin,
                                                            region.shape))


@dataclass(frozen=True, slots=True)
class _Fetch:
    """One verified read: a whole chunk, or one packed entry."""

    key: str
    start: int | None
    end: int | None
    nbytes: int
    crc32c: int
    what: str


@dataclass(frozen=True, slots=True, eq=False)
class _Read:
    """One storage read: bytes ``[start, end)`` of ``key`` (the whole object if both are
    None) holding the fetches ``parts``, each at its offset in the bytes read.  Packed
    entries that lie close together in one pack object share a read."""

    key: str
    start: int | None
    end: int | None
    nbytes: int
    parts: tuple[tuple[_Fetch, int], ...]


def _coalesce(order: Sequence[_Fetch]) -> list[_Read]:
    """The reads for ``order``, in the order of their first fetch: packed entries of one
    pack object that come later in ``order`` at a higher offset, at most ``COALESCE_GAP``
    bytes after the previous one, share its read (of at most ``COALESCE_MAX`` bytes) --
    also when entries of other objects come between (a load at another world size takes
    each tensor's pieces from several ranks' packs in turn); every other fetch is a read
    of its own."""
    groups: list[list[_Fetch]] = []
    open_group: dict[str, list[_Fetch]] = {}   # per pack object: the group it may extend
    for f in order:
        if f.start is None or f.end is None:
            groups.append([f])
            continue
        g = open_group.get(f.key)
        if g is not None and 0 <= f.start - (g[-1].end or 0) <= COALESCE_GAP and (
                f.end - (g[0].start or 0) <= COALESCE_MAX):
            g.append(f)
            continue
        g = open_group[f.key] = [f]
        groups.append(g)
    reads = []
    for g in groups:
        first = g[0]
        if len(g) == 1:
            reads.append(_Read(first.key, first.start, first.end, first.nbytes, ((first, 0),)))
            continue
        lo, hi = first.start or 0, g[-1].end or 0
        reads.append(_Read(first.key, lo, hi, hi - lo, tuple((f, (f.start or 0) - lo)
                                                             for f in g)))
    return reads


@dataclass(frozen=True, slots=True)
class WindowRead:
    """One range to read into a :class:`ReadWindow`: bytes ``[start, start + nbytes)`` of
    ``key`` into the window at ``offset``; ``whole``: the object must be exactly ``nbytes``
    bytes (``start`` is 0)."""

    key: str
    start: int
    nbytes: int
    offset: int
    whole: bool


class ReadWindow(abc.ABC):
    """A bounded buffer a storage backend reads byte ranges into and lends to the reader.

    Obtained from a backend's optional ``read_window(capacity)`` (None when it has none
    to offer now).  Order of calls, for one :class:`CheckpointReader`: ``reserve`` and
    ``release`` from the reader's scheduling thread only; ``fill`` from its pool threads,
    for ranges reserved and not yet released (several at once); ``close`` once, after the
    last ``fill`` returned.
    """

    capacity: int
    max_batch_bytes: int     # a batch (one ``fill``) holds at most this many bytes ...
    max_batch_items: int     # ... and this many ranges

    @abc.abstractmethod
    def reserve(self, nbytes: int) -> int | None:
        """Offset of ``nbytes`` free bytes of the window, now theirs; None if there is no
        such room now (never blocks)."""

    @abc.abstractmethod
    def release(self, offset: int, nbytes: int) -> None:
        """Give back what ``reserve`` returned; views into it must no longer be used."""

    @abc.abstractmethod
    def fill(self, reads: Sequence[WindowRead]) -> list[memoryview | int | None]:
        """Read each range; per range, in order: a view of the bytes read (shorter than
        asked if the object ended first), the object's size if a ``whole`` read found
        another size (nothing read), or None if the object does not exist."""

    def close(self) -> None:
        """Give the window back.  Idempotent."""


class CheckpointReader:
    """Reads from the committed attempt described by ``index`` under ``prefix``.

    Thread-compatible: one reader per loading thread.  ``max_inflight_bytes`` bounds the
    bytes fetched ahead of use.
    """

    def __init__(self, storage: StorageBackend, index: Index, prefix: str, *,
                 concurrency: int = 8, max_inflight_bytes: int = 512 << 20,
                 verify: bool = True) -> None:
        self.storage = storage
        self.index = index
        self.prefix = prefix
        self.concurrency = concurrency
        self.max_inflight = max_inflight_bytes
        self.verify = verify
        self._window: ReadWindow | None = None
        self._window_tried = False

    def close(self) -> None:
        """Give back the storage's read window, if one was used.  Idempotent; the reader
        opens a new one if it is used again."""
        w, self._window, self._window_tried = self._window, None, False
        if w is not None:
            w.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_window(self, order: Sequence[_Read]) -> ReadWindow | None:
        """The storage's read window (opened once per reader), sized for ``order``: twice
        its largest fetch, at least min(its total, 32 MiB), at most ``max_inflight_bytes``."""
        if self._window is None and not self._window_tried and order:
            opener: Any = getattr(self.storage, "read_window", None)
            if opener is not None:
                self._window_tried = True
                largest = max(f.nbytes for f in order)
                total = sum(f.nbytes for f in order)
                want = min(self.max_inflight, max(2 * largest, min(total, WINDOW_MIN)))
                self._window = opener(max(1, want))
        return self._window

    # -- fetch planning ------------------------------------------------------------------
    def _chunk_fetch(self, array: str, coords: tuple[int, ...]) -> _Fetch:
        rec = self.index.arrays.get(array)
        if rec is None:
            raise CorruptCheckpointError(
                f"array {array!r} is referenced by the index but not recorded in it; the "
                "checkpoint is damaged. Run `ckptd verify` and load an earlier step."
            )
        cid = chunk_id(coords)
        c = rec.chunks.get(cid)
        if c is None:
            raise CorruptCheckpointError(
                f"array {array!r} chunk {cid or '(0-d)'} was never written (no rank recorded "
                "it); the checkpoint is incomplete. Run `ckptd verify`."
            )
        return _Fetch(f"{self.prefix}/{array}/{chunk_key(coords)}", None, None, c.nbytes,
                      c.crc32c, f"array {array!r} chunk {cid}")

    def _pack_fetch(self, p: Piece) -> _Fetch:
        start = p.byte_offset or 0
        n = p.nbytes or 0
        return _Fetch(f"{self.prefix}/{p.pack}/c/0", start, start + n, n, p.crc32c or 0,
                      f"pack {p.pack!r} bytes [{start}, {start + n})")

    def _fetch(self, r: _Read) -> dict[_Fetch, memoryview | BaseException]:
        try:
            data = self.storage.get(r.key, r.start, r.end)
        except FileNotFoundError:
            data = None
        return self._split(r, data)

    def _fill(self, window: ReadWindow, batch: list[tuple[_Read, int]],
              outs: list[Future]) -> None:
        """Read ``batch`` (reads with their window offsets) into the window (a pool
        thread); resolves ``outs`` in order."""
        try:
            got = window.fill([
                WindowRead(r.key, r.start or 0, r.nbytes, off, r.start is None and r.end is None)
                for r, off in batch])
        except BaseException as exc:  # noqa: BLE001 - every read of the batch fails with it
            for out in outs:
                out.set_exception(exc)
            return
        for (r, _), data, out in zip(batch, got, outs):
            out.set_result(self._split(r, data))

    def _split(self, r: _Read, data: bytes | memoryview | int | None) -> dict[
            _Fetch, memoryview | BaseException]:
        """Each fetch of ``r`` checked (:meth:`_checked`): its bytes, or the error to raise
        where it is used."""
        out: dict[_Fetch, memoryview | BaseException] = {}
        whole = len(r.parts) == 1 or data is None or isinstance(data, int)
        view = None if whole else memoryview(data)  # type: ignore[arg-type]
        for f, off in r.parts:
            try:
                out[f] = self._checked(f, data if view is None else view[off:off + f.nbytes])
            except BaseException as exc:  # noqa: BLE001 - raised where the fetch is used
                out[f] = exc
        return out

    def _checked(self, f: _Fetch, data: bytes | memoryview | int | None) -> memoryview:
        """The bytes of ``f`` (None: the object is absent; an int: its size, not read),
        checked for length and checksum."""
        if data is None:
            raise CorruptCheckpointError(
                f"{f.what} is missing from storage ({f.key}); the checkpoint is damaged. Run "
                "`ckptd verify` and load an earlier step."
            )
        found = data if isinstance(data, int) else len(data)
        if isinstance(data, int) or found != f.nbytes:
            what = "is truncated" if found < f.nbytes else "is larger than recorded"
            raise CorruptCheckpointError(
                f"{f.what}: expected {f.nbytes} bytes, found {found} ({f.key}); the object "
                f"{what}. Load an earlier step."
            )
        if self.verify:
            got = crc32c(data)
            if got != f.crc32c:
                raise CorruptCheckpointError(
                    f"checksum mismatch in {f.what} ({f.key}): expected crc32c {f.crc32c:#010x}, "
                    f"found {got:#010x}. The stored bytes are corrupt; load an earlier step."
                )
        return memoryview(data)

    # -- copy planning -------------------------------------------------------------------
    def _ops(self, t: TensorRecord, name: str, want: Region) -> list[tuple[_Fetch, object]]:
        """(fetch, copy-spec) pairs that produce region ``want`` of tensor ``name``.

        Raises CorruptCheckpointError unless the pieces lie inside the tensor and cover
        ``want`` (pieces never overlap), so a damaged index never leaves part of a loaded
        tensor unset."""
        ops: list[tuple[_Fetch, object]] = []
        covered = 0
        for p in t.pieces:
            if len(p.region.shape) != len(t.shape) or any(
                    s > d for s, d in zip(p.region.stops, t.shape)):
                raise CorruptCheckpointError(
                    f"tensor {name!r} of shape {list(t.shape)} records a piece at offsets "
                    f"{list(p.region.offsets)} of shape {list(p.region.shape)}, outside the "
                    "tensor; the index is damaged. Run `ckptd verify` and load an earlier step."
                )
            inter = intersect(p.region, want)
            if inter is None:
                continue
            covered += inter.numel
            if p.pack is not None:
                ops.append((self._pack_fetch(p), ("pack", p, inter)))
            elif p.flat_start is not None:
                rows = inter if is_row_range(inter, t.shape) else _bounding_rows(inter, t.shape)
                row = math.prod(t.shape[1:]) if t.shape else 1
                lo = p.flat_start + (rows.offsets[0] * row if t.shape else 0)
                hi = lo + rows.numel
                arr = self.index.arrays.get(p.array or "")
                if arr is None:
                    raise CorruptCheckpointError(f"array {p.array!r} missing from the index")
                c = arr.chunk_shape[0]
                ks = list(range(lo // c, (hi - 1) // c + 1))
                holder: dict = {}
                for k in ks:
                    ops.append((self._chunk_fetch(p.array or "", (k,)),
                                ("flat", holder, inter, rows, lo, hi, k, c, k == ks[-1])))
            else:
                assert p.array is not None and p.array_offsets is not None
                arr = self.index.arrays.get(p.array)
                if arr is None:
                    raise CorruptCheckpointError(f"array {p.array!r} missing from the index")
                a_off = tuple(io - po + ao for io, po, ao in zip(inter.offsets, p.region.offsets,
                                                                  p.array_offsets))
                a_reg = Region(a_off, inter.shape)
                for coords in chunks_overlapping(a_reg, arr.chunk_shape) if a_reg.shape else [()]:
                    ops.append((self._chunk_fetch(p.array, coords),
                                ("chunk", p, inter, a_reg, coords, arr)))
        if covered != want.numel:
            raise CorruptCheckpointError(
                f"tensor {name!r}: the stored pieces hold {covered} of the {want.numel} elements "
                f"of region offsets {list(want.offsets)} shape {list(want.shape)} (tensor shape "
                f"{list(t.shape)}, {len(t.pieces)} pieces); the checkpoint is incomplete or its "
                "index is damaged. Run `ckptd verify` and load an earlier step."
            )
        return ops

    def _apply(self, spec: tuple, data: memoryview, out: torch.Tensor, want: Region,
               dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        kind = spec[0]
        raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(
            0, dtype=torch.uint8)
        if kind == "pack":
            _, p, inter = spec
            src = raw.view(dtype).reshape(p.region.shape)
            out[_slices(inter, want.offsets)].copy_(src[_slices(inter, p.region.offsets)])
        elif kind == "chunk":
            _, p, inter, a_reg, coords, arr = spec
            cshape = arr.chunk_shape
            src = raw.view(dtype).reshape(cshape)
            creg = chunk_region(coords, cshape, arr.shape)
            sub = intersect(creg, a_reg) if a_reg.shape else Region((), ())
            if sub is None:
                return
            # the same sub-box in logical coordinates
            log_off = tuple(so - ao + io for so, ao, io in zip(sub.offsets, a_reg.offsets,
                                                               inter.offsets))
            dst = Region(log_off, sub.shape)
            out[_slices(dst, want.offsets)].copy_(src[_slices(sub, creg.offsets)])
        else:  # flat: assemble array elements [lo, hi) = the rows, then copy inter
            _, holder, inter, rows, lo, hi, k, c, last = spec
            buf = holder.get("buf")
            if buf is None:
                buf = holder["buf"] = torch.empty(hi - lo, dtype=dtype)
            flat = raw.view(dtype)
            a, b = max(lo, k * c), min(hi, (k + 1) * c)
            buf[a - lo:b - lo].copy_(flat[a - k * c:b - k * c])
            if last:
                full = buf.view(rows.shape)
                out[_slices(inter, want.offsets)].copy_(full[_slices(inter, rows.offsets)])
                holder.clear()

    # -- public --------------------------------------------------------------------------
    def tensor(self, name: str) -> TensorRecord:
        t = self.index.tensors.get(name)
        if t is None:
            raise CorruptCheckpointError(f"tensor {name!r} is not in the checkpoint")
        return t

    def read_region(self, name: str, region: Region | None = None) -> torch.Tensor:
        t = self.tensor(name)
        region = region or Region.full(t.shape)
        out = torch.empty(region.shape, dtype=dtype_from_name(t.dtype))
        self.read_targets([LoadTarget(name, t.shape, out.dtype, out, region=region)])
        return out

    def read_targets(self, targets: Iterable[LoadTarget]) -> None:
        """Fill every target's ``out`` in place."""
        work: list[tuple[LoadTarget, Region, torch.Tensor, list]] = []
        for tg in targets:
            t = self.tensor(tg.name)
            if tg.flat_range is not None:
                lo, hi = tg.flat_range
                want = flat_range_rows(lo, hi, t.shape)
                dst = torch.empty(want.shape, dtype=dtype_from_name(t.dtype))
            else:
                want = tg.region or Region.full(t.shape)
                dst = tg.out if tg.out.dtype == dtype_from_name(t.dtype) else torch.empty(
                    want.shape, dtype=dtype_from_name(t.dtype))
            if want.numel == 0:
                continue
            work.append((tg, want, dst, self._ops(t, tg.name, want)))

        fetches: dict[_Fetch, int] = OrderedDict()
        for _, _, _, ops in work:
            for f, _ in ops:
                fetches[f] = fetches.get(f, 0) + 1
        order = _coalesce(list(fetches))
        read_of = {f: r for r in order for f, _ in r.parts}
        parts_left = {r: len(r.parts) for r in order}
        pending: dict[_Read, Future] = {}
        done: dict[_Fetch, memoryview | BaseException] = {}
        nxt = 0
        inflight = 0
        window = self._open_window(order)
        room: dict[_Read, tuple[int, int]] = {}   # window offset and size held per read

        def pump() -> None:
            """Submit reads in order while the in-flight bytes allow: batches into the
            window while it has room, else (nothing in flight, or too large for the
            window) one read through ``storage.get``."""
            nonlocal nxt, inflight
            while nxt < len(order) and (inflight < self.max_inflight or not pending):
                batch: list[tuple[_Read, int]] = []
                size = 0
                while window is not None and nxt < len(order) and (
                        len(batch) < window.max_batch_items):
                    r = order[nxt]
                    if batch and (size + r.nbytes > window.max_batch_bytes
                                  or inflight >= self.max_inflight):
                        break
                    off = window.reserve(r.nbytes)
                    if off is None:
                        break
                    room[r] = (off, r.nbytes)
                    batch.append((r, off))
                    size += r.nbytes
                    inflight += r.nbytes
                    nxt += 1
                if batch:
                    assert window is not None
                    outs: list[Future] = [Future() for _ in batch]
                    pending.update((r, out) for (r, _), out in zip(batch, outs))
                    pool.submit(self._fill, window, batch, outs)
                    continue
                if window is not None and pending and order[nxt].nbytes <= window.capacity:
                    return  # room comes back as the reads in flight are used
                r = order[nxt]
                pending[r] = pool.submit(self._fetch, r)
                inflight += r.nbytes
                nxt += 1

        try:
            with ThreadPoolExecutor(max_workers=self.concurrency,
                                    thread_name_prefix="ckptd-read") as pool:
                for tg, want, dst, ops in work:
                    t = self.tensor(tg.name)
                    dtype = dtype_from_name(t.dtype)
                    for f, spec in ops:
                        if f not in done:
                            r = read_of[f]
                            while r not in pending:
                                pump()
                                if r not in pending and nxt >= len(order):
                                    raise AssertionError("fetch scheduling bug")
                            done.update(pending.pop(r).result())
                        data = done[f]
                        if isinstance(data, BaseException):
                            raise data
                        self._apply(spec, data, dst, want, dtype, t.shape)
                        fetches[f] -= 1
                        if fetches[f] == 0:
                            del done[f]
                            r = read_of[f]
                            parts_left[r] -= 1
                            if parts_left[r] == 0:
                                inflight -= r.nbytes
                                held = room.pop(r, None)
                                if held is not None and window is not None:
                                    window.release(*held)
                        pump()
                    _finish_target(tg, want, dst, t)
        finally:  # the pool has finished every fill: give back what is still held
            if window is not None:
                for held in room.values():
                    window.release(*held)


def _bounding_rows(inter: Region, shape: tuple[int, ...]) -> Region:
    return Region((inter.offsets[0],) + (0,) * (len(shape) - 1),
                  (inter.shape[0],) + tuple(shape[1:]))


def _finish_target(tg: LoadTarget, want: Region, dst: torch.Tensor, t: TensorRecord) -> None:
    if tg.flat_range is not None:
        lo, hi = tg.flat_range
        row = math.prod(t.shape[1:]) if t.shape else 1
        start = want.offsets[0] * row if t.shape else 0
        tg.out.copy_(dst.reshape(-1)[lo - start:hi - start].to(tg.out.dtype))
    elif dst is not tg.out:
        tg.out.copy_(dst.to(tg.out.dtype))

