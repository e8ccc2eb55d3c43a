"""fairscale FSDP (flattened parameters) with mixed precision, checkpointed by ckptd.

The classic example: two ``nn.Linear(4096, 4096)`` layers, wrapped with
``enable_wrap(wrapper_cls=FSDP)`` + ``auto_wrap``, autocast + GradScaler (whose state is
saved too), ``client.save_async`` every few steps, and ``--resume`` at any world size.

    # GPUs:
    torchrun --nproc_per_node=4 examples/fairscale_train.py --storage file:///ckpt
    torchrun --nproc_per_node=2 examples/fairscale_train.py --storage file:///ckpt --resume --steps 40
    # CPU (what CI runs):
    torchrun --standalone --nproc_per_node=2 examples/fairscale_train.py --hidden 64 --steps 4 \
        --save-every 2 --storage file:///tmp/ckpt

fairscale FSDP runs forward/backward only on CUDA.  On CPU this example exercises the
checkpoint path only: each "step" sets deterministic gradients on the flat shards and runs
the optimizer (so parameters and Adam state change exactly as training would change them),
then saves; `--resume` restores into a job of another world size.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from fairscale.nn import auto_wrap, enable_wrap
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP

from ckptd_client import CheckpointClient


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--storage", help="embedded mode: file:// or s3:// URI")
    where.add_argument("--daemon", help="daemon address, e.g. unix:///run/ckptd/ckptd.sock")
    p.add_argument("--job", default="fairscale-fsdp")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20, help="train until this global step")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--resume", action="store_true")
    return p.parse_args()


def main() -> None:
    args = parse()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    h = args.hidden
    fsdp_kwargs = dict(flatten_parameters=True, mixed_precision=cuda,
                       compute_device=device)
    with enable_wrap(wrapper_cls=FSDP, **fsdp_kwargs):
        body = torch.nn.Sequential(torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, h))
        model = FSDP(auto_wrap(body.to(device)), **fsdp_kwargs)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if cuda:
        from fairscale.optim.grad_scaler import ShardedGradScaler

        scaler = ShardedGradScaler()
    else:
        scaler = torch.amp.GradScaler("cpu", enabled=True)

    client = CheckpointClient(args.job, storage=args.storage, daemon=args.daemon)
    step = 0
    if args.resume:
        info = client.load(model, optimizer=opt)
        scaler.load_state_dict(info.extra["scaler"])
        step = info.extra["step"]
        if rank == 0:
            print(f"resumed step {step} (saved at world size {info.world_size}, now {world}; "
                  f"loss scale {scaler.get_scale()})", flush=True)
    gen = torch.Generator().manual_seed(1000 * rank + step)
    handles = []
    while step < args.steps:
        if cuda:
            x = torch.randn(8, h, generator=gen).to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:  # no forward/backward on CPU: deterministic gradients on the flat shards
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            opt.step()
            loss = torch.tensor(0.0)
        opt.zero_grad()
        step += 1
        if step % args.save_every == 0:
            t0 = time.perf_counter()
            handles.append(client.save_async(model, optimizer=opt, step=step,
                                             extra={"scaler": scaler.state_dict(), "step": step}))
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}; save_async returned in "
                      f"{1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
    for hd in handles:
        info = hd.result()
        if rank == 0:
            print(f"committed step {info.step} ({info.world_size} ranks)", flush=True)
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
