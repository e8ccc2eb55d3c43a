"""Subcommands of the operator tools: ls, inspect, verify, export, gc, reshard.

Registered by :mod:`ckptd.cli` through :func:`add_parser`.  Each subcommand's ``func(args)``
returns the exit code; ckptd errors become exit code 2 with their message.
"""

from __future__ import annotations

import argparse
from typing import Any

from ckptd.format.plan import DEFAULT_PACK_THRESHOLD
from ckptd.tools import export, gc, inspect, ls, verify
from ckptd.tools.common import (
    human_bytes,
    print_json,
    progress_bar,
    split_job_uri,
    thread_count,
)


def _reshard(args: argparse.Namespace) -> int:
    from ckptd.reshard.run import Workers, reshard
    from ckptd.storage import open_storage

    root, job = split_job_uri(args.uri)
    src = open_storage(root)
    dst = None
    out_job = None
    try:
        if args.out:
            out_root, out_job = split_job_uri(args.out)
            dst = src if out_root == root else open_storage(out_root)
        workers = Workers.detect()
        show = not args.json and workers.rank == 0
        with progress_bar(f"reshard to {args.to_world_size} ranks", 0, enabled=show) as advance:
            res = reshard(src, job, args.step, args.to_world_size, dst=dst, out_job=out_job,
                          threads=args.threads, pack_threshold=args.pack_threshold,
                          workers=workers,
                          on_plan=lambda plan, mine: advance.set_total(mine),
                          on_bytes=advance)
    finally:
        src.close()
        if dst is not None and dst is not src:
            dst.close()
    if workers.rank != 0:
        return 0
    if args.json:
        print_json(res.to_json())
    else:
        where = "in place" if res.in_place else f"into {res.out}/{res.out_job}"
        print(f"resharded step {res.step} of {job} from {res.source_world_size} to "
              f"{res.world_size} ranks {where}: committed attempt {res.attempt}; "
              f"{res.objects} objects, read {human_bytes(res.bytes_read)}, wrote "
              f"{human_bytes(res.bytes_written)} in {res.seconds:.1f}s "
              f"({res.bytes_written / 1e6 / max(res.seconds, 1e-9):.0f} MB/s"
              + (f", {res.workers} workers" if res.workers > 1 else "") + ")")
    return 0


def add_parser(sub: Any) -> None:
    ls.add_parser(sub)
    inspect.add_parser(sub)
    verify.add_parser(sub)
    export.add_parser(sub)
    gc.add_parser(sub)
    p = sub.add_parser(
        "reshard", help="rewrite a checkpoint so its chunks align with N ranks",
        description="Rewrite a committed checkpoint so that every array's chunks align with N "
        "ranks, streaming chunk by chunk in bounded memory, verifying checksums, and commit "
        "the result atomically as a new attempt. Under torchrun, each worker takes its share.")
    p.add_argument("uri", metavar="URI/JOB", help="e.g. file:///ckpt/myjob")
    p.add_argument("--step", type=int, default=None, help="step (default: latest committed)")
    p.add_argument("--to-world-size", type=int, required=True, metavar="N",
                   help="the world size to align with (>= 1)")
    p.add_argument("--out", default=None, metavar="URI/JOB2",
                   help="write the result as this job (its step must not be committed; the "
                   "source job itself means in place); default: the same job, switching the "
                   "step's COMMITTED atomically")
    p.add_argument("--threads", type=thread_count, default=8,
                   help="objects built in parallel per worker (default 8)")
    p.add_argument("--pack-threshold", type=int, default=DEFAULT_PACK_THRESHOLD,
                   help="shards smaller than this many bytes go into the rank's pack "
                   f"(default {DEFAULT_PACK_THRESHOLD}, as at save time)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=_reshard)
