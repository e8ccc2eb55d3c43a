"""Run a function on N real gloo ranks, started from a forkserver that imported torch once.

``tests/distributed.py``'s ``run_world`` spawns fresh interpreters (about 2.5 s of CPU
each on the 2-core machine, so 16 ranks take ~40 s).  Here the processes fork from a
server that preloaded torch, FSDP and fairscale: 16 ranks start in well under a second.
The ranks are still separate processes with their own gloo process group.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp
from distributed import _entry, free_port

PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "fairscale.nn",
           "ckptd_client", "ckptd.format.reader", "distributed"]
_ready = False


def _setup() -> None:
    global _ready
    if not _ready:
        multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
        _ready = True


def run_world_fast(fn: Callable[..., Any], world: int, *args: Any) -> None:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; re-raises a rank's failure."""
    _setup()
    mp.start_processes(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True,
                       start_method="forkserver")
