"""The JSON documents of a checkpoint: per-rank manifests and the consolidated index.

See docs/FORMAT.md for the full layout.  Everything here is plain data with
``to_json``/``from_json``; nothing is ever unpickled.  Parsing validates structure and
raises :class:`CorruptCheckpointError` naming the document and field that is wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ckptd import FORMAT_VERSION
from ckptd.errors import CorruptCheckpointError, FormatVersionError
from ckptd.format.layout import Region, Shape

RANK_MANIFEST_KIND = "ckptd.rank_manifest"
INDEX_KIND = "ckptd.index"
COMMIT_KIND = "ckptd.commit"
FAILURE_KIND = "ckptd.rank_failure"


def dumps(doc: dict) -> bytes:
    """Canonical JSON bytes (sorted keys, no whitespace): equal documents, equal bytes."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def loads(data: bytes, what: str) -> dict:
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(
            f"{what} is not valid JSON ({exc}); the object is damaged. Run `ckptd verify` and "
            "load an earlier step."
        ) from exc
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{what}: expected a JSON object, found {type(doc).__name__}")
    return doc


def check_version(doc: dict, what: str) -> None:
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise FormatVersionError(
            f"{what} has format_version {version!r}; this ckptd reads format_version "
            f"{FORMAT_VERSION}. Upgrade ckptd (or use the version that wrote it)."
        )


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    nbytes: int
    crc32c: int


@dataclass(slots=True)
class ArrayRecord:
    """A stored zarr array and the chunks written to it (by one rank, or all)."""

    shape: Shape
    dtype: str
    chunk_shape: Shape
    chunks: dict[str, ChunkRecord] = field(default_factory=dict)  # "i.j" -> record

    def to_json(self) -> dict:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "chunk_shape": list(self.chunk_shape),
            "chunks": {k: {"nbytes": c.nbytes, "crc32c": c.crc32c} for k, c in self.chunks.items()},
        }

    @staticmethod
    def from_json(d: dict) -> ArrayRecord:
        return ArrayRecord(
            tuple(int(x) for x in d["shape"]),
            str(d["dtype"]),
            tuple(int(x) for x in d["chunk_shape"]),
            {k: ChunkRecord(int(v["nbytes"]), int(v["crc32c"])) for k, v in d["chunks"].items()},
        )

    @property
    def chunk_nbytes_elems(self) -> int:
        return math.prod(self.chunk_shape)


@dataclass(frozen=True, slots=True)
class Piece:
    """Where a region of a logical tensor is stored.

    Exactly one source: ``array`` + ``array_offsets`` (same-shape box of a zarr array),
    ``array`` + ``flat_start`` (the region is the whole tensor, stored as elements
    ``[flat_start, flat_start+numel)`` of a 1-D array), or ``pack`` + ``byte_offset`` +
    ``nbytes`` + ``crc32c`` (contiguous C-order bytes inside a rank's pack object).
    """

    region: Region
    array: str | None = None
    array_offsets: Shape | None = None
    flat_start: int | None = None
    pack: str | None = None
    byte_offset: int | None = None
    nbytes: int | None = None
    crc32c: int | None = None

    def to_json(self) -> dict:
        d: dict[str, Any] = {"region": self.region.to_json()}
        if self.array is not None:
            d["array"] = self.array
        if self.array_offsets is not None:
            d["array_offsets"] = list(self.array_offsets)
        if self.flat_start is not None:
            d["flat_start"] = self.flat_start
        if self.pack is not None:
            d.update(pack=self.pack, byte_offset=self.byte_offset, nbytes=self.nbytes,
                     crc32c=self.crc32c)
        return d

    @staticmethod
    def from_json(d: dict) -> Piece:
        return Piece(
            Region.from_json(d["region"]),
            array=d.get("array"),
            array_offsets=tuple(int(x) for x in d["array_offsets"]) if "array_offsets" in d else None,
            flat_start=int(d["flat_start"]) if "flat_start" in d else None,
            pack=d.get("pack"),
            byte_offset=int(d["byte_offset"]) if "byte_offset" in d else None,
            nbytes=int(d["nbytes"]) if "nbytes" in d else None,
            crc32c=int(d["crc32c"]) if "crc32c" in d else None,
        )

    def sort_key(self) -> tuple:
        return (self.region.offsets, self.region.shape, self.array or "", self.pack or "",
                self.byte_offset or 0, self.flat_start or 0)


def _piece_bytes(p: Piece, arrays: dict[str, ArrayRecord]) -> tuple[int, int] | None:
    """(nbytes, crc32c) of exactly the bytes of piece ``p`` (a packed entry, or a whole
    one-chunk array of the piece's shape), or None where the index has no such checksum."""
    if p.pack is not None:
        return None if p.nbytes is None or p.crc32c is None else (p.nbytes, p.crc32c)
    a = arrays.get(p.array or "")
    if (a is None or p.flat_start is not None or a.shape != p.region.shape
            or a.chunk_shape != a.shape or len(a.chunks) != 1):
        return None
    (rec,) = a.chunks.values()
    return rec.nbytes, rec.crc32c


def _drop_replica_pieces(name: str, pieces: list[Piece],
                         arrays: dict[str, ArrayRecord]) -> list[Piece]:
    """``pieces`` with one piece per region: several ranks store the same region of a
    tensor they all hold (a DTensor on a sub-mesh, e.g. a parameter sharded over "dp" only
    in a dp x tp job, is the same on every "tp" rank), each in its own pack or piece array.
    The first (lowest rank's) is kept; the others must hold the same bytes."""
    first: dict[Region, Piece] = {}
    out: list[Piece] = []
    for p in pieces:
        have = first.get(p.region)
        if have is None:
            first[p.region] = p
            out.append(p)
            continue
        a, b = _piece_bytes(have, arrays), _piece_bytes(p, arrays)
        if a is None or a != b:
            src = [q.pack or q.array for q in (have, p)]
            how = "with different contents" if a and b else "twice"
            raise CorruptCheckpointError(
                f"tensor {name}: two ranks stored region offsets {list(p.region.offsets)} "
                f"shape {list(p.region.shape)} ({src[0]} and {src[1]}) {how}. A tensor "
                "that several ranks hold (e.g. a DTensor on a sub-mesh, replicated over the "
                "other mesh dims) must be identical on each of them: "
                "keep the replicas in sync (same initialization and gradients) and save again."
            )
    return out


@dataclass(slots=True)
class TensorRecord:
    """A logical tensor: global shape, dtype and the pieces that store it."""

    shape: Shape
    dtype: str
    pieces: list[Piece] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "pieces": [p.to_json() for p in sorted(self.pieces, key=Piece.sort_key)],
        }

    @staticmethod
    def from_json(d: dict) -> TensorRecord:
        return TensorRecord(
            tuple(int(x) for x in d["shape"]), str(d["dtype"]),
            [Piece.from_json(p) for p in d["pieces"]],
        )


@dataclass(slots=True)
class RankManifest:
    """What one rank wrote for one save attempt (``_ranks/<rank>.json``)."""

    job: str
    step: int
    attempt: str
    rank: int
    world_size: int
    framework: str
    created_at: float
    arrays: dict[str, ArrayRecord] = field(default_factory=dict)
    packs: dict[str, int] = field(default_factory=dict)  # pack array -> nbytes
    tensors: dict[str, TensorRecord] = field(default_factory=dict)
    extra: Any = None
    param_groups: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "kind": RANK_MANIFEST_KIND,
            "format_version": FORMAT_VERSION,
            "job": self.job,
            "step": self.step,
            "attempt": self.attempt,
            "rank": self.rank,
            "world_size": self.world_size,
            "framework": self.framework,
            "created_at": self.created_at,
            "arrays": {k: v.to_json() for k, v in self.arrays.items()},
            "packs": dict(self.packs),
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            "extra": self.extra,
            "param_groups": self.param_groups,
        }

    @staticmethod
    def from_json(d: dict, what: str = "rank manifest") -> RankManifest:
        check_version(d, what)
        try:
            return RankManifest(
                job=str(d["job"]), step=int(d["step"]), attempt=str(d["attempt"]),
                rank=int(d["rank"]), world_size=int(d["world_size"]),
                framework=str(d["framework"]), created_at=float(d["created_at"]),
                arrays={k: ArrayRecord.from_json(v) for k, v in d["arrays"].items()},
                packs={k: int(v) for k, v in d["packs"].items()},
                tensors={k: TensorRecord.from_json(v) for k, v in d["tensors"].items()},
                extra=d.get("extra"),
                param_groups=list(d.get("param_groups") or []),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(
                f"{what} is missing or has a malformed field ({type(exc).__name__}: {exc})"
            ) from exc


@dataclass(slots=True)
class Index:
    """The consolidated view of a committed attempt (``index.json``)."""

    job: str
    step: int
    attempt: str
    world_size: int
    framework: str
    created_at: float
    arrays: dict[str, ArrayRecord]
    packs: dict[str, int]
    tensors: dict[str, TensorRecord]
    extras: dict[int, Any]  # rank -> extra JSON
    param_groups: list[dict]

    def to_json(self) -> dict:
        return {
            "kind": INDEX_KIND,
            "format_version": FORMAT_VERSION,
            "job": self.job,
            "step": self.step,
            "attempt": self.attempt,
            "world_size": self.world_size,
            "framework": self.framework,
            "created_at": self.created_at,
            "arrays": {k: self.arrays[k].to_json() for k in sorted(self.arrays)},
            "packs": {k: self.packs[k] for k in sorted(self.packs)},
            "tensors": {k: self.tensors[k].to_json() for k in sorted(self.tensors)},
            "extras": {str(r): self.extras[r] for r in sorted(self.extras)},
            "param_groups": self.param_groups,
        }

    @staticmethod
    def from_json(d: dict, what: str = "index.json") -> Index:
        check_version(d, what)
        try:
            return Index(
                job=str(d["job"]), step=int(d["step"]), attempt=str(d["attempt"]),
                world_size=int(d["world_size"]), framework=str(d["framework"]),
                created_at=float(d["created_at"]),
                arrays={k: ArrayRecord.from_json(v) for k, v in d["arrays"].items()},
                packs={k: int(v) for k, v in d["packs"].items()},
                tensors={k: TensorRecord.from_json(v) for k, v in d["tensors"].items()},
                extras={int(k): v for k, v in d["extras"].items()},
                param_groups=list(d.get("param_groups") or []),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(
                f"{what} is missing or has a malformed field ({type(exc).__name__}: {exc})"
            ) from exc

    @staticmethod
    def merge(manifests: list[RankManifest]) -> Index:
        """Consolidate the manifests of every rank of one attempt (deterministic)."""
        if not manifests:
            raise CorruptCheckpointError("cannot build an index from zero rank manifests")
        ms = sorted(manifests, key=lambda m: m.rank)
        first = ms[0]
        ranks = [m.rank for m in ms]
        if ranks != list(range(first.world_size)):
            raise CorruptCheckpointError(
                f"attempt {first.attempt} of step {first.step}: expected rank manifests "
                f"0..{first.world_size - 1}, found {ranks}"
            )
        arrays: dict[str, ArrayRecord] = {}
        tensors: dict[str, TensorRecord] = {}
        packs: dict[str, int] = {}
        for m in ms:
            for key, attr in (("job", m.job), ("step", m.step), ("attempt", m.attempt),
                              ("world_size", m.world_size)):
                if attr != getattr(first, key):
                    raise CorruptCheckpointError(
                        f"rank {m.rank} manifest has {key}={attr!r}, rank 0 has "
                        f"{getattr(first, key)!r}: manifests of different saves were mixed"
                    )
            packs.update(m.packs)
            for name, a in m.arrays.items():
                have = arrays.get(name)
                if have is None:
                    arrays[name] = ArrayRecord(a.shape, a.dtype, a.chunk_shape, dict(a.chunks))
                    continue
                if (have.shape, have.dtype, have.chunk_shape) != (a.shape, a.dtype, a.chunk_shape):
                    raise CorruptCheckpointError(
                        f"array {name}: rank {m.rank} records shape {a.shape} dtype {a.dtype} "
                        f"chunks {a.chunk_shape}, another rank {have.shape} {have.dtype} "
                        f"{have.chunk_shape}"
                    )
                for ck, rec in a.chunks.items():
                    if ck in have.chunks and have.chunks[ck] != rec:
                        raise CorruptCheckpointError(
                            f"array {name} chunk {ck} was written by two ranks with different "
                            "contents"
                        )
                    have.chunks[ck] = rec
            for name, t in m.tensors.items():
                have_t = tensors.get(name)
                if have_t is None:
                    tensors[name] = TensorRecord(t.shape, t.dtype, list(t.pieces))
                    continue
                if (have_t.shape, have_t.dtype) != (t.shape, t.dtype):
                    raise CorruptCheckpointError(
                        f"tensor {name}: rank {m.rank} records shape {t.shape} dtype {t.dtype}, "
                        f"another rank {have_t.shape} {have_t.dtype}"
                    )
                seen = set(have_t.pieces)
                have_t.pieces.extend(p for p in t.pieces if p not in seen)
        for name, t in tensors.items():
            t.pieces = _drop_replica_pieces(name, t.pieces, arrays)
            t.pieces.sort(key=Piece.sort_key)
        return Index(
            job=first.job, step=first.step, attempt=first.attempt,
            world_size=first.world_size, framework=first.framework,
            created_at=first.created_at, arrays=arrays, packs=packs, tensors=tensors,
            extras={m.rank: m.extra for m in ms}, param_groups=first.param_groups,
        )

    @property
    def total_bytes(self) -> int:
        n = sum(self.packs.values())
        for a in self.arrays.values():
            n += sum(c.nbytes for c in a.chunks.values())
        return n
