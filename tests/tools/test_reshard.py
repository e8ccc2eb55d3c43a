"""``ckptd reshard`` end to end: FSDP2, FSDP1 and fairscale FSDP checkpoints saved by real
gloo ranks at world sizes 2 and 4 are resharded to 1, 3, 8 and 16 ranks, loaded by real
ranks at the new world size (bit-exact), and their chunk grids checked through zarr-python;
the source is never modified; a reshard killed with SIGKILL midway commits nothing; under
a torchrun-like group each worker takes its share."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import zarr
from conftest import FRAMEWORKS, SAVE_WORLDS
from fastworld import run_world_fast
from reshard_jobs import load_all, reshard_under_workers

from ckptd.cli import main
from ckptd.format import paths
from ckptd.format.commit import list_steps, read_index, resolve_step
from ckptd.format.layout import dim0_chunk_len, dim0_chunk_shape
from ckptd.format.reader import CheckpointReader
from ckptd.reshard.run import reshard
from ckptd.storage import open_storage

TARGETS = (1, 3, 8, 16)
pytestmark = pytest.mark.slow


def snapshot(root: str, job: str) -> dict[str, str]:
    """Every file under the job: relative path -> sha256 (to prove it is untouched)."""
    out = {}
    base = os.path.join(root, job)
    for d, _, files in os.walk(base):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, base)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def logical(storage, job: str) -> dict[str, torch.Tensor]:
    rec = resolve_step(storage, job, None)
    index = read_index(storage, rec)
    reader = CheckpointReader(storage, index, paths.attempt_prefix(job, rec.step, rec.attempt))
    return {n: reader.read_region(n) for n in index.tensors}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def check_grid(root: str, job: str, n: int, framework: str) -> None:
    """Chunk grids from the zarr metadata (read by zarr-python, not by ckptd)."""
    storage = open_storage(root)
    rec = resolve_step(storage, job, None)
    assert rec.world_size == n
    index = read_index(storage, rec)
    group = zarr.open_group(os.path.join(root, paths.attempt_prefix(job, rec.step,
                                                                    rec.attempt)), mode="r")
    assert group.attrs["ckptd"]["world_size"] == n
    expected = torch.load(os.path.join(root, f"{job.rsplit('-to', 1)[0]}.expected.pt"),
                          weights_only=True)
    seen = 0
    for name, a in index.arrays.items():
        if name in index.packs or name.startswith("_pieces/"):
            continue  # packs, and the per-rank extra-state tensors (read whole by one rank)
        arr = group[name]
        assert tuple(arr.shape) == a.shape
        if name.startswith("flat/"):
            want = (dim0_chunk_len(a.shape[0], n),)  # fairscale's shard length at n ranks
        elif framework == "fairscale" and name.startswith("model/") and ".running_" in name:
            want = tuple(a.shape)  # replicated buffer: stays whole, written once
        else:
            want = dim0_chunk_shape(a.shape, n)
        assert tuple(arr.chunks) == want, (job, name, arr.chunks, want)
        if framework != "fairscale" and name in expected:
            got = torch.from_numpy(arr[...].copy()) if a.shape else torch.tensor(arr[...])
            assert torch.equal(got, expected[name]), (job, name)
            seen += 1
    assert framework == "fairscale" or seen >= 6


def test_reshard_to_1_3_8_16_loads_bit_exact_at_the_new_world_size(work_root):
    root = work_root
    storage = open_storage(root)
    jobs: dict[int, dict[str, list[str]]] = {n: {fw: [] for fw in FRAMEWORKS} for n in TARGETS}
    for fw in FRAMEWORKS:
        for w in SAVE_WORLDS:
            src = f"{fw}-w{w}"
            before = snapshot(root, src)
            want = logical(storage, src)
            for n in TARGETS:
                out = f"{src}-to{n}"
                res = reshard(storage, src, None, n, out_job=out, pack_threshold=0, threads=3)
                assert (res.source_world_size, res.world_size, res.in_place) == (w, n, False)
                got = logical(storage, out)
                assert sorted(k for k in got if not k.startswith("_extra/")) == sorted(
                    k for k in want if not k.startswith("_extra/"))
                for k, v in want.items():
                    assert same_bits(got[k], v), (out, k)
                check_grid(root, out, n, fw)
                shutil.copy(os.path.join(root, f"{src}.expected.pt"),
                            os.path.join(root, f"{out}.expected.pt"))
                jobs[n][fw].append(out)
            assert snapshot(root, src) == before  # the source is never written to
    # in place: the step's COMMITTED switches to the new attempt, the old one stays
    old = resolve_step(storage, "fsdp1-w4", None)
    assert main(["reshard", f"file://{root}/fsdp1-w4", "--to-world-size", "8", "--json"]) == 0
    new = resolve_step(storage, "fsdp1-w4", None)
    assert new.world_size == 8 and new.attempt != old.attempt
    (st,) = list_steps(storage, "fsdp1-w4")
    assert set(st.attempts) == {old.attempt, new.attempt}
    jobs[8]["fsdp1"].append("fsdp1-w4")
    for n in TARGETS:
        run_world_fast(load_all, n, root, jobs[n])


def test_reshard_under_a_torchrun_group_splits_the_work(work_root):
    root = work_root
    argv = ["reshard", f"file://{root}/fairscale-w4", "--to-world-size", "3", "--out",
            f"file://{root}/fs-workers", "--json", "--pack-threshold", "0"]
    run_world_fast(reshard_under_workers, 2, argv)
    storage = open_storage(root)
    rec = resolve_step(storage, "fs-workers", None)
    assert rec.world_size == 3
    want, got = logical(storage, "fairscale-w4"), logical(storage, "fs-workers")
    for k in want:
        assert same_bits(got[k], want[k]), k
    shutil.copy(os.path.join(root, "fairscale-w4.expected.pt"),
                os.path.join(root, "fs-workers.expected.pt"))
    run_world_fast(load_all, 3, root, {"fairscale": ["fs-workers"]})


KILLER = r"""
import os, sys, time
import ckptd.reshard.run as rr
from ckptd.storage import open_storage

root, marker, out = sys.argv[1], sys.argv[2], sys.argv[3]
storage = open_storage(root)
count = [0]

def counted(put):
    def wrapper(self, key, data):
        put(self, key, data)
        count[0] += 1
        if count[0] == 5:        # some objects of the new attempt are written ...
            open(marker, "w").close()
            time.sleep(600)      # ... and here the test SIGKILLs us
    return wrapper

# data objects go through the executor's deferred local writer, metadata through put
rr._DeferredLocalWriter.put = counted(rr._DeferredLocalWriter.put)
type(storage).put = counted(type(storage).put)
rr.reshard(storage, "fsdp2-w4", None, 3, out_job=out or None, threads=1, pack_threshold=0)
"""


@pytest.mark.parametrize("in_place", [False, True])
def test_sigkill_midway_commits_nothing_and_leaves_the_source_untouched(work_root, tmp_path,
                                                                        in_place):
    root = work_root
    storage = open_storage(root)
    before = snapshot(root, "fsdp2-w4")
    committed_before = storage.get(paths.committed_key("fsdp2-w4", 3))
    marker = str(tmp_path / "midway")
    out = "" if in_place else "killed-out"
    proc = subprocess.Popen([sys.executable, "-c", KILLER, root, marker, out])
    try:
        while not os.path.exists(marker):
            assert proc.poll() is None, "the reshard process exited before the kill point"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # nothing new is committed ...
    assert storage.get(paths.committed_key("fsdp2-w4", 3)) == committed_before
    steps = list_steps(storage, "fsdp2-w4")
    assert [s.step for s in steps] == [3] and steps[0].committed
    if in_place:
        # the new attempt's objects are there, uncommitted, beside the old one
        assert len(steps[0].attempts) == 2
        new_files = {k for k in snapshot(root, "fsdp2-w4") if k not in before}
        assert new_files and all(k.startswith("000000000003/reshard-w3-") for k in new_files)
        assert all(not k.endswith(("COMMITTED", "index.json")) for k in new_files)
        assert all("/_ranks/" not in k for k in new_files)  # killed while copying data
        assert {k: v for k, v in snapshot(root, "fsdp2-w4").items() if k in before} == before
    else:
        assert snapshot(root, "fsdp2-w4") == before
        assert [s.committed for s in list_steps(storage, "killed-out")] == [False]
        assert storage.list_files("killed-out") and not [
            k for k in storage.list_files("killed-out") if "/_ranks/" in k]
        assert main(["ls", f"file://{root}/killed-out", "--json"]) == 0
    # ... ckptd ls and load still see the old checkpoint, and a retry succeeds
    assert resolve_step(storage, "fsdp2-w4", None).world_size == 4
    res = reshard(storage, "fsdp2-w4", None, 3, out_job=None if in_place else "killed-out")
    assert res.world_size == 3
    want = json.loads(json.dumps({k: v.tolist() for k, v in logical(storage, "fsdp2-w4").items()
                                  if not k.startswith("_extra/")}))
    assert want  # loads fine after the retry
    assert math.isfinite(res.seconds)
