"""Save benchmark: ckptd daemon vs torch.distributed.checkpoint.async_save (one run, one
process group).

    python bench/bench_save.py                       # 2 ranks, FSDP2 + AdamW, >= 0.25 GB/rank
    python bench/bench_save.py --dim 1024 --layers 4 --reps 3   # smaller and quicker
    python bench/bench_save.py --load                # loads instead: daemon (shared memory,
                                                     # stream) vs embedded

The launcher starts a real ``ckptd serve`` (file:// storage under --root), spawns
``--world`` gloo ranks (FSDP2, AdamW), and in that one process group times, per rank and
repetition (after --warmup unmeasured ones; the table shows medians over repetitions of
the slowest rank):

Variants are interleaved within each repetition, so the machine's drift (the disk's speed
varies several-fold on shared VMs) affects all of them alike.

* ``floor``      -- a plain copy of the rank's state bytes into an already-touched buffer;
* ``dcp``        -- ``dcp.async_save`` with its default stager (fresh CPU copies per save);
* ``dcp-reuse``  -- ``dcp.async_save`` with one ``DefaultStager(StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=False,
                    use_non_blocking_copy=cuda))`` reused across saves (cached storages);
* ``ckptd-copy`` -- ``client.save_async(model, optimizer=opt)`` through the daemon;
* ``ckptd-overlap`` -- ``save_async(..., overlap=True)`` followed by forward/backward; the
                    stall is the call plus the wait of the next ``optimizer.step()``.

"stall" is the time from the call until the training loop may go on (for DCP this includes
building the state dict, which the loop must do; ckptd's call includes its own state
extraction).  "commit" is the time from the call until the checkpoint is durable and
committed.  Persist throughput is the bytes of all ranks over (commit - stall), compared
with ``dd if=/dev/zero of=F bs=64M count=N conv=fsync`` of the same size on the same disk, run
right after each measured save (the disk's speed drifts a lot on shared VMs, so the ratio is
taken per repetition, then the median).
The daemon's peak RSS (VmHWM) is compared with its staging budget.

``--load`` measures ``client.load(model, optimizer=opt)`` of one checkpoint saved through
the daemon instead, per rank and repetition (interleaved; medians of the slowest rank):
``load-shm`` through the daemon with its shared-memory read path, ``load-stream`` through the
daemon with ``CKPTD_SHM_READS=0`` (the ReadObject gRPC stream, as remote clients read), and
``load-embedded`` reading the files directly (``storage=file://...``).  The objects are in
the page cache for all three (they were just written).
"""

from __future__ import annotations

import argparse
import json
import os
import re
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

VARIANTS = ("floor", "dcp", "dcp-reuse", "ckptd-copy", "ckptd-overlap")
LOAD_VARIANTS = ("load-shm", "load-stream", "load-embedded")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dim", type=int, default=2048, help="width of each Linear layer")
    p.add_argument("--layers", type=int, default=11,
                   help="Linear(dim, dim) layers (default 11 x 2048^2: ~0.28 GB/rank with AdamW)")
    p.add_argument("--batch", type=int, default=256, help="rows per forward/backward")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--root", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--staging-bytes", default=None,
                   help="daemon staging budget (default: 2 segments per rank, rounded)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    p.add_argument("--load", action="store_true",
                   help="measure loads (daemon shared memory / daemon stream / embedded) "
                        "instead of saves")
    p.add_argument("--phases", action="store_true",
                   help="also print where ckptd-copy's stall goes (client phases per rank, "
                        "the daemon's Save handler from its debug log)")
    return p.parse_args(argv)


# -- ranks -----------------------------------------------------------------------------------
class Stack(torch.nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's local tensors of the state (local shards of params and optimizer states)."""
    out = []
    for p in model.parameters():
        out.append(p.to_local() if hasattr(p, "to_local") else p)
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor):
                out.append(v.to_local() if hasattr(v, "to_local") else v)
    return [t.detach() for t in out]


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, address: str,
              root: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp
    from ckptd_client import CheckpointClient
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Stack(args.dim, args.layers)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.dim, generator=torch.Generator().manual_seed(rank))

    def fwd_bwd() -> None:
        model(x).square().mean().backward()

    def train_step() -> None:
        fwd_bwd()
        opt.step()
        opt.zero_grad()

    train_step()
    local = _state_bytes(model, opt)
    nbytes = sum(t.numel() * t.element_size() for t in local)
    floor_buf = torch.empty(nbytes, dtype=torch.uint8)
    floor_buf.zero_()  # touched once, reused
    dcp_pg = dist.new_group(backend="gloo")  # DCP's background collectives stay off training's
    cuda = torch.cuda.is_available()
    reuse_stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                use_async_staging=False,
                                                use_non_blocking_copy=cuda))
    client = CheckpointClient("bench", daemon=address)
    results: dict[str, dict[str, list[float]]] = {}
    step = 0

    def finish() -> None:
        client.close()
        reuse_stager.close()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"nbytes": nbytes, "results": results}, f)
        dist.barrier()
        dist.destroy_process_group()

    if args.load:
        _measure_loads(rank, args, client, model, opt, nbytes, root, results)
        finish()
        return

    def dcp_state() -> dict[str, Any]:
        return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}

    for i in range(args.warmup + args.reps):   # interleaved: drift hits every variant alike
        for variant in args.variants.split(","):
            res = results.setdefault(variant, {"stall": [], "commit": [], "fwd_bwd": []})
            step += 1
            train_step()
            dist.barrier()
            t0 = time.perf_counter()
            if variant == "floor":
                off = 0
                for t in local:
                    n = t.numel() * t.element_size()
                    floor_buf[off:off + n].view(t.dtype).view(t.shape).copy_(t)
                    off += n
                stall = commit = time.perf_counter() - t0
            elif variant in ("dcp", "dcp-reuse"):
                ckpt = os.path.join(root, "dcp", f"{variant}-{i}")
                kw = {"async_stager": reuse_stager} if variant == "dcp-reuse" else {}
                fut = dcp.async_save(dcp_state(), checkpoint_id=ckpt, process_group=dcp_pg, **kw)
                stall = time.perf_counter() - t0
                upload = getattr(fut, "upload_completion", fut)
                upload.result()
                commit = time.perf_counter() - t0
            elif variant == "ckptd-copy":
                h = client.save_async(model, optimizer=opt, step=step)
                stall = time.perf_counter() - t0
                if i >= args.warmup:
                    ph = dict(client.last_phases)
                    ph["other"] = stall - sum(v for k, v in ph.items() if "." not in k)
                    res.setdefault("phases", []).append(ph)
                h.result(600)
                commit = time.perf_counter() - t0
            elif variant == "ckptd-overlap":
                h = client.save_async(model, optimizer=opt, step=step, overlap=True)
                call = time.perf_counter() - t0
                tf = time.perf_counter()
                fwd_bwd()                       # the loop goes on while the copy runs
                if i >= args.warmup:
                    res["fwd_bwd"].append(time.perf_counter() - tf)
                tw = time.perf_counter()
                h.wait_staged()                 # what the next optimizer.step() waits for
                stall = call + (time.perf_counter() - tw)
                opt.step()
                opt.zero_grad()
                h.result(600)
                commit = time.perf_counter() - t0
            else:
                raise SystemExit(f"unknown variant {variant!r}")
            dist.barrier()
            if i >= args.warmup:
                res["stall"].append(stall)
                res["commit"].append(commit)
                if rank == 0 and variant != "floor":  # the disk's speed right now, same size
                    res.setdefault("dd", []).append(_dd(os.path.join(root, "dd.bin"),
                                                        nbytes * world)[0])
            if rank == 0:  # keep the disk small: drop what was just measured
                shutil.rmtree(os.path.join(root, "dcp"), ignore_errors=True)
                shutil.rmtree(os.path.join(root, "store", "bench"), ignore_errors=True)
            dist.barrier()
    finish()


def _measure_loads(rank: int, args: argparse.Namespace, client: Any, model: torch.nn.Module,
                   opt: torch.optim.Optimizer, nbytes: int, root: str,
                   results: dict[str, dict[str, Any]]) -> None:
    """Save once through the daemon, then time loads of it by each LOAD_VARIANTS path."""
    from ckptd_client import CheckpointClient

    client.save(model, optimizer=opt, step=1, timeout=600)
    embedded = CheckpointClient("bench", storage=f"file://{root}/store")
    storage = client._transport.storage()
    for i in range(args.warmup + args.reps):
        for variant in LOAD_VARIANTS:
            res = results.setdefault(variant, {"load": [], "shm_bytes": [], "stream_bytes": []})
            os.environ["CKPTD_SHM_READS"] = "0" if variant == "load-stream" else "1"
            before = dict(storage.read_bytes)
            dist.barrier()
            t0 = time.perf_counter()
            (embedded if variant == "load-embedded" else client).load(model, optimizer=opt)
            dt = time.perf_counter() - t0
            dist.barrier()
            if i >= args.warmup:
                res["load"].append(dt)
                res["shm_bytes"].append(storage.read_bytes["shared_memory"]
                                        - before["shared_memory"])
                res["stream_bytes"].append(storage.read_bytes["stream"] - before["stream"])
    embedded.close()


def _report_loads(args: argparse.Namespace, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    total = sum(r["nbytes"] for r in ranks)
    print(f"\nckptd load benchmark: world {args.world}, FSDP2 {args.layers} x Linear({args.dim}) "
          f"+ AdamW, {ranks[0]['nbytes'] / 1e9:.3f} GB/rank, {total / 1e9:.3f} GB total; "
          f"medians of {args.reps} reps (slowest rank), {args.warmup} warmup")
    print(f"{'variant':15s} {'load s':>8s} {'GB/s/rank':>10s} {'min s':>7s} {'max s':>7s} "
          f"{'via shm MB':>11s} {'via stream MB':>14s}")
    table: dict[str, Any] = {}
    for v in LOAD_VARIANTS:
        per_rep = [max(vals) for vals in zip(*(r["results"][v]["load"] for r in ranks))]
        med = statistics.median(per_rep)
        shm = statistics.median(ranks[0]["results"][v]["shm_bytes"]) / 1e6
        stream = statistics.median(ranks[0]["results"][v]["stream_bytes"]) / 1e6
        table[v] = {"load": med, "runs": per_rep, "shm_mb_rank0": shm, "stream_mb_rank0": stream}
        print(f"{v:15s} {med:8.3f} {ranks[0]['nbytes'] / med / 1e9:10.2f} {min(per_rep):7.3f} "
              f"{max(per_rep):7.3f} {shm:11.1f} {stream:14.1f}")
    emb = table["load-embedded"]["load"]
    print(f"\nload-shm / load-embedded {table['load-shm']['load'] / emb:.2f}x, "
          f"load-stream / load-embedded {table['load-stream']['load'] / emb:.2f}x, "
          f"load-shm / load-stream {table['load-shm']['load'] / table['load-stream']['load']:.2f}x"
          f" (rank 0 byte counts are for its DaemonStorage; embedded reads files directly)")
    return table


# -- launcher --------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dd(path: str, nbytes: int) -> tuple[float, int]:
    count = max(1, -(-nbytes // (64 << 20)))
    t0 = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}",
                    "conv=fsync"], check=True, capture_output=True)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return count * (64 << 20) / dt, count


def _vm(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        m = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(m.group(1)) * 1024 if m else 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client"))
    from ckptd.daemon.segments import segment_size
    from ckptd.daemon.testing import start_daemon

    root = args.root or tempfile.mkdtemp(prefix="ckptd-bench-")
    os.makedirs(root, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="ckb-", dir="/tmp")
    per_rank_est = (args.dim * args.dim + args.dim) * args.layers * 4 * 3 // args.world
    staging = args.staging_bytes or str(2 * args.world * segment_size(per_rank_est + (8 << 20)))
    daemon = start_daemon(f"file://{root}/store", os.path.join(run_dir, "s", "ckptd.sock"),
                          staging_bytes=staging, write_concurrency=8,
                          log_path=os.path.join(root, "daemon.log"), verbose=args.phases)
    out_dir = tempfile.mkdtemp(prefix="ckptd-bench-out-")
    try:
        baseline_rss = _vm(daemon.pid, "VmRSS")
        mp.start_processes(rank_main, args=(args.world, _free_port(), args, daemon.address,
                                            root, out_dir),
                           nprocs=args.world, join=True, start_method="spawn")
        peak_rss = _vm(daemon.pid, "VmHWM")
    finally:
        daemon.stop()
    daemon_log = daemon.log()
    ranks = []
    for r in range(args.world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    shutil.rmtree(out_dir, ignore_errors=True)
    total = sum(r["nbytes"] for r in ranks)
    if args.load:
        table = _report_loads(args, ranks)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"load": table, "total_bytes": total, "args": vars(args)}, f, indent=2)
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        return 0
    dd_idle = [_dd(os.path.join(root, "dd.bin"), total)[0] for _ in range(3)]
    dd_all = [x for v in ranks[0]["results"].values() for x in v.get("dd", [])]
    dd_rate = statistics.median(dd_all) if dd_all else _dd(os.path.join(root, "dd.bin"), total)[0]
    dd_count = max(1, -(-total // (64 << 20)))

    def med(variant: str, key: str) -> float:
        per_rep = zip(*(r["results"][variant][key] for r in ranks))
        return statistics.median(max(vals) for vals in per_rep)

    variants = [v for v in args.variants.split(",")]
    table = {v: {"stall": med(v, "stall"), "commit": med(v, "commit")} for v in variants}
    for v in variants:  # persist vs dd paired per repetition (the disk's speed drifts a lot)
        dd = ranks[0]["results"][v].get("dd")
        if dd:
            per_rep = [total / max(1e-9, max(c) - max(s)) / d for c, s, d in zip(
                zip(*(r["results"][v]["commit"] for r in ranks)),
                zip(*(r["results"][v]["stall"] for r in ranks)), dd)]
            table[v]["persist_vs_dd"] = statistics.median(per_rep)
    if "ckptd-overlap" in variants:
        table["ckptd-overlap"]["fwd_bwd"] = med("ckptd-overlap", "fwd_bwd")
    print(f"\nckptd save benchmark: world {args.world}, FSDP2 {args.layers} x Linear({args.dim}) "
          f"+ AdamW, {ranks[0]['nbytes'] / 1e9:.3f} GB/rank, {total / 1e9:.3f} GB total; "
          f"medians of {args.reps} reps (slowest rank), {args.warmup} warmup")
    print(f"{'variant':15s} {'stall s':>9s} {'commit s':>9s} {'persist GB/s':>13s} "
          f"{'persist/dd':>11s}")
    for v in variants:
        t = table[v]
        t["persist_gbps"] = 0.0 if v == "floor" else total / max(1e-9, t["commit"] - t["stall"]) / 1e9
        persist = "" if v == "floor" else f"{t['persist_gbps']:13.2f}"
        ratio = f"{t['persist_vs_dd']:11.2f}" if "persist_vs_dd" in t else ""
        print(f"{v:15s} {t['stall']:9.3f} {t['commit']:9.3f} {persist} {ratio}")
    print(f"dd bs=64M count={dd_count} conv=fsync: {dd_rate / 1e9:.2f} GB/s (median of "
          f"{len(dd_all)} runs, one right after each measured save; range "
          f"{min(dd_all, default=dd_rate) / 1e9:.2f}-{max(dd_all, default=dd_rate) / 1e9:.2f}); "
          f"on the idle disk after the run: {statistics.median(dd_idle) / 1e9:.2f} GB/s (median of "
          "3: " + ", ".join(f"{x / 1e9:.2f}" for x in dd_idle) + ")")
    if "ckptd-overlap" in variants:
        print("(ckptd-overlap: commit includes the forward/backward that ran meanwhile, "
              f"{table['ckptd-overlap']['fwd_bwd']:.3f} s)")
    if args.phases and "ckptd-copy" in variants:
        print("\nckptd-copy stall by phase, ms (mean over reps; per rank; submit.* are parts "
              "of submit):")
        for r, rk in enumerate(ranks):
            reps = rk["results"]["ckptd-copy"].get("phases", [])
            keys = list(reps[0]) if reps else []
            print(f"  rank {r}: " + ", ".join(
                f"{k} {statistics.mean(p.get(k, 0.0) for p in reps) * 1e3:.1f}"
                for k in keys))
        handler = [tuple(float(x) for x in m) for m in re.findall(
            r"Save \S+: check ([\d.]+) ms, parse ([\d.]+) ms, submit ([\d.]+) ms", daemon_log)]
        if handler:
            print("  daemon Save handler: " + ", ".join(
                f"{k} {statistics.median(h[j] for h in handler):.1f}"
                for j, k in enumerate(("check", "parse", "submit"))) +
                  f" (median of all {len(handler)} Saves)")
    summary: dict[str, Any] = {"table": table, "dd_gbps": dd_rate / 1e9,
                               "dd_idle_gbps": [x / 1e9 for x in dd_idle], "total_bytes": total,
                               "per_rank_bytes": ranks[0]["nbytes"],
                               "staging_bytes": staging, "daemon_rss_baseline": baseline_rss,
                               "daemon_rss_peak": peak_rss, "args": vars(args)}
    if {"ckptd-copy", "dcp", "dcp-reuse", "floor"} <= set(variants):
        best_dcp = min(table["dcp"]["stall"], table["dcp-reuse"]["stall"])
        copy = table["ckptd-copy"]["stall"]
        checks = {
            "copy stall / best DCP stall (target <= 0.8)": copy / best_dcp,
            "copy stall / floor (target <= 1.3)": copy / table["floor"]["stall"],
            "persist / dd, paired per rep (target >= 0.8)": table["ckptd-copy"].get(
                "persist_vs_dd", table["ckptd-copy"]["persist_gbps"] / (dd_rate / 1e9)),
            "DCP persist / dd, paired per rep": table["dcp"].get("persist_vs_dd", 0.0),
            "persist / dd on the idle disk after the run": (
                table["ckptd-copy"]["persist_gbps"] / (statistics.median(dd_idle) / 1e9)),
        }
        if "ckptd-overlap" in variants:
            checks["overlap wait / copy stall (target <= 0.1)"] = (
                table["ckptd-overlap"]["stall"] / copy)
            checks["fwd+bwd / copy stall (overlap needs > 1)"] = (
                table["ckptd-overlap"]["fwd_bwd"] / copy)
        from ckptd.daemon.config import parse_size

        budget = parse_size(staging)
        checks["daemon peak RSS - budget, MB (target <= 300)"] = (peak_rss - budget) / 1e6
        summary["checks"] = checks
        print()
        for k, v in checks.items():
            print(f"{k:52s} {v:8.3f}")
        print(f"daemon RSS: {baseline_rss / 1e6:.0f} MB idle, {peak_rss / 1e6:.0f} MB peak; "
              f"staging budget {budget / 1e6:.0f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    if not args.root:
        shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
