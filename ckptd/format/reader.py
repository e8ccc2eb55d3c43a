"""Reading logical tensors (any region, any layout) from a committed checkpoint.

:class:`CheckpointReader` fills :class:`LoadTarget` s.  For each target it finds the pieces
that overlap it, fetches the chunks (whole chunks, so the checksum can be verified) with
bounded concurrency and a bounded window of bytes in flight, verifies crc32c, and copies
the overlapping parts into the target.  Save and load layouts may differ arbitrarily:
this is load-time resharding.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

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

    def _fetch(self, f: _Fetch) -> memoryview:
        try:
            data = self.storage.get(f.key, f.start, f.end)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{f.what} is missing from storage ({f.key}); the checkpoint is damaged. Run "
                "`ckptd verify` and load an earlier step."
            ) from None
        if len(data) != f.nbytes:
            raise CorruptCheckpointError(
                f"{f.what}: expected {f.nbytes} bytes, found {len(data)} ({f.key}); the object "
                "is truncated. Load an earlier step."
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
        """(fetch, copy-spec) pairs that produce region ``want`` of tensor ``name``."""
        ops: list[tuple[_Fetch, object]] = []
        for p in t.pieces:
            inter = intersect(p.region, want)
            if inter is None:
                continue
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
        order = list(fetches)
        pending: dict[_Fetch, Future] = {}
        done: dict[_Fetch, memoryview] = {}
        nxt = 0
        inflight = 0
        with ThreadPoolExecutor(max_workers=self.concurrency,
                                thread_name_prefix="ckptd-read") as pool:
            def pump() -> None:
                nonlocal nxt, inflight
                while nxt < len(order) and (inflight < self.max_inflight or not pending):
                    f = order[nxt]
                    pending[f] = pool.submit(self._fetch, f)
                    inflight += f.nbytes
                    nxt += 1

            for tg, want, dst, ops in work:
                t = self.tensor(tg.name)
                dtype = dtype_from_name(t.dtype)
                for f, spec in ops:
                    if f not in done:
                        while f not in pending:
                            pump()
                            if f not in pending and nxt >= len(order):
                                raise AssertionError("fetch scheduling bug")
                        done[f] = pending.pop(f).result()
                    self._apply(spec, done[f], dst, want, dtype, t.shape)
                    fetches[f] -= 1
                    if fetches[f] == 0:
                        inflight -= f.nbytes
                        del done[f]
                    pump()
                _finish_target(tg, want, dst, t)


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

