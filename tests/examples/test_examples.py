"""The examples run as documented (torchrun, tiny sizes, CPU): train, save, resume at
another world size."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

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


def _readme_example() -> str:
    """The Python block of README.md's "Using it", as written."""
    import re

    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    match = re.search(r"## Using it\n\n```python\n(.*?)```", text, re.DOTALL)
    assert match, "README.md has no ```python block under '## Using it'"
    return match.group(1)


@pytest.mark.slow
def test_readme_example_runs_as_written_and_resumes_bit_exactly(tmp_path, monkeypatch):
    """README's training loop, unedited, through a real daemon (the address it names is
    mapped to the test's socket): a run interrupted after its step-0 save and resumed ends
    with the same model, optimizer and LR schedule as a run that did not stop."""
    import ckptd_client

    from ckptd.daemon.testing import start_daemon

    socket = str(tmp_path / "run" / "ckptd.sock")
    jobs: list[str] = []

    class Client(ckptd_client.CheckpointClient):
        """The documented job and daemon address, mapped to this run's job and socket."""

        def __init__(self, job, storage=None, daemon=None, **kw):
            assert (job, daemon, storage) == ("llama-ft", "unix:///run/ckptd/ckptd.sock", None)
            super().__init__(jobs[-1], daemon=f"unix://{socket}", **kw)

    monkeypatch.setattr(ckptd_client, "CheckpointClient", Client)
    code = _readme_example()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(4, 8, generator=g) for _ in range(4)]

    def run(job: str, loader: list, seed: int) -> dict:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 3))
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        ns = {"model": model, "opt": opt, "sched": sched, "loader": loader}
        jobs.append(job)
        exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 - the README's own code
        return ns

    with start_daemon(f"file://{tmp_path / 'ckpt'}", socket, staging_bytes="64MiB"):
        whole = run("whole", batches, seed=0)
        first = run("resumed", batches[:1], seed=0)
        assert "info" not in first and first["handle"].result(60).step == 0
        second = run("resumed", batches[1:], seed=5)     # another init: load replaces it
        assert second["info"].step == 0 and second["start"] == 1
    for a, b in zip(whole["model"].state_dict().values(), second["model"].state_dict().values()):
        assert torch.equal(a, b)
    sa, sb = whole["opt"].state_dict(), second["opt"].state_dict()
    for i in sa["state"]:
        for k in sa["state"][i]:
            assert torch.equal(sa["state"][i][k], sb["state"][i][k]), (i, k)
    assert whole["sched"].state_dict() == second["sched"].state_dict()
    assert whole["opt"].param_groups[0]["lr"] == second["opt"].param_groups[0]["lr"] == 0.0025
