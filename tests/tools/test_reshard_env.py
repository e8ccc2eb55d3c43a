"""``ckptd reshard`` in a shell that a training job's launcher set up (a Kubernetes
PyTorchJob exports WORLD_SIZE, RANK and MASTER_* to every shell of its containers): one
worker, not a process group waiting for workers that never come."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from synth import write_step

from ckptd.format.commit import read_commit
from ckptd.storage import open_storage


def test_world_size_not_set_by_torchrun_runs_one_worker(tmp_path):
    storage = open_storage(str(tmp_path))
    write_step(storage, "job", 5, "att", world=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(WORLD_SIZE="4", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # the timeout only bounds a failure: a worker waiting for its group never returns
    proc = subprocess.run(
        [sys.executable, "-m", "ckptd.cli", "reshard", f"{tmp_path}/job", "--to-world-size", "3",
         "--out", f"{tmp_path}/out"], env=env, capture_output=True, text=True, timeout=120,
        check=False)
    assert proc.returncode == 0, proc.stderr
    assert "not by torchrun: running as a single reshard worker" in proc.stderr
    rec = read_commit(storage, "out", 5)
    assert rec is not None and rec.world_size == 3
