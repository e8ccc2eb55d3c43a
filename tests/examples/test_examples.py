"""The examples run as documented (torchrun, tiny sizes, CPU): train, save, resume at
another world size."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ckptd.format.commit import committed_steps
from ckptd.storage import open_storage

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def torchrun(nproc: int, script: str, *args: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", os.path.join(ROOT, "examples", script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script,job,size", [
    ("fsdp2_train.py", "fsdp2-hf", ["--tiny"]),
    ("fairscale_train.py", "fairscale-fsdp", ["--hidden", "64"]),
])
def test_example_trains_saves_and_resumes_at_another_world_size(tmp_path, script, job, size):
    uri = f"file://{tmp_path}"
    out = torchrun(2, script, "--steps", "4", "--save-every", "2", "--storage", uri, *size)
    assert "committed step 4 (2 ranks)" in out
    out = torchrun(3, script, "--steps", "6", "--save-every", "2", "--resume", "--storage", uri,
                   *size)
    assert "resumed step 4 (saved at world size 2, now 3" in out
    assert "committed step 6 (3 ranks)" in out
    assert committed_steps(open_storage(uri), job) == [2, 4, 6]


@pytest.mark.slow
def test_reshard_and_export_example_then_resume_at_the_new_world_size(tmp_path):
    uri = f"file://{tmp_path}"
    torchrun(2, "fsdp2_train.py", "--steps", "2", "--save-every", "2", "--storage", uri, "--tiny")
    out_file = tmp_path / "model.safetensors"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "reshard_and_export.py"),
         f"{uri}/fsdp2-hf", "--to-world-size", "4", "--out", f"{uri}/hf-w4",
         "--export", str(out_file)],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verify: OK" in proc.stdout

    from safetensors.torch import load_file

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from fsdp2_train import build_model

    names = set(build_model(tiny=True).state_dict())
    assert set(load_file(str(out_file))) == names
    out = torchrun(4, "fsdp2_train.py", "--job", "hf-w4", "--steps", "4", "--save-every", "2",
                   "--resume", "--storage", uri, "--tiny")
    assert "resumed step 2 (saved at world size 4, now 4" in out
    assert "committed step 4 (4 ranks)" in out
