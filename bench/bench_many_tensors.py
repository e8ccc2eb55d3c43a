"""Many-tensor benchmark: ckptd vs torch.distributed.checkpoint (DCP) for models with
thousands of small and medium tensors, in the same run and process group.

    python bench/bench_many_tensors.py                          # both models, 1 and 2 ranks,
                                                                # FSDP2 and plain, with a daemon
    python bench/bench_many_tensors.py --models flat --flat 5000 --worlds 1 --wraps plain
    python bench/bench_many_tensors.py --no-daemon --reps 2     # embedded ckptd and DCP only

Models (AdamW state included, after one training step):

* ``layers``: ``--layers`` (48) transformer-like blocks of width ``--dim`` (128), 10 tensors
  each (q/k/v/o weights, two norm weights, two MLP weights and biases): 480 parameters,
  1,921 optimizer tensors;
* ``flat``: ``--flat`` (5000) children ``Linear(8, 8, bias=False)`` of one ``ModuleList``
  (a flat container with thousands of children): 5000 parameters, 15,001 optimizer tensors.

Wraps: ``fsdp2`` (``fully_shard`` per block and on the root) and ``plain`` (no wrapper; each
rank saves the same replicated module, which one rank writes).

For each model x world size x wrap, the launcher spawns ``world`` gloo ranks, which time,
per repetition (variants interleaved, so the machine's drift hits all alike; after
``--warmup`` unmeasured repetitions; medians over repetitions of the slowest rank):

* ``dcp``        -- ``dcp.save(get_state_dict(...))``: stall = commit;
* ``dcp-async``  -- ``dcp.async_save``: stall until it returns, commit until it is written;
* ``ckptd``      -- ``client.save_async`` embedded (``storage=file://``);
* ``ckptd-d``    -- ``client.save_async`` through a real ``ckptd serve`` (``--no-daemon``
                    leaves it out);

and for loads (into parameters and optimizer state perturbed beforehand; the result is
checked bit-exact against the saved values):

* ``dcp``        -- ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``;
* ``ckptd`` / ``ckptd-d`` -- ``client.load(model, optimizer=opt)``, embedded / daemon.

The table prints stall, commit and load seconds and the ratios ckptd / DCP (for saves,
against the better of dcp and dcp-async).  Checkpoints go under ``--root`` (default a
temporary directory, removed afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SAVE_VARIANTS = ("dcp", "dcp-async", "ckptd", "ckptd-d")
LOAD_VARIANTS = ("dcp", "ckptd", "ckptd-d")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="layers,flat", help="layers, flat, or both")
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--flat", type=int, default=5000, help="children of the flat model")
    p.add_argument("--worlds", default="1,2", help="world sizes, comma-separated")
    p.add_argument("--wraps", default="fsdp2,plain", help="fsdp2, plain, or both")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-daemon", action="store_true", help="leave out the ckptd-d variants")
    p.add_argument("--root", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results as JSON here")
    return p.parse_args(argv)


# -- models ----------------------------------------------------------------------------------
class Block(torch.nn.Module):
    """10 tensors: q, k, v, o, two norm weights, MLP fc1/fc2 weights and biases."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.k = torch.nn.Linear(dim, dim, bias=False)
        self.v = torch.nn.Linear(dim, dim, bias=False)
        self.o = torch.nn.Linear(dim, dim, bias=False)
        self.norm1 = torch.nn.RMSNorm(dim)
        self.norm2 = torch.nn.RMSNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.o(self.q(h) * torch.sigmoid(self.k(h)) + self.v(h))
        return x + self.fc2(torch.relu(self.fc1(self.norm2(x))))


class Layers(torch.nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim) for _ in range(layers))
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


class Flat(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False) for _ in range(n))
        self.dim = 8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(p(x) for p in self.parts)  # type: ignore[return-value]


def _local(t: Any) -> torch.Tensor:
    return (t._local_tensor if hasattr(t, "_local_tensor") else t).detach()


def _live_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out.append(_local(p))
        out += [_local(v) for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return out


# -- ranks -----------------------------------------------------------------------------------
def rank_main(rank: int, world: int, port: int, cfg: dict[str, Any], address: str | None,
              root: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp
    from ckptd_client import CheckpointClient
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model: torch.nn.Module = (Layers(cfg["dim"], cfg["layers"]) if cfg["model"] == "layers"
                              else Flat(cfg["flat"]))
    if cfg["wrap"] == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for b in getattr(model, "blocks", []):
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # the same batch on every rank: a plain (unwrapped) module is a replica, equal everywhere
    x = torch.randn(4, model.dim, generator=torch.Generator().manual_seed(1))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    live = _live_tensors(model, opt)
    ntensors = len(live)
    nbytes = sum(t.numel() * t.element_size() for t in live)

    dcp_pg = dist.new_group(backend="gloo")
    job = f"{cfg['model']}-{cfg['wrap']}-w{world}"
    emb_uri = f"file://{root}/store"
    clients = {"ckptd": CheckpointClient(f"{job}-emb", storage=emb_uri)}
    loaders = {"ckptd": CheckpointClient(f"{job}-load", storage=emb_uri)}
    if address is not None:
        clients["ckptd-d"] = CheckpointClient(f"{job}-d", daemon=address)
        loaders["ckptd-d"] = CheckpointClient(f"{job}-load", daemon=address)
    save_variants = [v for v in SAVE_VARIANTS if v.startswith("dcp") or v in clients]
    load_variants = [v for v in LOAD_VARIANTS if v == "dcp" or v in loaders]

    def dcp_state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    # the reference checkpoint every load restores (ckptd's saved through the daemon if any)
    ref_dir = os.path.join(root, "dcp", job, "ref")
    dcp.save(dcp_state(), checkpoint_id=ref_dir, process_group=dcp_pg)
    loaders.get("ckptd-d", loaders["ckptd"]).save(model, optimizer=opt, step=0)
    reference = [t.clone() for t in live]

    results: dict[str, dict[str, list[float]]] = {}
    step = 0
    for i in range(cfg["warmup"] + cfg["reps"]):
        measured = i >= cfg["warmup"]
        for variant in save_variants:
            res = results.setdefault(f"save/{variant}", {"stall": [], "commit": []})
            step += 1
            dist.barrier()
            t0 = time.perf_counter()
            if variant == "dcp":
                dcp.save(dcp_state(), checkpoint_id=os.path.join(root, "dcp", job, str(step)),
                         process_group=dcp_pg)
                stall = time.perf_counter() - t0
            elif variant == "dcp-async":
                fut = dcp.async_save(dcp_state(),
                                     checkpoint_id=os.path.join(root, "dcp", job, str(step)),
                                     process_group=dcp_pg)
                stall = time.perf_counter() - t0
                getattr(fut, "upload_completion", fut).result()
            else:
                h = clients[variant].save_async(model, optimizer=opt, step=step)
                stall = time.perf_counter() - t0
                h.result(600)
            commit = time.perf_counter() - t0
            dist.barrier()
            if measured:
                res["stall"].append(stall)
                res["commit"].append(commit)
            if rank == 0:
                shutil.rmtree(os.path.join(root, "dcp", job, str(step)), ignore_errors=True)
        for variant in load_variants:
            res = results.setdefault(f"load/{variant}", {"load": []})
            with torch.no_grad():
                for t in live:
                    t.add_(1)
            dist.barrier()
            t0 = time.perf_counter()
            if variant == "dcp":
                msd, osd = get_state_dict(model, opt)
                state = {"model": msd, "optim": osd}
                dcp.load(state, checkpoint_id=ref_dir, process_group=dcp_pg)
                set_state_dict(model, opt, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])
            else:
                loaders[variant].load(model, optimizer=opt, step=0)
            dt = time.perf_counter() - t0
            dist.barrier()
            now = _live_tensors(model, opt)
            if len(now) != ntensors or not all(torch.equal(a, b) for a, b in zip(now, reference)):
                raise SystemExit(f"rank {rank}: load/{variant} did not restore the saved values")
            live = now
            if measured:
                res["load"].append(dt)
        if rank == 0:  # keep the disk small: drop the measured saves
            for name in (f"{job}-emb", f"{job}-d"):
                shutil.rmtree(os.path.join(root, "store", name), ignore_errors=True)
        dist.barrier()
    for c in (*clients.values(), *loaders.values()):
        c.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"ntensors": ntensors, "nbytes": nbytes, "results": results}, f)
    dist.barrier()
    dist.destroy_process_group()


# -- launcher --------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_slowest(ranks: list[dict[str, Any]], key: str, field: str) -> float:
    per_rep = zip(*(r["results"][key][field] for r in ranks))
    return statistics.median(max(v) for v in per_rep)


def run_config(cfg: dict[str, Any], world: int, address: str | None, root: str) -> dict:
    out_dir = tempfile.mkdtemp(prefix="ckptd-many-out-")
    try:
        mp.start_processes(rank_main, args=(world, _free_port(), cfg, address, root, out_dir),
                           nprocs=world, join=True, start_method="spawn")
        ranks = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    table: dict[str, Any] = {"tensors_per_rank": ranks[0]["ntensors"],
                             "bytes_per_rank": ranks[0]["nbytes"]}
    for key in ranks[0]["results"]:
        fields = ranks[0]["results"][key]
        table[key] = {f: _median_slowest(ranks, key, f) for f in fields}
    return table


def report(name: str, t: dict[str, Any]) -> None:
    print(f"\n{name}: {t['tensors_per_rank']} tensors/rank (params + AdamW state), "
          f"{t['bytes_per_rank'] / 1e6:.1f} MB/rank")
    print(f"  {'save':10s} {'stall s':>8s} {'commit s':>9s}   {'load':8s} {'load s':>7s}")
    saves = [k for k in t if k.startswith("save/")]
    loads = [k for k in t if k.startswith("load/")]
    for j in range(max(len(saves), len(loads))):
        left = (f"  {saves[j][5:]:10s} {t[saves[j]]['stall']:8.3f} {t[saves[j]]['commit']:9.3f}"
                if j < len(saves) else " " * 31)
        right = (f"   {loads[j][5:]:8s} {t[loads[j]]['load']:7.3f}" if j < len(loads) else "")
        print(left + right)
    best = {f: min(t["save/dcp"][f], t["save/dcp-async"][f]) for f in ("stall", "commit")}
    for v in ("ckptd", "ckptd-d"):
        if f"save/{v}" in t:
            s, ld = t[f"save/{v}"], t[f"load/{v}"]
            print(f"  {v:8s} / best DCP: stall {s['stall'] / best['stall']:.2f}x, commit "
                  f"{s['commit'] / best['commit']:.2f}x, load "
                  f"{ld['load'] / t['load/dcp']['load']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client"))
    from ckptd.daemon.testing import start_daemon

    root = args.root or tempfile.mkdtemp(prefix="ckptd-many-")
    os.makedirs(root, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="ckm-", dir="/tmp")
    daemon = None
    if not args.no_daemon:
        daemon = start_daemon(f"file://{root}/store", os.path.join(run_dir, "s", "ckptd.sock"),
                              staging_bytes="1GiB", log_path=os.path.join(root, "daemon.log"))
    results: dict[str, Any] = {}
    try:
        for model in args.models.split(","):
            for world in (int(w) for w in args.worlds.split(",")):
                for wrap in args.wraps.split(","):
                    cfg = {"model": model, "wrap": wrap, "layers": args.layers, "dim": args.dim,
                           "flat": args.flat, "warmup": args.warmup, "reps": args.reps}
                    name = (f"{model} ({args.layers} x dim {args.dim})" if model == "layers"
                            else f"flat ({args.flat} children)") + f", {wrap}, world {world}"
                    t0 = time.perf_counter()
                    results[name] = run_config(cfg, world, daemon and daemon.address, root)
                    report(name, results[name])
                    print(f"  (configuration took {time.perf_counter() - t0:.0f} s; medians of "
                          f"{args.reps} reps, slowest rank, {args.warmup} warmup)", flush=True)
    finally:
        if daemon is not None:
            daemon.stop()
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
