"""``ckptd export URI/JOB [--step N] --format safetensors|torch --out PATH``.

Writes the full, unsharded model weights under the names of the unwrapped model's
``state_dict()`` (``model/<fqn>`` -> ``<fqn>``; fairscale flat parameters are read through
their views, so they come out unflattened under their original names and shapes), and
with ``--optimizer`` (torch format only) the optimizer state as
``{"model": ..., "optimizer": {"state": {fqn: {key: tensor}}, "param_groups": [...]}}``
(parameters named by fqn, not by index).

Bounded memory: the file layout is known from the index, so the header (safetensors) or
the pickle (torch) is written first, then every tensor is streamed in row blocks of at
most ``block_bytes`` (64 MiB), a few blocks in flight.  The whole model is never in
memory, nor is one whole large tensor.  Every byte read is checksum-verified (the same
range reads and crc32c combination as ``reshard``); the output is written to a
temporary file and renamed into place only when everything was read and verified.

The torch file is the zip format of ``torch.save`` written directly (``data.pkl`` with
``torch._utils._rebuild_tensor_v2``/``_v3`` records, 64-byte aligned data records), which
``torch.load(path, weights_only=True)`` (and ``mmap=True``) reads.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import math
import os
import pickle
import struct
import time
import uuid
import zipfile
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, SupportsIndex

from ckptd.errors import CkptdError, ConfigError, StorageError
from ckptd.format import paths
from ckptd.format.commit import read_index, resolve_step
from ckptd.format.dtypes import check_name, dtype_from_name, itemsize
from ckptd.format.layout import Region
from ckptd.format.manifest import Index
from ckptd.reshard.plan import (
    DEFAULT_MAX_FETCH,
    Fetch,
    Place,
    UnitTable,
    build_fetches,
    drop_segments,
    region_needs,
    verification_tasks,
)
from ckptd.reshard.run import Executor, Verifier
from ckptd.storage.base import StorageBackend
from ckptd.tools.common import human_bytes, open_job, print_json, progress_bar, thread_count

if TYPE_CHECKING:
    import torch

FORMATS = ("safetensors", "torch")
DEFAULT_BLOCK = 64 << 20

# recorded dtype name -> safetensors dtype
_ST_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
    "complex64": "C64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ",
}


@dataclass(slots=True)
class _Block:
    nbytes: int
    fetches: list[Fetch]
    places: list[Place]


@dataclass(slots=True)
class _Entry:
    """One exported tensor: its logical name, output name and blocks."""

    logical: str
    name: str
    shape: tuple[int, ...]
    dtype: str  # the recorded name
    nbytes: int
    blocks: list[_Block]


@dataclass
class ExportResult:
    path: str
    format: str
    job: str
    step: int
    attempt: str
    tensors: int
    bytes: int
    bytes_read: int
    seconds: float


def _entries(index: Index, optimizer: bool, block_bytes: int, table: UnitTable) -> list[_Entry]:
    names: list[tuple[str, str]] = []
    for n in sorted(index.tensors):
        if n.startswith("model/"):
            names.append((n, n[len("model/"):]))
        elif optimizer and n.startswith("optim/"):
            names.append((n, n))
    if not any(n.startswith("model/") for n, _ in names):
        raise ConfigError(
            f"step {index.step} of job {index.job!r} holds no model tensors (names 'model/...'); "
            "nothing to export"
        )
    out = []
    for logical, name in names:
        t = index.tensors[logical]
        dt = check_name(t.dtype)
        isz = itemsize(dt)
        nbytes = math.prod(t.shape) * isz
        blocks = []
        if nbytes:
            if t.shape:
                rowb = max(1, math.prod(t.shape[1:]) * isz)
                step = max(1, block_bytes // rowb)
                ranges = [Region((a,) + (0,) * (len(t.shape) - 1),
                                 (min(t.shape[0], a + step) - a,) + tuple(t.shape[1:]))
                          for a in range(0, t.shape[0], step)]
            else:
                ranges = [Region((), ())]
            for want in ranges:
                needs = region_needs(index.arrays, logical, t, want,
                                     max_fetch=min(DEFAULT_MAX_FETCH, max(block_bytes, 1)))
                fetches, places = build_fetches(needs, table)
                blocks.append(_Block(want.numel * isz, fetches, places))
        out.append(_Entry(logical, name, tuple(t.shape), dt, nbytes, blocks))
    return out


# --------------------------------------------------------------------------- writers


def _safetensors_header(entries: list[_Entry], meta: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": meta}
    off = 0
    for e in entries:
        dt = _ST_DTYPES.get(e.dtype)
        if dt is None:
            raise ConfigError(
                f"tensor {e.logical!r} has dtype {e.dtype}, which safetensors cannot hold; use "
                "--format torch"
            )
        header[e.name] = {"dtype": dt, "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw


class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Pickles like a contiguous CPU tensor whose storage is data record ``key``."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        stride = []
        acc = 1
        for d in reversed(self.shape):
            stride.append(acc)
            acc *= max(d, 1)
        stride_t = tuple(reversed(stride))
        hooks = collections.OrderedDict()  # type: ignore[var-annotated]
        import torch

        if self.storage.dtype in torch.storage._dtype_to_storage_type_map():
            return (torch._utils._rebuild_tensor_v2,
                    (self.storage, 0, self.shape, stride_t, False, hooks))
        return (torch._utils._rebuild_tensor_v3,
                (self.storage, 0, self.shape, stride_t, False, hooks, self.storage.dtype))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            import torch

            name = torch.storage._dtype_to_storage_type_map().get(obj.dtype)
            if name is not None:
                return ("storage", getattr(torch, name), obj.key, "cpu", obj.numel)
            return ("storage", torch.UntypedStorage, obj.key, "cpu",
                    obj.numel * itemsize(obj.dtype))
        return None


def _torch_pickle(entries: list[_Entry], param_groups: list[dict] | None) -> bytes:
    model: dict[str, Any] = {}
    state: dict[str, dict[str, Any]] = {}
    for i, e in enumerate(entries):
        ref = _TensorRef(_StorageRef(str(i), dtype_from_name(e.dtype), math.prod(e.shape)),
                         e.shape)
        if e.logical.startswith("model/"):
            model[e.name] = ref
        else:
            fqn, key = e.logical[len("optim/"):].rsplit("/", 1)
            state.setdefault(fqn, {})[key] = ref
    obj: Any = model
    if param_groups is not None:
        obj = {"model": model, "optimizer": {"state": state, "param_groups": param_groups}}
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue()


class _TorchZip:
    """The ``torch.save`` zip layout, written record by record."""

    ALIGN = 64

    def __init__(self, f: Any, archive: str) -> None:
        self.zf = zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self.archive = archive

    def small(self, name: str, data: bytes) -> None:
        self.zf.writestr(zipfile.ZipInfo(f"{self.archive}/{name}", (1980, 1, 1, 0, 0, 0)), data)

    def open(self, name: str, nbytes: int) -> Any:
        full = f"{self.archive}/{name}"
        zi = zipfile.ZipInfo(full, (1980, 1, 1, 0, 0, 0))
        zi.compress_type = zipfile.ZIP_STORED
        zi.file_size = nbytes
        zip64 = nbytes * 1.05 > zipfile.ZIP64_LIMIT
        start = self.zf.fp.tell()  # type: ignore[union-attr]
        base = start + 30 + len(full.encode()) + (20 if zip64 else 0) + 4
        pad = (-base) % self.ALIGN
        zi.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
        return self.zf.open(zi, "w", force_zip64=zip64)

    def __enter__(self) -> _TorchZip:
        return self

    def __exit__(self, *exc: object) -> None:
        # always finish the zip before its file closes (on an error the file is removed)
        self.zf.close()


# --------------------------------------------------------------------------- export


def export(storage: StorageBackend, job: str, step: int | None, fmt: str, out: str, *,
           optimizer: bool = False, block_bytes: int = DEFAULT_BLOCK, threads: int = 8,
           ahead: int = 2, on_bytes: Any = None, on_plan: Any = None) -> ExportResult:
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {FORMATS}, got {fmt!r}")
    if optimizer and fmt != "torch":
        raise ConfigError(
            "safetensors holds only named tensors; export the optimizer state with --format torch"
        )
    if block_bytes < 1:
        raise ConfigError(f"block size must be >= 1 byte, got {block_bytes}")
    if fmt == "torch":
        try:
            import torch  # noqa: F401  (the pickle names torch's rebuild functions)
        except ImportError:
            raise ConfigError(
                "--format torch writes a torch.save file and needs torch installed "
                "(pip install torch); --format safetensors works without torch"
            ) from None
    out = os.path.abspath(out)
    if os.path.exists(out):
        raise ConfigError(f"output {out} already exists; remove it or choose another --out")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise ConfigError(
            f"output directory {parent} does not exist; create it or choose another --out"
        )
    if storage.url.startswith("file://"):
        job_dir = os.path.realpath(os.path.join(storage.url[len("file://"):], job))
        if (os.path.realpath(parent) + os.sep).startswith(job_dir + os.sep):
            raise ConfigError(
                f"output {out} is inside the checkpoint directory {job_dir} of job {job!r}: "
                "ckptd gc deletes what it finds there (a file in a step directory counts as "
                "a leftover attempt). Choose an --out outside the job's directory"
            )
    t0 = time.monotonic()
    rec = resolve_step(storage, job, step)
    index = read_index(storage, rec)
    prefix = paths.attempt_prefix(job, rec.step, rec.attempt)
    table = UnitTable()
    entries = _entries(index, optimizer, block_bytes, table)
    blocks = [b for e in entries for b in e.blocks]
    vtasks, whole = verification_tasks((b.fetches for b in blocks), table.units)
    for b in blocks:
        b.fetches = drop_segments(b.fetches, whole)
    expected: dict[int, int] = {}
    for fl in [b.fetches for b in blocks] + [v.fetches for v in vtasks]:
        for fetch in fl:
            for s in fetch.segments:
                expected[s.unit] = expected.get(s.unit, 0) + 1
    if on_plan is not None:
        on_plan(entries)
    verifier = Verifier(table.units, expected)
    ex = Executor(storage, prefix, None, "", verifier, threads=threads, ahead=ahead)
    tmp = f"{out}.tmp-{uuid.uuid4().hex[:8]}"
    total = sum(e.nbytes for e in entries)
    read = 0
    try:
        read += sum(r.read for r in ex.run(list(vtasks)))
        with open(tmp, "wb") as f:
            if fmt == "safetensors":
                f.write(_safetensors_header(entries, {
                    "format": "pt", "ckptd_job": job, "ckptd_step": str(rec.step),
                    "ckptd_attempt": rec.attempt}))
                for e in entries:
                    read += _stream(ex, e.blocks, f.write, threads, on_bytes)
            else:
                archive = os.path.splitext(os.path.basename(out))[0] or "archive"
                archive = "".join(c if c.isalnum() or c in "._-" else "_" for c in archive)
                with _TorchZip(f, archive) as z:
                    z.small("data.pkl", _torch_pickle(entries, index.param_groups if optimizer
                                                      else None))
                    z.small(".format_version", b"1")
                    z.small(".storage_alignment", str(_TorchZip.ALIGN).encode())
                    z.small("byteorder", b"little")
                    for i, e in enumerate(entries):
                        with z.open(f"data/{i}", e.nbytes) as w:
                            read += _stream(ex, e.blocks, w.write, threads, on_bytes)
                    z.small("version", b"3\n")
                    z.small(".data/serialization_id", str(uuid.uuid4().int)[:40].encode())
            f.flush()
            os.fsync(f.fileno())
        verifier.finish()
        os.replace(tmp, out)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:  # never created (or cannot be named): the error below says why
            pass
        if isinstance(exc, OSError) and not isinstance(exc, CkptdError):  # the output file
            raise StorageError(
                f"writing {out} failed: {type(exc).__name__}: {exc}. Expected a writable "
                f"directory with room for {human_bytes(total)}; nothing was written there. "
                "Free space or choose another --out"
            ) from exc
        raise
    finally:
        ex.close()
    return ExportResult(out, fmt, job, rec.step, rec.attempt, len(entries), total, read,
                        time.monotonic() - t0)


def _stream(ex: Executor, blocks: list[_Block], write: Any, depth: int, on_bytes: Any) -> int:
    """Fill ``blocks`` (``depth`` at a time, each in its own reused buffer) and write them
    in order."""
    depth = max(1, min(depth, 4))
    bufs = [bytearray() for _ in range(depth)]
    free = deque(range(depth))
    pending: deque[tuple[int, Future, int]] = deque()
    read = 0
    with ThreadPoolExecutor(max_workers=depth, thread_name_prefix="ckptd-export") as pool:
        it = iter(blocks)
        done = False
        while True:
            while not done and free:
                b = next(it, None)
                if b is None:
                    done = True
                    break
                slot = free.popleft()
                if len(bufs[slot]) < b.nbytes:
                    bufs[slot] = bytearray(b.nbytes)
                view = memoryview(bufs[slot])[:b.nbytes]
                pending.append((slot, pool.submit(ex.fill, b.fetches, b.places, view), b.nbytes))
            if not pending:
                break
            slot, fut, n = pending.popleft()
            read += fut.result()
            write(memoryview(bufs[slot])[:n])
            if on_bytes is not None:
                on_bytes(n)
            free.append(slot)
    return read


def run(args: argparse.Namespace) -> int:
    storage, job = open_job(args.uri)
    try:
        if args.json:
            res = export(storage, job, args.step, args.format, args.out,
                         optimizer=args.optimizer, threads=args.threads)
        else:
            rec = resolve_step(storage, job, args.step)
            idx = read_index(storage, rec)
            est = sum(math.prod(t.shape) * itemsize(t.dtype)
                      for n, t in idx.tensors.items()
                      if n.startswith("model/") or (args.optimizer and n.startswith("optim/")))
            with progress_bar(f"export {args.format}", est, enabled=True) as advance:
                res = export(storage, job, rec.step, args.format, args.out,
                             optimizer=args.optimizer, threads=args.threads, on_bytes=advance)
    finally:
        storage.close()
    if args.json:
        print_json(asdict(res))
    else:
        print(f"wrote {res.path} ({res.format}): {res.tensors} tensors, {human_bytes(res.bytes)} "
              f"from step {res.step} of {job} in {res.seconds:.1f}s")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="write the full model weights (safetensors / torch)",
                       description="Write the full, unsharded model weights of a committed "
                       "checkpoint, named as in the unwrapped model, tensor by tensor in bounded "
                       "memory.")
    p.add_argument("uri", metavar="URI/JOB", help="e.g. file:///ckpt/myjob")
    p.add_argument("--step", type=int, default=None, help="step (default: latest committed)")
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--out", required=True, help="output file (must not exist)")
    p.add_argument("--optimizer", action="store_true",
                   help="also write the optimizer state (torch format only)")
    p.add_argument("--threads", type=thread_count, default=8, help="parallel reads (default 8)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)
