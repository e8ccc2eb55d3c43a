"""Small collectives over the training job's process group, on tensors (never pickled
objects): the device a backend needs, a short string from rank 0, the minimum of one
integer, and an all-gather of a few integers.  Callers run them from the training thread,
at the same point on every rank of ``group``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def device_for(group: Any = None) -> torch.device:
    """Where ``group``'s collectives take their tensors: CUDA for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_str(value: str, group: Any = None) -> str:
    """A short ASCII string (at most 64 bytes) of rank 0 of ``group``, on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    n = 64
    buf = torch.zeros(n, dtype=torch.uint8, device=device_for(group))
    if dist.get_rank(group) == 0:
        raw = value.encode()[:n]
        buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    dist.broadcast(buf, src=dist.get_global_rank(group, 0) if group is not None else 0,
                   group=group)
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode()


def min_over_ranks(value: int, group: Any = None) -> int:
    """The smallest ``value`` of all ranks of ``group``."""
    buf = torch.tensor([value], dtype=torch.int32, device=device_for(group))
    dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=group)
    return int(buf.item())


def all_gather_ints(values: list[int], group: Any = None) -> list[list[int]]:
    """Every rank's ``values`` (the same length on every rank, each fitting in int64), by
    rank of ``group``."""
    dev = device_for(group)
    mine = torch.tensor(values, dtype=torch.int64, device=dev)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [t.cpu().tolist() for t in out]
