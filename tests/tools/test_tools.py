"""The operator tools on real checkpoints: ls, inspect, verify (catches a flipped byte, a
missing chunk, a missing rank manifest), export (safetensors and torch round trips
against the unwrapped model's ``state_dict()``), gc (the retention policy on local disk
and on SeaweedFS S3), and bad arguments (clear message, exit code 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import safetensors.torch
import torch
from reshard_jobs import fairscale_unwrapped
from synth import write_step

from ckptd.cli import main
from ckptd.errors import StorageError, TransientStorageError
from ckptd.format import paths
from ckptd.format.commit import read_commit, resolve_step
from ckptd.reshard.run import reshard
from ckptd.storage import open_storage
from ckptd.storage.testing import FailingBackend, FaultInjectingBackend
from ckptd.tools.common import split_job_uri
from ckptd.tools.export import export
from ckptd.tools.gc import apply_retention

pytestmark = pytest.mark.slow


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    rc, out, _err = run_cli(capsys, *argv, "--json")
    return rc, json.loads(out)


# --------------------------------------------------------------------------- ls / inspect


def test_ls_and_inspect(saved_root, capsys):
    root = saved_root
    rc, doc = run_json(capsys, "ls", f"file://{root}")
    assert rc == 0
    jobs = {j["job"]: j for j in doc["jobs"]}
    for fw in ("fsdp2", "fsdp1", "fairscale"):
        for w in (2, 4):
            j = jobs[f"{fw}-w{w}"]
            assert (j["latest_step"], j["world_size"], j["framework"]) == (3, w, fw)
            assert j["bytes"] > 0 and j["age_s"] >= 0
    rc, doc = run_json(capsys, "ls", f"{root}/fsdp2-w4")
    assert rc == 0 and [s["step"] for s in doc["steps"]] == [3]
    s = doc["steps"][0]
    assert s["committed"] and s["world_size"] == 4 and s["framework"] == "fsdp2"
    rc, out, _ = run_cli(capsys, "ls", f"file://{root}/fsdp2-w4")
    assert rc == 0 and "committed" in out and "fsdp2" in out

    rc, doc = run_json(capsys, "inspect", f"file://{root}/fairscale-w2")
    assert rc == 0 and doc["world_size"] == 2 and doc["framework"] == "fairscale"
    names = {t["name"]: t for t in doc["tensors"]}
    u = fairscale_unwrapped(0)
    assert {f"model/{k}" for k in u.state_dict()} <= set(names)
    w0 = names["model/0.weight"]
    assert w0["shape"] == [13, 7] and w0["dtype"] == "float32"
    assert w0["sharding"].startswith("flat view") and w0["flat"][0]["array"].startswith("flat/")
    assert doc["extra"]["user_keys"] == ["world"] and "torch" in doc["extra"]["rng"]
    assert doc["totals"]["tensors"] == len([n for n in names if not n.startswith("_extra/")])
    rc, doc = run_json(capsys, "inspect", f"file://{root}/fsdp2-w4", "--step", "3")
    t = {x["name"]: x for x in doc["tensors"]}["model/l1.weight"]
    assert t["sharding"] == "dim0 chunks of 4"  # 13 rows over 4 ranks
    rc, out, _ = run_cli(capsys, "inspect", f"file://{root}/fsdp2-w4")
    assert rc == 0 and "model/l1.weight" in out and "extra state" in out


# --------------------------------------------------------------------------- verify


def _chunk_files(root: str, job: str) -> list[str]:
    storage = open_storage(root)
    rec = resolve_step(storage, job, None)
    base = os.path.join(root, paths.attempt_prefix(job, rec.step, rec.attempt))
    out = []
    for d, _, files in os.walk(base):
        for f in files:
            p = os.path.join(d, f)
            if "/c/" in p.replace(base, "") or p.endswith("/c"):
                out.append(p)
    return sorted(out)


def test_verify_catches_flipped_byte_missing_chunk_and_missing_manifest(work_root, capsys):
    root = work_root
    for job in ("fsdp2-w4", "fsdp1-w2", "fairscale-w4"):
        rc, doc = run_json(capsys, "verify", f"file://{root}/{job}")
        assert rc == 0 and doc["ok"], doc
        assert doc["steps"][0]["objects_read"] > 0
    storage = open_storage(root)
    rec = resolve_step(storage, "fsdp2-w4", None)
    prefix = os.path.join(root, paths.attempt_prefix("fsdp2-w4", 3, rec.attempt))

    # a flipped byte in an array chunk
    victim = os.path.join(prefix, "model", "l1.weight", "c", "1", "0")
    with open(victim, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0x40]))
    rc, doc = run_json(capsys, "verify", f"file://{root}/fsdp2-w4")
    assert rc == 1 and not doc["ok"]
    (p,) = doc["steps"][0]["problems"]
    assert (p["kind"], p["what"], p["chunk"]) == ("checksum", "array 'model/l1.weight'", "1.0")
    assert p["expected"].startswith("crc32c 0x") and p["expected"] != p["found"]
    rc, out, _ = run_cli(capsys, "verify", f"file://{root}/fsdp2-w4")
    assert rc == 1 and "checksum" in out and "model/l1.weight" in out
    # reshard refuses to read it: nothing is committed
    rc, _, err = run_cli(capsys, "reshard", f"file://{root}/fsdp2-w4", "--to-world-size", "2",
                         "--out", f"file://{root}/from-corrupt")
    assert rc == 2 and "checksum mismatch" in err and "model/l1.weight" in err
    assert read_commit(storage, "from-corrupt", 3) is None
    with open(victim, "r+b") as f:
        f.write(b)

    # a missing chunk
    victim = os.path.join(prefix, "optim", "l2.weight", "exp_avg", "c", "0", "0")
    os.unlink(victim)
    rc, doc = run_json(capsys, "verify", f"file://{root}/fsdp2-w4")
    (p,) = doc["steps"][0]["problems"]
    assert rc == 1 and (p["kind"], p["what"], p["chunk"], p["found"]) == (
        "missing", "array 'optim/l2.weight/exp_avg'", "0.0", "no object")

    # a missing rank manifest (and a flipped byte inside a pack, on another job)
    os.unlink(os.path.join(prefix, "_ranks", "2.json"))
    rc, doc = run_json(capsys, "verify", f"file://{root}/fsdp2-w4")
    kinds = {(p["kind"], p["what"]) for p in doc["steps"][0]["problems"]}
    assert rc == 1 and ("manifest", "rank 2 manifest") in kinds
    rec2 = resolve_step(storage, "fsdp1-w2", None)
    pack = os.path.join(root, paths.attempt_prefix("fsdp1-w2", 3, rec2.attempt), "_packs", "0",
                        "c", "0")
    with open(pack, "r+b") as f:
        f.seek(8)
        b = f.read(1)
        f.seek(8)
        f.write(bytes([b[0] ^ 1]))
    rc, doc = run_json(capsys, "verify", f"file://{root}/fsdp1-w2", "--all")
    probs = doc["steps"][0]["problems"]
    assert rc == 1 and any(p["kind"] == "checksum" and "_packs/0" in p["what"] for p in probs)
    assert any(p["kind"] == "checksum" and p["what"].startswith("tensor ") for p in probs)


def test_verify_checks_the_zarr_documents_other_readers_use(tmp_path, capsys):
    """A zarr.json whose byte order or torch dtype attribute was edited decodes wrongly in
    zarr readers; a missing group document makes the arrays unreadable to them."""
    storage = open_storage(str(tmp_path))
    write_step(storage, "j", 1, "a1")
    uri = f"file://{tmp_path}/j"
    assert run_json(capsys, "verify", uri)[0] == 0
    prefix = tmp_path / paths.attempt_prefix("j", 1, "a1")

    def problems() -> list[tuple]:
        rc, doc = run_json(capsys, "verify", uri)
        assert rc == 1 and not doc["ok"]
        return [(p["kind"], p["what"], p["expected"], p["found"])
                for p in doc["steps"][0]["problems"]]

    meta = prefix / "model" / "w" / "zarr.json"
    good = meta.read_bytes()
    for field, value, want, found in (
            ("codecs", [{"name": "bytes", "configuration": {"endian": "big"}}],
             '"endian": "little"', '"endian": "big"'),
            ("attributes", {"ckptd": {"torch_dtype": "int32"}},
             'attributes.ckptd.torch_dtype "float32"', 'attributes.ckptd.torch_dtype "int32"')):
        doc = json.loads(good)
        doc[field] = value
        meta.write_text(json.dumps(doc))
        ((kind, what, exp, got),) = problems()
        assert (kind, what) == ("metadata", "array 'model/w'") and want in exp and found in got
    meta.write_bytes(good)

    for doc_path, what in ((prefix / "zarr.json", "attempt group"),
                           (prefix / "optim" / "w" / "zarr.json", "group 'optim/w'")):
        good = doc_path.read_bytes()
        doc_path.unlink()
        assert problems() == [("metadata", what, "zarr.json", "missing")]
        doc_path.write_bytes(good)
    group = prefix / "zarr.json"
    good = group.read_bytes()
    doc = json.loads(good)
    doc["attributes"]["ckptd"]["world_size"] = 5
    group.write_text(json.dumps(doc))
    assert problems() == [("metadata", "attempt group", "ckptd.world_size 2",
                           "ckptd.world_size 5")]
    group.write_bytes(good)
    assert run_json(capsys, "verify", uri)[0] == 0


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("job", ["fsdp2-w4", "fsdp1-w2", "fairscale-w4", "fairscale-w2"])
def test_export_round_trips_against_the_unwrapped_state_dict(saved_root, tmp_path, capsys, job):
    root = saved_root
    want = torch.load(os.path.join(root, f"{job}.expected.pt"), weights_only=True)
    if job.startswith("fairscale"):
        keys = set(fairscale_unwrapped(0).state_dict())
    else:
        from integration.test_torch_fsdp import Net

        keys = set(Net().state_dict())
    st_path = str(tmp_path / "w.safetensors")
    pt_path = str(tmp_path / "w.pt")
    rc, doc = run_json(capsys, "export", f"file://{root}/{job}", "--format", "safetensors",
                       "--out", st_path)
    assert rc == 0 and doc["tensors"] == len(keys)
    got = safetensors.torch.load_file(st_path)
    assert set(got) == keys
    for k, v in got.items():
        assert v.dtype == want[f"model/{k}"].dtype and torch.equal(v, want[f"model/{k}"]), k
    rc, out, _ = run_cli(capsys, "export", f"{root}/{job}", "--format", "torch", "--out",
                         pt_path, "--optimizer")
    assert rc == 0 and "wrote" in out
    for mmap in (False, True):
        sd = torch.load(pt_path, weights_only=True, mmap=mmap)
        assert set(sd["model"]) == keys
        for k, v in sd["model"].items():
            assert torch.equal(v, want[f"model/{k}"]), k
        state = sd["optimizer"]["state"]
        flat = {f"optim/{fqn}/{k}": v for fqn, s in state.items() for k, v in s.items()}
        assert set(flat) == {k for k in want if k.startswith("optim/")}
        for k, v in flat.items():
            assert torch.equal(v.float(), torch.as_tensor(want[k]).float()), k
        assert [set(g["params"]) for g in sd["optimizer"]["param_groups"]] == [
            {k.split("/")[1] for k in flat}]
    # the unwrapped model loads the weights-only file directly
    if job.startswith("fairscale"):
        u = fairscale_unwrapped(0)
        u.load_state_dict(torch.load(pt_path, weights_only=True)["model"])
        assert torch.equal(u[0].weight, want["model/0.weight"])


def test_export_streams_in_small_blocks(saved_root, tmp_path):
    """Blocks far smaller than one tensor (and than one source chunk): same bytes."""
    storage = open_storage(saved_root)
    out = str(tmp_path / "small.safetensors")
    res = export(storage, "fairscale-w4", None, "safetensors", out, block_bytes=24, threads=2)
    want = torch.load(os.path.join(saved_root, "fairscale-w4.expected.pt"), weights_only=True)
    got = safetensors.torch.load_file(out)
    assert res.tensors == len(got) and all(torch.equal(v, want[f"model/{k}"])
                                           for k, v in got.items())
    out2 = str(tmp_path / "small.pt")
    export(storage, "fsdp2-w2", None, "torch", out2, block_bytes=7, optimizer=True)
    want = torch.load(os.path.join(saved_root, "fsdp2-w2.expected.pt"), weights_only=True)
    sd = torch.load(out2, weights_only=True)
    assert all(torch.equal(v, want[f"model/{k}"]) for k, v in sd["model"].items())


# --------------------------------------------------------------------------- without torch

_NO_TORCH = ("import sys; sys.modules['torch'] = None; from ckptd.cli import main; "
             "sys.exit(main(sys.argv[1:]))")


def _ckptd_without_torch(*argv: str) -> subprocess.CompletedProcess:
    """Run the ``ckptd`` CLI in a fresh interpreter where ``import torch`` fails."""
    return subprocess.run([sys.executable, "-c", _NO_TORCH, *argv], capture_output=True,
                          text=True, timeout=300, check=False)


def test_tools_and_reshard_run_without_torch(work_root, tmp_path):
    """ls, inspect, verify, reshard, gc and the safetensors export only move bytes: they run
    on a machine without torch (and start in a fraction of a second); the results match."""
    root = work_root
    for argv in (("ls", f"file://{root}"), ("inspect", f"{root}/fairscale-w4"),
                 ("verify", f"{root}/fsdp2-w4", "--all")):
        r = _ckptd_without_torch(*argv, "--json")
        assert r.returncode == 0, r.stderr
        json.loads(r.stdout)
    r = _ckptd_without_torch("reshard", f"{root}/fsdp2-w4", "--to-world-size", "3", "--out",
                             f"{root}/fsdp2-w3", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["world_size"] == 3
    r = _ckptd_without_torch("verify", f"{root}/fsdp2-w3", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    st_path = str(tmp_path / "w.safetensors")
    r = _ckptd_without_torch("export", f"{root}/fsdp2-w3", "--format", "safetensors", "--out",
                             st_path)
    assert r.returncode == 0, r.stderr
    want = torch.load(os.path.join(root, "fsdp2-w4.expected.pt"), weights_only=True)
    got = safetensors.torch.load_file(st_path)
    assert got and all(torch.equal(v, want[f"model/{k}"]) for k, v in got.items())
    r = _ckptd_without_torch("gc", f"{root}/fsdp2-w3", "--keep-last", "1", "--dry-run")
    assert r.returncode == 0, r.stderr
    # the torch format needs torch: a clear error, not a traceback
    r = _ckptd_without_torch("export", f"{root}/fsdp2-w3", "--format", "torch", "--out",
                             str(tmp_path / "w.pt"))
    assert r.returncode != 0 and "torch" in r.stderr and "Traceback" not in r.stderr
    assert not os.path.exists(tmp_path / "w.pt")


_IMPORTS_AFTER = ("import sys; from ckptd.cli import main; rc = main(sys.argv[1:]); "
                  "print(sorted(m for m in ('numpy', 'fsspec', 'torch', 'grpc') "
                  "if m in sys.modules), file=sys.stderr); sys.exit(rc)")


def test_local_tools_start_without_heavy_imports(work_root, tmp_path):
    """A local ``ckptd reshard`` of row-sharded arrays (and ``ls``) imports neither numpy nor
    fsspec, torch or grpc: together ~0.2 s of start-up, a large part of a small reshard."""
    for argv in (("ls", f"file://{work_root}", "--json"),
                 ("reshard", f"{work_root}/fsdp2-w4", "--to-world-size", "2", "--out",
                  f"file://{tmp_path}/w2", "--json")):
        r = subprocess.run([sys.executable, "-c", _IMPORTS_AFTER, *argv], capture_output=True,
                           text=True, timeout=300, check=False)
        assert r.returncode == 0, r.stderr
        assert r.stderr.strip().splitlines()[-1] == "[]", (argv[0], r.stderr)
    assert json.loads(r.stdout)["world_size"] == 2


# --------------------------------------------------------------------------- gc


def _gc_fixture(storage, job: str) -> None:
    """Committed steps 1..10 (world 2), an in-place reshard of step 10 (a superseded
    attempt), an uncommitted step 11 (only rank 0 wrote) and a failed attempt of step 9."""
    for s in range(1, 11):
        write_step(storage, job, s, f"a{s}")
    write_step(storage, job, 9, "failed", ranks=[1], commit=False)
    reshard(storage, job, 10, 3, threads=2)
    write_step(storage, job, 11, "inflight", ranks=[0], commit=False)


def _steps(storage, job: str) -> dict[int, tuple[bool, set[str]]]:
    """step -> (committed, attempts), from the stored objects (SeaweedFS keeps empty
    "directories" in listings, so step directories alone do not say what exists)."""
    out: dict[int, tuple[bool, set[str]]] = {}
    for key in storage.list_files(job):
        _, sdir, name = key.split("/", 3)[:3]
        step = int(sdir)
        _committed, attempts = out.setdefault(step, (False, set()))
        if name == "COMMITTED":
            out[step] = (True, attempts)
        else:
            attempts.add(name)
    return out


def _check_gc(storage, job: str, capsys, uri: str) -> None:
    now = time.time()
    # dry run: reports, deletes nothing
    before = storage.list_files(job)
    rep = apply_retention(storage, job, keep_last=3, keep_every=4, grace_s=3600, dry_run=True,
                          now=now)
    assert rep.kept_steps == [4, 8, 9, 10] and rep.deleted_steps == [1, 2, 3, 5, 6, 7]
    assert {(r.step, r.attempt) for r in rep.protected} == {(9, "failed"), (10, "a10"),
                                                            (11, "inflight")}
    assert storage.list_files(job) == before
    # for real, through the CLI: young leftovers survive the grace period
    rc, out, _ = run_cli(capsys, "gc", uri, "--keep-last", "3", "--keep-every", "4")
    assert rc == 0, out
    steps = _steps(storage, job)
    assert sorted(steps) == [4, 8, 9, 10, 11]
    assert all(steps[s][0] for s in (4, 8, 9, 10)) and not steps[11][0]
    assert steps[9][1] == {"a9", "failed"} and steps[11][1] == {"inflight"}
    new = resolve_step(storage, job, None).attempt
    assert steps[10][1] == {"a10", new} and new.startswith("reshard-w3-")
    # two hours later: the leftovers go, the committed ones stay; newest is never deleted
    rep = apply_retention(storage, job, keep_last=1, grace_s=3600, now=now + 7200)
    assert rep.kept_steps == [10] and rep.deleted_steps == [4, 8, 9]
    assert _steps(storage, job) == {10: (True, {new})}
    assert resolve_step(storage, job, None).world_size == 3
    rc, _ = run_json(capsys, "verify", uri)
    assert rc == 0


def test_gc_keeps_exactly_the_policy_on_local_disk(tmp_path, capsys):
    storage = open_storage(str(tmp_path))
    _gc_fixture(storage, "gcjob")
    _check_gc(storage, "gcjob", capsys, f"file://{tmp_path}/gcjob")
    assert not os.path.exists(tmp_path / "gcjob" / "000000000001")


@pytest.mark.s3
def test_gc_keeps_exactly_the_policy_on_seaweedfs_s3(s3_uri, capsys):
    storage = open_storage(s3_uri)
    _gc_fixture(storage, "gcjob")
    _check_gc(storage, "gcjob", capsys, f"{s3_uri}/gcjob")


@pytest.mark.s3
def test_reshard_and_export_on_s3(s3_uri, tmp_path, capsys):
    storage = open_storage(s3_uri)
    full = write_step(storage, "s3job", 5, "att", world=3)
    rc, doc = run_json(capsys, "reshard", f"{s3_uri}/s3job", "--to-world-size", "2")
    assert rc == 0 and doc["in_place"] and doc["world_size"] == 2
    # --out naming the source job itself is the same in-place reshard, not "output exists"
    rc, doc = run_json(capsys, "reshard", f"{s3_uri}/s3job", "--to-world-size", "3",
                       "--out", f"{s3_uri}/s3job")
    assert rc == 0 and doc["in_place"] and doc["world_size"] == 3
    rc, doc = run_json(capsys, "verify", f"{s3_uri}/s3job")
    assert rc == 0
    out = str(tmp_path / "s3.safetensors")
    rc, _ = run_json(capsys, "export", f"{s3_uri}/s3job", "--format", "safetensors",
                     "--out", out)
    got = safetensors.torch.load_file(out)
    assert torch.equal(got["w"], full["model/w"]) and torch.equal(got["b"], full["model/b"])
    # a command's stderr holds only ckptd's own lines: botocore's INFO "Found credentials in
    # environment variables." came with every command
    proc = subprocess.run([sys.executable, "-m", "ckptd.cli", "ls", f"{s3_uri}/s3job"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "committed" in proc.stdout
    assert proc.stderr == "", proc.stderr


class _CommitLandsButFails(FaultInjectingBackend):
    """A put of COMMITTED reaches the store and then reports an error, as when the
    store's answer is a 5xx or is lost after it applied the write; with ``unreadable``,
    reading COMMITTED fails from then on (the store went away)."""

    def __init__(self, inner, unreadable: bool = False) -> None:
        super().__init__(inner, ops=("put", "get"), match=lambda k: k.endswith("/COMMITTED"))
        self.unreadable, self.landed = unreadable, False

    def put(self, key, data) -> None:
        self.inner.put(key, data)
        if key.endswith("/COMMITTED"):
            self.landed = True
            raise TransientStorageError(f"injected: the answer to the put of {key} was lost")

    def _on_call(self, op: str, key: str) -> None:
        if op == "get" and self.landed and self.unreadable:
            raise TransientStorageError(f"injected: {key} cannot be read")


@pytest.mark.s3
def test_a_reshard_whose_commit_write_errs_after_landing_keeps_what_it_committed(
        s3_uri, capsys):
    """The commit's put reported an error although COMMITTED was written: the reshard
    deleted its new attempt, so the step (in place: the source step) was committed to
    objects that no longer existed.  Now a COMMITTED that names the new attempt means
    success; one that cannot be read keeps everything and says so; one that was not
    written still removes the partial output."""
    storage = open_storage(s3_uri)
    for job in ("landed", "unknown", "refused"):
        write_step(storage, job, 1, "a1", world=2)
    res = reshard(_CommitLandsButFails(storage), "landed", None, 3)
    assert resolve_step(storage, "landed", None).attempt == res.attempt
    with pytest.raises(StorageError, match="is unknown .*nothing was removed.*ckptd gc"):
        reshard(_CommitLandsButFails(storage, unreadable=True), "unknown", None, 3)
    new = resolve_step(storage, "unknown", None)
    assert new.attempt.startswith("reshard-w3-")
    refusing = FailingBackend(storage, match=lambda k: k.endswith("/COMMITTED"))
    with pytest.raises(StorageError, match="injected permanent failure"):
        reshard(refusing, "refused", None, 3)
    assert resolve_step(storage, "refused", None).attempt == "a1"
    step_dir = paths.step_dir("refused", 1)
    assert {k.split("/")[2] for k in storage.list_files(step_dir)} == {"COMMITTED", "a1"}
    for job in ("landed", "unknown", "refused"):
        rc, doc = run_json(capsys, "verify", f"{s3_uri}/{job}")
        assert rc == 0 and doc["ok"], doc


def test_a_damaged_commit_marker_is_reported_and_does_not_stop_the_tools(tmp_path, capsys):
    """One step's COMMITTED is damaged (not valid JSON): the latest loadable step is the
    one before it, ls shows the damage, verify reports it (exit 1) instead of failing, and
    gc neither fails nor deletes anything of the damaged step."""
    storage = open_storage(str(tmp_path))
    for s in (1, 2, 3):
        write_step(storage, "torn", s, f"a{s}")
    with open(tmp_path / paths.committed_key("torn", 3), "w") as f:
        f.write('{"attempt": "a')
    uri = f"file://{tmp_path}/torn"
    assert resolve_step(storage, "torn", None).step == 2
    rc, doc = run_json(capsys, "ls", uri)
    assert rc == 0
    rows = {r["step"]: r for r in doc["steps"]}
    assert rows[2]["committed"] and not rows[3]["committed"]
    assert "not valid JSON" in rows[3]["damaged"] and rows[2]["damaged"] is None
    rc, doc = run_json(capsys, "ls", f"file://{tmp_path}")
    assert rc == 0 and doc["jobs"][0]["latest_step"] == 2
    for argv, checked in ((["verify", uri], [3, 2]), (["verify", uri, "--step", "3"], [3]),
                          (["verify", uri, "--all"], [1, 2, 3])):
        rc, doc = run_json(capsys, *argv)
        assert rc == 1 and sorted(r["step"] for r in doc["steps"]) == sorted(checked), argv
        bad = [r for r in doc["steps"] if not r["ok"]]
        assert [r["step"] for r in bad] == [3], argv
        (p,) = bad[0]["problems"]
        assert p["kind"] == "commit" and "not valid JSON" in p["found"]
        assert p["key"] == paths.committed_key("torn", 3)
    rc, out, _ = run_cli(capsys, "verify", uri)
    assert rc == 1 and "step 3" in out and "COMMITTED" in out
    rc, doc = run_json(capsys, "inspect", uri)
    assert rc == 0 and doc["step"] == 2
    before = {k for k in storage.list_files("torn") if k.startswith("torn/000000000003/")}
    rep = apply_retention(storage, "torn", keep_last=1, grace_s=0)
    assert rep.kept_steps == [2] and rep.deleted_steps == [1] and rep.damaged_steps == [3]
    assert {k for k in storage.list_files("torn")
            if k.startswith("torn/000000000003/")} == before
    rc, out, _ = run_cli(capsys, "gc", uri, "--keep-last", "1", "--grace", "0")
    assert rc == 0 and "damaged" in out


# --------------------------------------------------------------------------- bad arguments


def test_bad_arguments_fail_with_a_clear_message(saved_root, tmp_path, capsys):
    root = saved_root
    uri = f"file://{root}/fsdp2-w2"
    cases = [
        (["reshard", f"file://{root}/nosuch", "--to-world-size", "2"], "no checkpoint of job"),
        (["reshard", uri, "--step", "7", "--to-world-size", "2"], "step 7 of job 'fsdp2-w2'"),
        (["reshard", uri, "--to-world-size", "0"], "--to-world-size must be an integer >= 1"),
        (["reshard", uri, "--to-world-size", "3", "--out", f"file://{root}/fsdp2-w4"],
         "already has a committed step 3"),
        (["reshard", "gs://b/j", "--to-world-size", "2"], "scheme 'gs' is not supported"),
        (["inspect", f"file://{root}/nosuch"], "no checkpoint of job"),
        (["verify", uri, "--step", "4"], "is not committed"),
        (["export", uri, "--format", "torch", "--out", os.path.join(root, "fsdp2-w2.expected.pt")],
         "already exists"),
        (["export", uri, "--format", "safetensors", "--optimizer", "--out",
          str(tmp_path / "x")], "--format torch"),
        (["gc", uri, "--keep-last", "0"], "--keep-last must be an integer >= 1"),
        (["gc", uri, "--keep-last", "2", "--grace", "soon"], "duration 'soon' is invalid"),
        # a mistyped job, or the storage root given as URI/JOB: not a silent no-op
        (["gc", f"file://{root}/nosuch", "--keep-last", "1"], "no checkpoint of job 'nosuch'"),
        (["gc", f"file://{root}", "--keep-last", "1"], "is a step directory"),
        (["ls", f"file://{tmp_path}/empty"], "no checkpoints under"),
    ]
    for argv, msg in cases:
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 2, (argv, rc, out, err)
        assert msg in err, (argv, err)
    with pytest.raises(SystemExit) as exc:
        main(["reshard", uri])  # --to-world-size is required
    assert exc.value.code == 2
    for argv in (["reshard", uri, "--to-world-size", "2"], ["verify", uri],
                 ["export", uri, "--format", "torch", "--out", str(tmp_path / "t.pt")]):
        for threads, msg in (("0", "in [1, 256], got 0"), ("x", "whole number of threads")):
            capsys.readouterr()
            with pytest.raises(SystemExit) as exc:
                main([*argv, "--threads", threads])
            assert exc.value.code == 2 and msg in capsys.readouterr().err, (argv, threads)
    assert not (tmp_path / "t.pt").exists()
    assert split_job_uri("s3://bucket/prefix/job") == ("s3://bucket/prefix", "job")
