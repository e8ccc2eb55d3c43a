"""Reshard and load-after-reshard benchmark, all in one run on one machine.

    python bench/bench_reshard.py                        # FSDP2 + AdamW, 4 -> 2 ranks, ~1 GB
    python bench/bench_reshard.py --layers 6 --reps 1    # smaller and quicker

1. Saves the same FSDP2 model + AdamW state (a stack of Linear(dim, dim), random values)
   at ``--from`` ranks twice: with ckptd (embedded client, file:// under --root) and with
   ``torch.distributed.checkpoint.save`` (DCP).
2. Offline reshard throughput: ``ckptd reshard --to-world-size N --out ...`` (a separate
   process; its peak RSS is read from ``getrusage``) against ``cp -r`` of the same committed
   attempt directory (and ``cp -r`` followed by ``sync``: ckptd fsyncs every object, cp
   does not).  Page cache of the source is dropped first (``posix_fadvise(DONTNEED)``) for
   every measurement, so each run reads from disk.  With ``--sizes`` the reshard is also
   run on smaller checkpoints (fewer layers) to show its peak memory does not grow with
   the checkpoint.
3. Load at ``--to`` ranks (gloo, FSDP2, model + optimizer), side by side in one process
   group: ``ckptd-original`` (load-time resharding of the checkpoint saved at --from),
   ``ckptd-resharded`` (after ``ckptd reshard``), and ``dcp`` (``dcp.load`` of the DCP
   checkpoint saved at --from).  Page cache dropped before each; time from a barrier to a
   barrier (slowest rank); median of --reps.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--from", dest="src", type=int, default=4, help="save world size")
    p.add_argument("--to", dest="dst", type=int, default=2, help="reshard / load world size")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=20,
                   help="Linear(dim, dim) layers (default 20 x 2048^2 fp32 + AdamW: ~1 GB)")
    p.add_argument("--sizes", default="5",
                   help="extra layer counts to reshard too (memory vs size), e.g. 5,10")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--root", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--phases", default="reshard,load",
                   help="what to measure after saving (saves are skipped when --root has them)")
    return p.parse_args(argv)


# -- ranks -----------------------------------------------------------------------------------
class Stack(torch.nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _build(world: int, dim: int, layers: int, seed: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Stack(dim, layers)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def _materialize(model: Any, opt: Any) -> None:
    """Create the AdamW state without a forward pass (random values, like after training)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    for st in opt.state.values():
        for k, v in st.items():
            if k != "step":
                local = v.to_local() if hasattr(v, "to_local") else v
                local.copy_(torch.rand(local.shape, generator=g))


def _dcp_state(model: Any, opt: Any) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def rank_save(rank: int, world: int, root: str, dim: int, layers: int, job: str,
              dcp_dir: str | None) -> None:
    _init(rank, world)
    from ckptd_client import CheckpointClient

    model, opt = _build(world, dim, layers, seed=1)
    _materialize(model, opt)
    client = CheckpointClient(job, storage=f"file://{root}")
    client.save(model, optimizer=opt, step=1, timeout=1800)
    client.close()
    if dcp_dir:
        import torch.distributed.checkpoint as dcp

        dcp.save(_dcp_state(model, opt), checkpoint_id=dcp_dir)
    dist.barrier()
    dist.destroy_process_group()


def rank_load(rank: int, world: int, root: str, dim: int, layers: int, plan: list[tuple],
              out: str, evict_dirs: dict[str, str]) -> None:
    _init(rank, world)
    from ckptd_client import CheckpointClient

    times: dict[str, list[float]] = {}
    for variant, target in plan:
        # A fresh model and optimizer, as when a job resumes: both ckptd's load and DCP's
        # get_state_dict create the optimizer state inside the timed region.
        model, opt = _build(world, dim, layers, seed=2)
        if rank == 0:
            evict(evict_dirs[variant])
        dist.barrier()
        t0 = time.perf_counter()
        if variant == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import set_state_dict

            state = _dcp_state(model, opt)
            dcp.load(state, checkpoint_id=target)
            set_state_dict(model, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        else:
            client = CheckpointClient(target, storage=f"file://{root}")
            client.load(model, optimizer=opt)
            client.close()
        dist.barrier()
        times.setdefault(variant, []).append(time.perf_counter() - t0)
        del model, opt
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def _init(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _entry(rank: int, world: int, port: int, fn: Any, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    fn(rank, world, *args)


def run_world(fn: Any, world: int, *args: Any) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_entry, args=(world, port, fn, args), nprocs=world, join=True,
                       start_method="spawn")


# -- helpers ----------------------------------------------------------------------------------
def evict(path: str) -> None:
    """Drop the page cache of every file below ``path`` (clean pages only; no root needed)."""
    for d, _, files in os.walk(path):
        for f in files:
            try:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def attempt_dir(root: str, job: str) -> str:
    from ckptd.format import paths
    from ckptd.format.commit import resolve_step
    from ckptd.storage import open_storage

    rec = resolve_step(open_storage(root), job, None)
    return os.path.join(root, paths.attempt_prefix(job, rec.step, rec.attempt))


def timed(cmd: list[str]) -> tuple[float, int, str]:
    """Wall seconds, peak RSS (bytes) of the child, stdout."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    p = subprocess.run(cmd, check=False, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{cmd} failed: {p.stderr[-2000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return dt, max(after, before) * 1024, p.stdout


def measure_reshard(root: str, job: str, to: int, threads: int, reps: int,
                    tag: str) -> dict[str, Any]:
    """cp -r, cp -r + sync and ckptd reshard of the same attempt, interleaved per
    repetition (the machine is shared: interleaving exposes all three to the same load)."""
    src = attempt_dir(root, job)
    nbytes = dir_bytes(src)
    res: dict[str, Any] = {"job": job, "bytes": nbytes, "cp": [], "cp_sync": [], "reshard": [],
                           "reshard_inner_s": [], "loadavg": []}
    rss = 0
    for i in range(reps):
        res["loadavg"].append(round(os.getloadavg()[0], 1))
        dst = os.path.join(root, f"cp-{tag}-{i}")
        evict(src)
        res["cp"].append(timed(["cp", "-r", src, dst])[0])
        shutil.rmtree(dst)
        evict(src)
        t0 = time.perf_counter()
        subprocess.run(["cp", "-r", src, dst], check=True)
        subprocess.run(["sync"], check=True)
        res["cp_sync"].append(time.perf_counter() - t0)
        shutil.rmtree(dst)
        out_job = f"{job}-to{to}-{tag}-{i}"
        shutil.rmtree(os.path.join(root, out_job), ignore_errors=True)  # from an earlier run
        evict(src)
        dt, _, stdout = timed([sys.executable, "-c", _RSS_WRAPPER, "reshard",
                               f"file://{root}/{job}", "--to-world-size", str(to), "--out",
                               f"file://{root}/{out_job}", "--threads", str(threads), "--json"])
        doc = json.loads(stdout.strip().splitlines()[-1])
        res["reshard"].append(dt)
        res["reshard_inner_s"].append(doc["result"]["seconds"])
        res["phases"] = doc["result"].get("phases")
        rss = max(rss, doc["peak_rss"])
        res["reshard_written"] = doc["result"]["bytes_written"]
        res["reshard_read"] = doc["result"]["bytes_read"]
        res["max_object"] = doc["max_object"]
        res["baseline_rss"] = doc["baseline_rss"]
        if i < reps - 1:
            shutil.rmtree(os.path.join(root, out_job))
    res["reshard_peak_rss"] = rss
    res["out_job"] = f"{job}-to{to}-{tag}-{reps - 1}"
    return res


# Runs `ckptd reshard` in-process and prints {"result", "peak_rss", "baseline_rss"} as the
# last line (VmHWM of this process; baseline = VmHWM after importing torch and ckptd).
_RSS_WRAPPER = r"""
import json, sys, io, contextlib
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
import ckptd.cli, ckptd.reshard.run as rr, ckptd.tools.cli  # no torch: the CLI does not need it
base = hwm()
plans = []
orig = rr.plan_reshard
rr.plan_reshard = lambda *a, **k: plans.append(orig(*a, **k)) or plans[-1]
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    rc = ckptd.cli.main(sys.argv[1:])
assert rc == 0, rc
print(json.dumps({"result": json.loads(buf.getvalue()), "peak_rss": hwm(), "baseline_rss": base,
                  "max_object": plans[0].max_object_bytes()}))
"""


def _latest_out(root: str, job: str, to: int) -> str:
    outs = sorted(d for d in os.listdir(root) if d.startswith(f"{job}-to{to}-"))
    if not outs:
        raise SystemExit(f"no resharded copy of {job} under {root}: run the reshard phase")
    return outs[-1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = args.root or tempfile.mkdtemp(prefix="ckptd-bench-reshard-")
    os.makedirs(root, exist_ok=True)
    results: dict[str, Any] = {"args": vars(args), "root": root}
    sizes = [args.layers] + [int(x) for x in args.sizes.split(",") if x.strip()]
    print(f"# root {root}; saving FSDP2 + AdamW at {args.src} ranks: dim {args.dim}, layers "
          f"{sizes}", flush=True)
    for n in sizes:
        job = f"bench-l{n}"
        if not os.path.isdir(os.path.join(root, job)):
            dcp_dir = os.path.join(root, f"dcp-l{n}") if n == args.layers else None
            t0 = time.perf_counter()
            run_world(rank_save, args.src, root, args.dim, n, job, dcp_dir)
            print(f"saved {job} (+DCP) in {time.perf_counter() - t0:.1f}s", flush=True)

    # -- 2. reshard vs cp -r
    rows = []
    phases = set(args.phases.split(","))
    for n in (sizes if "reshard" in phases else []):
        reps = args.reps if n == args.layers else 1
        r = measure_reshard(root, f"bench-l{n}", args.dst, args.threads, reps, f"l{n}")
        r["layers"] = n
        rows.append(r)
        cp, cps, rs = (statistics.median(r[k]) for k in ("cp", "cp_sync", "reshard"))
        gb = r["bytes"] / 1e9
        print(f"layers {n:3d}: {gb:.3f} GB  cp -r {cp:.2f}s ({gb / cp:.2f} GB/s)  "
              f"cp -r+sync {cps:.2f}s ({gb / cps:.2f} GB/s)  reshard {rs:.2f}s "
              f"({gb / rs:.2f} GB/s, process incl. start-up; inner "
              f"{statistics.median(r['reshard_inner_s']):.2f}s)  ratio vs cp -r "
              f"{cp / rs:.2f}x  vs cp+sync {cps / rs:.2f}x  peak RSS "
              f"{r['reshard_peak_rss'] / 2**20:.0f} MiB (baseline "
              f"{r['baseline_rss'] / 2**20:.0f} MiB, largest object "
              f"{r['max_object'] / 2**20:.0f} MiB); load avg {r['loadavg']}", flush=True)
    results["reshard"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)

    # -- 3. load at --to ranks
    if "load" not in phases:
        return 0
    job = f"bench-l{args.layers}"
    main_row = rows[0] if rows else {"out_job": _latest_out(root, job, args.dst),
                                     "bytes": dir_bytes(attempt_dir(root, job))}
    plan = []
    for _ in range(args.reps):
        plan += [("ckptd-original", job), ("ckptd-resharded", main_row["out_job"]),
                 ("dcp", os.path.join(root, f"dcp-l{args.layers}"))]
    evict_dirs = {"ckptd-original": os.path.join(root, job),
                  "ckptd-resharded": os.path.join(root, main_row["out_job"]),
                  "dcp": os.path.join(root, f"dcp-l{args.layers}")}
    out = os.path.join(root, "load-times.json")
    run_world(rank_load, args.dst, root, args.dim, args.layers, plan, out, evict_dirs)
    with open(out) as f:
        times = json.load(f)
    results["load"] = times
    gb = main_row["bytes"] / 1e9
    print(f"load avg at the end: {os.getloadavg()[0]:.1f}")
    for v in ("ckptd-original", "ckptd-resharded", "dcp"):
        med = statistics.median(times[v])
        print(f"load at {args.dst} ranks: {v:16s} median {med:.2f}s ({gb / med:.2f} GB/s) "
              f"runs {[round(x, 2) for x in times[v]]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if not args.root:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
