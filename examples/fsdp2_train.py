"""Train a Hugging Face causal LM with PyTorch FSDP2, checkpoint with ckptd, resume anywhere.

    # CPU, tiny (what CI runs):
    torchrun --standalone --nproc_per_node=2 examples/fsdp2_train.py --steps 4 --save-every 2 \
        --storage file:///tmp/ckpt --tiny
    torchrun --standalone --nproc_per_node=3 examples/fsdp2_train.py --steps 6 --resume \
        --storage file:///tmp/ckpt --tiny
    # GPUs, through the node's daemon:
    torchrun --nproc_per_node=8 examples/fsdp2_train.py --daemon unix:///run/ckptd/ckptd.sock

The model is built from a config (no weights are downloaded).  Each decoder layer is its own
FSDP2 unit.  The LR scheduler and the data position are saved as extra state; `--resume`
restores the latest committed step at whatever world size this run has.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ckptd_client import CheckpointClient


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--storage", help="embedded mode: file:// or s3:// URI")
    where.add_argument("--daemon", help="daemon address, e.g. unix:///run/ckptd/ckptd.sock")
    p.add_argument("--job", default="fsdp2-hf")
    p.add_argument("--steps", type=int, default=20, help="train until this global step")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--resume", action="store_true", help="load the latest checkpoint first")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model for CPU runs")
    p.add_argument("--overlap", action="store_true", help="save_async(..., overlap=True)")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    return p.parse_args()


def build_model(tiny: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128)
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                          num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8)
    return LlamaForCausalLM(cfg)


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
    model = build_model(args.tiny).to(device)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))

    client = CheckpointClient(args.job, storage=args.storage, daemon=args.daemon)
    step = 0
    if args.resume:
        info = client.load(model, optimizer=opt)
        sched.load_state_dict(info.extra["sched"])
        step = info.extra["step"]
        if rank == 0:
            print(f"resumed step {step} (saved at world size {info.world_size}, now {world})",
                  flush=True)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1000 * rank + step)
    handles = []
    while step < args.steps:
        x = torch.randint(0, vocab, (args.batch, args.seq_len), generator=gen).to(device)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        step += 1
        if step % args.save_every == 0:
            t0 = time.perf_counter()
            handles.append(client.save_async(model, optimizer=opt, step=step, overlap=args.overlap,
                                             extra={"sched": sched.state_dict(), "step": step}))
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}; save_async returned in "
                      f"{1e3 * (time.perf_counter() - t0):.1f} ms", flush=True)
    for h in handles:
        info = h.result()
        if rank == 0:
            print(f"committed step {info.step} ({info.world_size} ranks)", flush=True)
    client.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
