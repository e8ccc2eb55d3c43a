"""A trainer rank that SIGKILLs itself right after save_async returns (run as a script by
test_daemon_crash.py): ``python trainer_kill.py RANK WORLD PORT ROOT DAEMON_ADDRESS``."""

from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    rank, world, port = (int(x) for x in sys.argv[1:4])
    root, address = sys.argv[4:6]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from ckptd_client import CheckpointClient
    from daemon_helpers import fsdp

    model, opt = fsdp.build("fsdp2", world, seed=1)
    fsdp.train(model, opt, 2, rank)
    expected = fsdp.full_state(model, opt)
    if rank == 0:
        torch.save(expected, os.path.join(root, "killed.expected.pt"))
    client = CheckpointClient("killed", daemon=address)
    dist.barrier()
    client.save_async(model, optimizer=opt, step=7)  # returns once the daemon has the bytes
    with open(os.path.join(root, f"handed-over-{rank}"), "w") as f:
        f.write("ok")
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
