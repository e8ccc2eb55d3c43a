"""A multi-process job whose CheckpointClient does not see the job's process group (none
initialized under a launcher, or the client created before init_process_group): each rank
ran as the only rank of a world-size-1 job and saved the same step over the others, losing
all but one rank's shards without an error.  Both are a ConfigError that says what to do,
and nothing is saved."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from ckptd_client import CheckpointClient
from distributed import run_world

from ckptd.errors import ConfigError


def mistakes_job(rank: int, world: int, root: str) -> None:
    def init() -> None:
        dist.init_process_group("gloo", init_method=f"file://{root}/pg-file", rank=rank,
                                world_size=world)

    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 3)
    # as if the script never called init_process_group (WORLD_SIZE is set, as torchrun does)
    dist.destroy_process_group()
    try:
        early = CheckpointClient("pg", storage=f"file://{root}")
        with pytest.raises(ConfigError, match=rf"WORLD_SIZE={world} is set .* no torch."
                                              r"distributed process group is initialized.*"
                                              r"init_process_group"):
            early.save(model, step=1)
        init()
        with pytest.raises(ConfigError, match=r"created before torch.distributed."
                                              rf"init_process_group\(\).*now has {world} ranks"):
            early.save(model, step=1)
        with pytest.raises(ConfigError, match=r"created before"):
            early.load(model)
        early.close()
    finally:
        if not dist.is_initialized():  # run_world's teardown needs it
            init()
    client = CheckpointClient("pg", storage=f"file://{root}")
    assert client.list_steps() == []  # nothing was saved by the refused saves
    info = client.save(model, step=2)
    assert info.world_size == world
    client.close()


@pytest.mark.slow
def test_a_client_without_the_jobs_process_group_refuses_to_save(tmp_path):
    root = str(tmp_path)
    os.makedirs(root, exist_ok=True)
    run_world(mistakes_job, 2, root)
