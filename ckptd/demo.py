"""``ckptd demo``: the main job end to end on one machine, no external service.

Trains a small FSDP2 model on N CPU ranks (gloo), saves with ``client.save_async`` every
few steps (through a ``ckptd serve`` daemon it starts itself, or in embedded mode with
``--embedded``), then restores the latest checkpoint into a job of another world size and
checks that every parameter and optimizer state is bit-identical.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from typing import Any

DEFAULT_STORAGE = "demo-out/ckpt"


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo", help="train, save and reload a small FSDP2 job (no setup needed)",
        description="Train a small FSDP2 model on CPU ranks (gloo), save it every few steps "
                    "through a ckptd daemon it starts (or embedded), then reload the latest "
                    "step at another world size and check it is bit-identical.")
    p.add_argument("--storage", default=DEFAULT_STORAGE,
                   help=f"checkpoint location (path, file:// or s3:// URI; default {DEFAULT_STORAGE})")
    p.add_argument("--job", default="demo", help="job name (default demo)")
    p.add_argument("--world-size", type=int, default=2,
                   help="ranks that train and save (default 2)")
    p.add_argument("--load-world-size", type=int, default=3, help="ranks that reload (default 3)")
    p.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    p.add_argument("--save-every", type=int, default=2, help="save every N steps (default 2)")
    p.add_argument("--hidden", type=int, default=512, help="model width (default 512)")
    p.add_argument("--embedded", action="store_true",
                   help="write from the training processes instead of a daemon")
    p.set_defaults(func=run)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model(hidden: int) -> Any:
    import torch

    return torch.nn.Sequential(
        torch.nn.Embedding(97, hidden), torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
        torch.nn.Linear(4 * hidden, hidden), torch.nn.LayerNorm(hidden),
        torch.nn.Linear(hidden, 97, bias=False))


def _wrap(model: Any, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _full(model: Any, opt: Any) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    o = StateDictOptions(full_state_dict=True)
    out = {f"model/{k}": v for k, v in get_model_state_dict(model, options=o).items()}
    for fqn, st in get_optimizer_state_dict(model, opt, options=o)["state"].items():
        out.update({f"optim/{fqn}/{k}": v for k, v in st.items()})
    return out


def _rank_main(rank: int, world: int, port: int, phase: str, args: argparse.Namespace,
               target: dict, scratch: str) -> None:
    import torch
    import torch.distributed as dist

    from ckptd_client import CheckpointClient

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0 if phase == "train" else 1)
        model = _wrap(_model(args.hidden), world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        client = CheckpointClient(args.job, **target)
        say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
        if phase == "train":
            gen = torch.Generator().manual_seed(rank)
            handles = []
            for step in range(1, args.steps + 1):
                x = torch.randint(0, 97, (16, 8), generator=gen)
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                if step % args.save_every == 0:
                    t0 = time.perf_counter()
                    handles.append(client.save_async(model, optimizer=opt, step=step,
                                                     extra={"loss": loss.item()}))
                    say(f"[train x{world}] step {step}: loss {loss.item():.4f}, save_async "
                        f"returned in {1e3 * (time.perf_counter() - t0):.1f} ms")
            for h in handles:
                info = h.result(timeout=600)
                say(f"[train x{world}] step {info.step} committed ({info.nbytes / 1e6:.1f} MB "
                    f"from rank 0, attempt {info.attempt})")
            full = _full(model, opt)
            if rank == 0:
                torch.save(full, os.path.join(scratch, "expected.pt"))
        else:
            info = client.load(model, optimizer=opt)
            say(f"[load x{world}] restored step {info.step} saved by {info.framework} at world "
                f"size {info.world_size} (extra: {info.extra})")
            got = _full(model, opt)
            want = torch.load(os.path.join(scratch, "expected.pt"), weights_only=True)
            bad = [k for k in want if not torch.equal(got[k], want[k])]
            if bad or sorted(got) != sorted(want):
                raise SystemExit(f"rank {rank}: restored state differs in {bad[:5]}")
            say(f"[load x{world}] all {len(want)} parameter and optimizer tensors are "
                "bit-identical to the trained job's")
        client.close()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _launch(world: int, phase: str, args: argparse.Namespace, target: dict, scratch: str) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(_rank_main, args=(world, _free_port(), phase, args, target, scratch),
                       nprocs=world, join=True, start_method="spawn")


def run(args: argparse.Namespace) -> int:
    storage = args.storage
    if "://" not in storage:
        storage = "file://" + os.path.abspath(storage)
    if args.world_size < 1 or args.load_world_size < 1:
        print("ckptd demo: world sizes must be >= 1", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="ckptd-demo-") as scratch:
        daemon = None
        if args.embedded:
            target: dict = {"storage": storage}
            print(f"ckptd demo: embedded mode, writing to {storage}")
        else:
            from ckptd.daemon.testing import start_daemon

            sock = os.path.join(scratch, "run", "ckptd.sock")
            daemon = start_daemon(storage, sock)
            target = {"daemon": f"unix://{sock}"}
            print(f"ckptd demo: started `ckptd serve --storage {storage} --socket {sock}`")
        try:
            t0 = time.perf_counter()
            _launch(args.world_size, "train", args, target, scratch)
            _launch(args.load_world_size, "load", args, target, scratch)
        finally:
            if daemon is not None:
                daemon.stop()
        print(f"ckptd demo: OK in {time.perf_counter() - t0:.1f}s: trained and saved at world "
              f"size {args.world_size}, restored bit-exactly at world size "
              f"{args.load_world_size}. Try `ckptd ls {storage}` and "
              f"`ckptd inspect {storage}/{args.job}`.")
    return 0
