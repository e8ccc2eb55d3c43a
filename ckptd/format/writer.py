"""Writing one rank's staged bytes, and its manifest.

:func:`write_rank` is called once per rank and save attempt, from a writer thread (embedded
client) or the daemon, after the rank's bytes were copied into ``buffer`` following
``plan.copies``.  It writes every object of ``plan.writes`` with bounded concurrency,
checksums them from the buffer (no copy), writes the zarr metadata this rank owns, then the
rank manifest ``_ranks/<rank>.json`` — only after every chunk is durable.  The caller then
runs the commit protocol (:mod:`ckptd.format.commit`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

from ckptd.errors import StagingError
from ckptd.format import paths
from ckptd.format.checksum import crc32c, crc32c_zeros, zeros
from ckptd.format.manifest import ChunkRecord, RankManifest, TensorRecord, dumps
from ckptd.format.plan import RankPlan
from ckptd.format.zarr_meta import array_doc
from ckptd.storage.base import StorageBackend


@dataclasses.dataclass(frozen=True, slots=True)
class SaveIdentity:
    job: str
    step: int
    attempt: str
    rank: int
    world_size: int
    framework: str

    @property
    def prefix(self) -> str:
        return paths.attempt_prefix(self.job, self.step, self.attempt)


def validate_plan(plan: RankPlan, buffer_size: int) -> None:
    """Reject a plan whose writes fall outside a buffer of ``buffer_size`` bytes, or whose
    keys are unsafe.  The daemon calls this before touching a client's segment."""
    if plan.nbytes > buffer_size:
        raise StagingError(
            f"save plan needs {plan.nbytes} staging bytes but the segment holds {buffer_size}"
        )
    for w in plan.writes:
        if w.offset < 0 or w.nbytes < 0 or w.pad < 0 or w.offset + w.nbytes > buffer_size:
            raise StagingError(
                f"write {w.key!r} covers bytes [{w.offset}, {w.offset + w.nbytes}) outside the "
                f"{buffer_size}-byte segment"
            )
        parts = w.key.split("/")
        if w.key.startswith("/") or any(p in ("", ".", "..") for p in parts) or parts[0] in (
            "_ranks", "index.json", "zarr.json"
        ):
            raise StagingError(f"write key {w.key!r} is not a safe chunk key")
        if not w.key.startswith(f"{w.array}/c"):
            raise StagingError(f"write key {w.key!r} is not a chunk of array {w.array!r}")


def write_rank(
    storage: StorageBackend,
    ident: SaveIdentity,
    plan: RankPlan,
    buffer: Any,
    *,
    extra: Any = None,
    param_groups: list[dict] | None = None,
    executor: Executor | None = None,
    concurrency: int = 8,
    on_bytes: Callable[[int], None] | None = None,
) -> RankManifest:
    """Write this rank's objects and manifest; return the manifest.

    ``buffer`` is any object exposing the buffer protocol (bytes-like, 1-D) holding
    ``plan.nbytes`` staged bytes.  Raises on the first failed write; nothing partial is
    referenced by a manifest, so a failed attempt is never committed.
    """
    mv = memoryview(buffer).cast("B")
    validate_plan(plan, len(mv))
    prefix = ident.prefix
    own_pool = executor is None
    pool = executor or ThreadPoolExecutor(max_workers=max(1, concurrency),
                                          thread_name_prefix="ckptd-write")
    crcs: dict[tuple[str, str], int] = {}
    try:
        def put_chunk(w: Any) -> tuple[tuple[str, str | None], int]:
            data = mv[w.offset:w.offset + w.nbytes]
            crc = crc32c(data)
            if w.pad:
                crc = crc32c_zeros(w.pad, crc)
                storage.put(f"{prefix}/{w.key}", [data, zeros(w.pad)])
            else:
                storage.put(f"{prefix}/{w.key}", data)
            if on_bytes is not None:
                on_bytes(w.nbytes + w.pad)
            return (w.array, w.chunk), crc

        def put_meta(name: str) -> None:
            m = plan.array_meta[name]
            storage.put(f"{prefix}/{name}/zarr.json", dumps(array_doc(m.shape, m.dtype,
                                                                    m.chunk_shape)))

        futures = [pool.submit(put_chunk, w) for w in plan.writes]
        futures += [pool.submit(put_meta, name) for name in plan.array_meta]
        errors = []
        for f in futures:
            try:
                res = f.result()
            except BaseException as exc:  # noqa: BLE001 - collect, raise the first
                errors.append(exc)
                continue
            if res is not None:
                (array, chunk), crc = res
                crcs[(array, chunk or "")] = crc
        if errors:
            raise errors[0]
    finally:
        if own_pool:
            pool.shutdown(wait=True)

    arrays = {}
    for name, rec in plan.arrays.items():
        chunks = {
            cid: ChunkRecord(c.nbytes, crcs[(name, cid)]) for cid, c in rec.chunks.items()
        }
        arrays[name] = dataclasses.replace(rec, chunks=chunks)
    pack_starts = {w.array: w.offset for w in plan.writes if w.chunk is not None and
                   w.array in plan.packs}
    tensors = {}
    for name, t in plan.tensors.items():
        pieces = []
        for p in t.pieces:
            if p.pack is not None:
                start = pack_starts[p.pack] + (p.byte_offset or 0)
                p = dataclasses.replace(p, crc32c=crc32c(mv[start:start + (p.nbytes or 0)]))
            pieces.append(p)
        tensors[name] = TensorRecord(t.shape, t.dtype, pieces)
    manifest = RankManifest(
        job=ident.job, step=ident.step, attempt=ident.attempt, rank=ident.rank,
        world_size=ident.world_size, framework=ident.framework, created_at=time.time(),
        arrays=arrays, packs=dict(plan.packs), tensors=tensors, extra=extra,
        param_groups=param_groups or [],
    )
    storage.put(paths.rank_manifest_key(prefix, ident.rank), dumps(manifest.to_json()))
    return manifest
