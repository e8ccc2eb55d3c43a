"""``ckptd inspect URI/JOB [--step N]``: the logical tensors of a committed checkpoint.

For every logical tensor: name, global shape, dtype, bytes, how it is sharded (``dim0/N``
when its array's chunks split dim 0, ``whole`` otherwise, ``flat view`` for fairscale
parameters inside a flat parameter) and how it is stored (arrays and chunk shape, packed
pieces, the flat array and offset).  Then totals and the extra-state keys.  Reads only the
index.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from ckptd.format.commit import read_index, resolve_step
from ckptd.format.dtypes import itemsize
from ckptd.format.manifest import Index, TensorRecord
from ckptd.tools.common import human_bytes, open_job, print_json, print_table

EXTRA_PREFIX = "_extra/"


def describe(name: str, t: TensorRecord, index: Index) -> dict[str, Any]:
    numel = math.prod(t.shape)
    nbytes = numel * itemsize(t.dtype)
    arrays: dict[str, dict[str, Any]] = {}
    packs = 0
    flat: list[dict[str, Any]] = []
    for p in t.pieces:
        if p.pack is not None:
            packs += 1
        elif p.flat_start is not None:
            flat.append({"array": p.array, "start": p.flat_start, "numel": numel})
        elif p.array is not None:
            rec = index.arrays.get(p.array)
            entry = arrays.setdefault(p.array, {
                "array": p.array, "chunk_shape": list(rec.chunk_shape) if rec else None,
                "chunks": len(rec.chunks) if rec else 0, "pieces": 0})
            entry["pieces"] += 1
    if flat:
        fa = index.arrays.get(flat[0]["array"] or "")
        sharding = f"flat view (shard {fa.chunk_shape[0]})" if fa else "flat view"
    else:
        sharding = "whole"
        for a in arrays.values():
            cs = a["chunk_shape"]
            if cs and t.shape and cs[0] < t.shape[0]:
                sharding = f"dim0 chunks of {cs[0]}"
        if packs > 1 and not arrays:
            sharding = f"{packs} packed shards"
    parts = []
    for a in arrays.values():
        parts.append(f"{a['array']} chunk {tuple(a['chunk_shape'] or ())} x{a['chunks']}")
    if packs:
        parts.append(f"packed x{packs}")
    for f in flat:
        parts.append(f"{f['array']}[{f['start']}:{f['start'] + f['numel']}]")
    return {
        "name": name, "shape": list(t.shape), "dtype": t.dtype, "numel": numel,
        "bytes": nbytes, "sharding": sharding, "storage": "; ".join(parts) or "(empty)",
        "arrays": list(arrays.values()), "packed_pieces": packs, "flat": flat,
    }


def _keys(doc: Any) -> list[str]:
    if isinstance(doc, dict) and not (len(doc) == 1 and next(iter(doc)).startswith("__")):
        return sorted(str(k) for k in doc)
    return []


def summary(index: Index) -> dict[str, Any]:
    tensors = [describe(n, index.tensors[n], index) for n in sorted(index.tensors)]
    by_kind: dict[str, int] = {}
    for t in tensors:
        kind = t["name"].split("/", 1)[0] if "/" in t["name"] else t["name"]
        by_kind[kind] = by_kind.get(kind, 0) + t["bytes"]
    first = index.extras.get(0)
    user = first.get("user") if isinstance(first, dict) else None
    return {
        "job": index.job, "step": index.step, "attempt": index.attempt,
        "world_size": index.world_size, "framework": index.framework,
        "created_at": index.created_at,
        "tensors": tensors,
        "totals": {
            "tensors": len([t for t in tensors if not t["name"].startswith(EXTRA_PREFIX)]),
            "logical_bytes": by_kind,
            "stored_bytes": index.total_bytes,
            "arrays": len([a for a in index.arrays if a not in index.packs]),
            "chunks": sum(len(a.chunks) for n, a in index.arrays.items() if n not in index.packs),
            "packs": len(index.packs),
        },
        "extra": {
            "ranks": sorted(index.extras),
            "user_keys": _keys(user),
            "rng": sorted({k for d in index.extras.values() if isinstance(d, dict)
                           for k in _keys(d.get("rng"))}),
            "extra_tensors": len([t for t in tensors if t["name"].startswith(EXTRA_PREFIX)]),
        },
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} | {"params": len(g.get("params", []))}
            for g in index.param_groups
        ],
    }


def run(args: argparse.Namespace) -> int:
    storage, job = open_job(args.uri)
    try:
        rec = resolve_step(storage, job, args.step)
        doc = summary(read_index(storage, rec))
    finally:
        storage.close()
    if args.json:
        print_json(doc)
        return 0
    rows = [[t["name"], "x".join(map(str, t["shape"])) or "()", t["dtype"], human_bytes(t["bytes"]),
             t["sharding"], t["storage"]] for t in doc["tensors"]
            if args.all or not t["name"].startswith(EXTRA_PREFIX)]
    print_table(f"{storage.url}/{job} step {doc['step']} (attempt {doc['attempt']}, world size "
                f"{doc['world_size']}, {doc['framework']})",
                ["TENSOR", "SHAPE", "DTYPE", "SIZE", "SHARDING", "STORED AS"], rows,
                right=["SIZE"])
    tot = doc["totals"]
    print(f"{tot['tensors']} tensors; " + ", ".join(
        f"{k} {human_bytes(v)}" for k, v in sorted(tot["logical_bytes"].items()))
        + f"; stored {human_bytes(tot['stored_bytes'])} in {tot['arrays']} arrays "
        f"({tot['chunks']} chunks) and {tot['packs']} packs")
    ex = doc["extra"]
    print(f"extra state: ranks {ex['ranks']}; user keys {ex['user_keys'] or '-'}; rng "
          f"{ex['rng'] or '-'}; {ex['extra_tensors']} extra tensors")
    for i, g in enumerate(doc["param_groups"]):
        print(f"optimizer param group {i}: " + ", ".join(f"{k}={v}" for k, v in sorted(g.items())))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("inspect", help="show the logical tensors of a checkpoint",
                       description="Show the logical tensors of a committed checkpoint (name, "
                       "shape, dtype, how they are sharded and stored), totals and extra state.")
    p.add_argument("uri", metavar="URI/JOB", help="e.g. file:///ckpt/myjob")
    p.add_argument("--step", type=int, default=None, help="step (default: latest committed)")
    p.add_argument("--all", action="store_true", help="also list the extra-state tensors")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)
