"""Embedded-mode client on one process: round trips, dtypes, extra state, errors."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from ckptd_client import CheckpointClient
from ckptd_client import extra as extra_state

from ckptd.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    FormatVersionError,
    SaveFailedError,
    StateMismatchError,
)
from ckptd.format import paths
from ckptd.format.commit import resolve_step
from ckptd.storage import open_storage


class Mixed(torch.nn.Module):
    """Parameters and buffers of every dtype training uses."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w32 = torch.nn.Parameter(torch.randn(300, 7, generator=g))
        self.wbf16 = torch.nn.Parameter(torch.randn(33, 5, generator=g).bfloat16())
        self.w16 = torch.nn.Parameter(torch.randn(9, generator=g).half())
        self.register_buffer("i64", torch.randint(-2**40, 2**40, (6,), generator=g))
        self.register_buffer("i32", torch.randint(-2**20, 2**20, (4, 2), generator=g,
                                                  dtype=torch.int32))
        self.register_buffer("mask", torch.rand(11, generator=g) > 0.5)
        self.register_buffer("f8", torch.randn(5, generator=g).to(torch.float8_e4m3fn))
        self.register_buffer("scalar", torch.tensor(3.5))


def _uri(tmp_path) -> str:
    return f"file://{tmp_path}"


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k].view(torch.uint8) if sa[k].dtype.itemsize == 1 else sa[k],
                           sb[k].view(torch.uint8) if sb[k].dtype.itemsize == 1 else sb[k]), k


@pytest.mark.parametrize("pack_threshold", [0, 1 << 20])
def test_every_dtype_round_trips_bit_exact(tmp_path, pack_threshold):
    src, dst = Mixed(0), Mixed(1)
    c = CheckpointClient("dtypes", storage=_uri(tmp_path), pack_threshold=pack_threshold)
    info = c.save_async(src, step=1).result(60)
    assert info.step == 1 and info.world_size == 1
    loaded = c.load(dst)
    assert loaded.step == 1
    _equal(src, dst)
    c.close()


def test_extra_state_json_tensors_rng(tmp_path):
    m = Mixed(0)
    sched_model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(sched_model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for _ in range(4):
        opt.step()
        sched.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    extra = {"sched": sched.state_dict(), "scaler": scaler.state_dict(), "pos": (3, 17),
             1: "int key", "arr": np.arange(5, dtype=np.int16), "t": torch.arange(3.0),
             "nested": [{"a": None, "b": float("inf")}]}
    c = CheckpointClient("extra", storage=_uri(tmp_path))
    torch.manual_seed(123)
    random.seed(7)
    np.random.seed(9)
    c.save(m, step=5, extra=extra)
    expect = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    info = c.load(Mixed(2))
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == (
        expect[0].tolist(), expect[1], expect[2])
    e = info.extra
    assert e["sched"] == sched.state_dict() and e["scaler"] == scaler.state_dict()
    assert e["pos"] == (3, 17) and e[1] == "int key" and e["nested"] == extra["nested"]
    assert e["arr"].dtype == np.int16 and (e["arr"] == np.arange(5)).all()
    assert torch.equal(e["t"], torch.arange(3.0))
    sched2 = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(sched_model.parameters(), lr=0.1),
                                             step_size=3)
    sched2.load_state_dict(e["sched"])
    assert sched2.get_last_lr() == sched.get_last_lr()
    c.close()


def test_extra_state_rejects_unstorable_values(tmp_path):
    c = CheckpointClient("bad-extra", storage=_uri(tmp_path))
    with pytest.raises(ConfigError, match=r"extra state value at extra.obj is a object"):
        c.save_async(Mixed(0), step=1, extra={"obj": object()})
    cycle: list = [1]
    cycle.append({"again": cycle})
    with pytest.raises(ConfigError, match=r"at extra.loop\[1\].again is a list that contains itself"):
        c.save_async(Mixed(0), step=1, extra={"loop": cycle})
    shared = [1, 2]  # the same list twice is not a cycle
    assert extra_state.encode({"a": shared, "b": (shared, shared)}, []) == {
        "a": [1, 2], "b": {"__tuple__": [[1, 2], [1, 2]]}}
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ConfigError, match="nested too deeply"):
        c.save_async(Mixed(0), step=1, extra={"deep": deep})
    # each named by where it is in `extra` (not as an internal tensor name, nor a bare
    # TypeError from json or torch.from_numpy)
    for value, what in [
        (np.complex64(1 + 2j), "numpy complex64 scalar"),
        (np.datetime64("2024-01-01"), "numpy datetime64 scalar"),
        (np.bytes_(b"ab"), "numpy bytes_ scalar"),
        (np.array(["a", "b"]), "numpy array of dtype '<U1'"),
        (np.array([1.0], dtype=">f4"), "numpy array of dtype '>f4'"),
        (torch.eye(2).to_sparse(), "torch.sparse_coo tensor"),
        (torch.empty(2, device="meta"), "tensor on the meta device"),
        (torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), "dtype torch.qint8"),
    ]:
        with pytest.raises(ConfigError, match=rf"extra state value at extra.v\[1\] is .*{what}"):
            c.save_async(Mixed(0), step=1, extra={"v": [0, value]})
    # numpy scalars of JSON kinds come back as the Python value
    assert extra_state.encode([np.float16(0.1), np.uint64(2**64 - 1), np.bool_(True)], []) == [
        0.0999755859375, 2**64 - 1, True]
    # nothing was saved, and the client still saves
    assert c.list_steps() == []
    c.save(Mixed(0), step=1, extra={"ok": [1, 2]})
    assert c.list_steps() == [1]
    c.close()


def test_latest_and_explicit_step_and_list(tmp_path):
    m = Mixed(0)
    c = CheckpointClient("steps", storage=_uri(tmp_path))
    hs, snaps = [], {}
    for step in (10, 20, 30):
        with torch.no_grad():
            m.w32.add_(1.0)
        snaps[step] = m.w32.detach().clone()
        hs.append(c.save_async(m, step=step))
    assert [h.result(60).step for h in hs] == [10, 20, 30]
    assert c.list_steps() == [10, 20, 30]
    dst = Mixed(1)
    assert c.load(dst).step == 30
    assert torch.equal(dst.w32, m.w32)
    c.load(dst, step=10)
    assert torch.equal(dst.w32, snaps[10])
    c.close()


def test_no_checkpoint_errors(tmp_path):
    c = CheckpointClient("nothing", storage=_uri(tmp_path))
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint of job 'nothing'"):
        c.load(Mixed(0))
    c.save(Mixed(0), step=4)
    with pytest.raises(CheckpointNotFoundError, match=r"step 5 .* is not committed; committed "
                                                      r"steps: \[4\]"):
        c.load(Mixed(0), step=5)
    c.close()


def test_uncommitted_attempt_is_invisible(tmp_path):
    """A partial attempt (a crashed save) is never loaded; a new save of the same step
    writes its own attempt and commits it."""
    c = CheckpointClient("partial", storage=_uri(tmp_path))
    c.save(Mixed(0), step=1)
    # a crashed 2-rank save of step 2: rank 0's manifest and a chunk, no rank 1
    prefix = tmp_path / paths.attempt_prefix("partial", 2, "crashed-attempt")
    (prefix / "_ranks").mkdir(parents=True)
    (prefix / "_ranks" / "0.json").write_text("{}")
    assert c.list_steps() == [1]
    assert c.load(Mixed(1)).step == 1
    info = c.save(Mixed(3), step=2)
    assert info.attempt != "crashed-attempt"
    assert c.list_steps() == [1, 2]
    dst = Mixed(4)
    assert c.load(dst).step == 2
    _equal(dst, Mixed(3))
    c.close()


def _committed_attempt_dir(tmp_path, job, step):
    rec = json.loads((tmp_path / paths.committed_key(job, step)).read_text())
    return tmp_path / paths.attempt_prefix(job, step, rec["attempt"])


def test_checksum_mismatch_names_array_and_chunk(tmp_path):
    c = CheckpointClient("corrupt", storage=_uri(tmp_path), pack_threshold=0)
    c.save(Mixed(0), step=1)
    chunk = _committed_attempt_dir(tmp_path, "corrupt", 1) / "model" / "w32" / "c" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x01
    chunk.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError,
                       match=r"checksum mismatch in array 'model/w32' chunk 0\.0"):
        c.load(Mixed(1))
    c.close()


def test_missing_and_truncated_chunk(tmp_path):
    c = CheckpointClient("trunc", storage=_uri(tmp_path), pack_threshold=0)
    c.save(Mixed(0), step=1)
    chunk = _committed_attempt_dir(tmp_path, "trunc", 1) / "model" / "w32" / "c" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-4])
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        c.load(Mixed(1))
    chunk.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing from storage"):
        c.load(Mixed(1))
    c.close()


def test_damaged_data_of_the_latest_step_says_the_model_is_partly_loaded_and_what_to_load(
        tmp_path):
    """A chunk of the latest step is gone: load() fails (it never falls back on its own, as
    ranks could fall back differently), says the model now holds that step only in part and
    names the other committed steps; the optimizer it had to fill is left empty; loading
    the earlier step then restores everything bit-exactly."""
    def build(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 2))
        return m, torch.optim.Adam(m.parameters())

    m, opt = build(0)
    c = CheckpointClient("partly", storage=_uri(tmp_path), pack_threshold=0)
    for step in (1, 2):
        m(torch.randn(3, 40)).sum().backward()
        opt.step()
        c.save(m, opt, step=step)
        if step == 1:
            want, want_opt = build(9)
            c.load(want, want_opt)
    (_committed_attempt_dir(tmp_path, "partly", 2) / "optim" / "1.weight" / "exp_avg_sq" / "c"
     / "0" / "0").unlink()
    dst, dst_opt = build(5)
    with pytest.raises(CorruptCheckpointError,
                       match=r"(?s)loading step 2 of job 'partly' failed after it had begun to "
                             r"overwrite the model and optimizer: array "
                             r"'optim/1.weight/exp_avg_sq' chunk 0.0 is missing.* the other "
                             r"committed steps are \[1\]"):
        c.load(dst, dst_opt)
    assert not dst_opt.state
    assert c.load(dst, dst_opt, step=1).step == 1
    _equal(dst, want)
    got, exp = dst_opt.state_dict()["state"], want_opt.state_dict()["state"]
    assert all(torch.equal(got[i][k], exp[i][k]) for i in exp for k in exp[i])
    c.close()


@pytest.mark.parametrize("damage", ["no pieces", "piece outside the tensor"])
def test_an_index_whose_pieces_do_not_cover_a_tensor_is_refused(tmp_path, damage):
    """index.json has no checksum: pieces that leave part of a tensor uncovered (or lie
    outside it) fail the load, naming the tensor, instead of leaving elements unset."""
    c = CheckpointClient("pieces", storage=_uri(tmp_path), pack_threshold=0)
    c.save(Mixed(0), step=1)
    path = _committed_attempt_dir(tmp_path, "pieces", 1) / "index.json"
    d = json.loads(path.read_text())
    t = d["tensors"]["model/w32"]
    if damage == "no pieces":
        t["pieces"] = []
        match = r"tensor 'model/w32': the stored pieces hold 0 of the 2100 elements"
    else:
        t["pieces"][0]["region"]["offsets"] = [1, 0]
        match = r"tensor 'model/w32' of shape \[300, 7\] records a piece at offsets \[1, 0\]"
    path.write_text(json.dumps(d))
    with pytest.raises(CorruptCheckpointError, match=match):
        c.load(Mixed(1))
    c.close()


@pytest.mark.parametrize("doc", ["COMMITTED", "index.json"])
def test_unknown_format_version_is_refused(tmp_path, doc):
    c = CheckpointClient("future", storage=_uri(tmp_path))
    c.save(Mixed(0), step=1)
    if doc == "COMMITTED":
        path = tmp_path / paths.committed_key("future", 1)
    else:
        path = _committed_attempt_dir(tmp_path, "future", 1) / "index.json"
    d = json.loads(path.read_text())
    d["format_version"] = 99
    path.write_text(json.dumps(d))
    with pytest.raises(FormatVersionError, match="format_version 99; this ckptd reads "
                                                 "format_version 1"):
        c.load(Mixed(1))
    c.close()


class Other(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w32 = torch.nn.Parameter(torch.zeros(300, 8))          # shape differs
        self.wbf16 = torch.nn.Parameter(torch.zeros(33, 5))         # dtype differs
        self.extra_param = torch.nn.Parameter(torch.zeros(2))       # missing from ckpt
        self.register_buffer("i64", torch.zeros(6, dtype=torch.int64))


def test_model_mismatch_lists_every_problem_together(tmp_path):
    c = CheckpointClient("mismatch", storage=_uri(tmp_path))
    c.save(Mixed(0), step=1)
    with pytest.raises(StateMismatchError) as ei:
        c.load(Other())
    msg = str(ei.value)
    assert "1 shape mismatches: model/w32: checkpoint [300, 7], model [300, 8]" in msg
    assert "missing from the checkpoint: model/extra_param" in msg
    assert "unexpected in the checkpoint: model/f8, model/i32, model/mask, model/scalar, " \
           "model/w16" in msg
    assert "dtype mismatches: model/wbf16: checkpoint torch.bfloat16, model torch.float32" in msg
    assert "architecture differs" in msg and "strict=False" in msg  # what to do
    # shapes can never be loaded, even with strict=False
    with pytest.raises(StateMismatchError, match="shape mismatches.*build it with the "
                       "configuration the checkpoint was saved with"):
        c.load(Other(), strict=False)
    c.close()


def test_module_without_state_and_integer_like_steps(tmp_path):
    """A module with no (persistent) state saves outside a process group (only extra state,
    say); numpy and 0-dim tensor integers are steps; floats and bools are not."""
    c = CheckpointClient("nostate", storage=_uri(tmp_path))
    c.save(torch.nn.Module(), step=np.int64(4), extra={"epoch": 2})
    only_np = torch.nn.Module()
    only_np.register_buffer("cache", torch.ones(3), persistent=False)
    c.save(only_np, step=torch.tensor(5))
    assert c.list_steps() == [4, 5]
    assert c.load(torch.nn.Module(), step=4).extra == {"epoch": 2}
    for bad in (5.0, True, "6"):
        with pytest.raises(ConfigError, match="expected an int"):
            c.save_async(torch.nn.Module(), step=bad)
    c.close()


def test_strict_false_loads_what_matches(tmp_path):
    c = CheckpointClient("lenient", storage=_uri(tmp_path))
    src = Mixed(0)
    c.save(src, step=1)
    dst = Other()
    del dst.w32
    dst.w32 = torch.nn.Parameter(torch.zeros(300, 7))
    info = c.load(dst, strict=False)
    assert info.missing_keys == ("model/extra_param",)
    assert "model/mask" in info.unexpected_keys
    assert torch.equal(dst.w32, src.w32)
    assert torch.equal(dst.wbf16, src.wbf16.float())  # converted
    assert torch.equal(dst.extra_param, torch.zeros(2))  # untouched
    c.close()


@pytest.mark.parametrize("uri,match", [
    ("ftp://host/x", "scheme 'ftp' is not supported"),
    ("file://relative/path", "is not absolute"),
    ("", "non-empty string"),
    ("s3:/bucket/prefix", "scheme 's3' but lacks '//'"),
    ("file:relative", "scheme 'file' but lacks '//'"),
])
def test_bad_storage_uri(uri, match):
    with pytest.raises(ConfigError, match=match):
        CheckpointClient("j", storage=uri)


@pytest.mark.parametrize("uri", ["~/ckpt", "file:{tmp}/home/ckpt"])
def test_home_and_short_file_uri_name_the_intended_directory(tmp_path, monkeypatch, uri):
    """'~' is the home directory and 'file:/abs' an absolute path, not directories named
    '~' or 'file:' under the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    c = CheckpointClient("j", storage=uri.format(tmp=tmp_path))
    c.save(torch.nn.Linear(2, 2), step=1)
    assert c.list_steps() == [1]
    assert sorted(os.listdir(tmp_path)) == ["home"]
    assert os.path.isdir(tmp_path / "home" / "ckpt" / "j")
    c.close()


@pytest.mark.parametrize("job", ["../etc", "a/b", "", ".hidden", "x" * 200])
def test_bad_job_names(tmp_path, job):
    with pytest.raises(ConfigError, match="job name"):
        CheckpointClient(job, storage=_uri(tmp_path))


def test_failed_save_leaves_nothing_and_keeps_earlier(tmp_path, monkeypatch):
    """A save whose writes fail is never committed, and the previous step still loads."""
    c = CheckpointClient("fail", storage=_uri(tmp_path), pack_threshold=0)
    src = Mixed(0)
    c.save(src, step=1)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    real_put = c._transport.storage().put
    calls = {"n": 0}

    def failing_put(key, data):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(5, "Input/output error")
        return real_put(key, data)

    monkeypatch.setattr(c._transport.storage(), "put", failing_put)
    with pytest.raises(SaveFailedError, match=r"save of step 2 .* failed and was not committed: "
                                              r"(OSError|StorageError)"):
        c.save(Mixed(5), step=2)
    monkeypatch.setattr(c._transport.storage(), "put", real_put)
    assert c.list_steps() == [1]
    # nothing of step 1 changed
    after_step1 = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")
                         if "000000000002" not in str(p))
    assert after_step1 == before
    dst = Mixed(9)
    assert c.load(dst).step == 1
    _equal(dst, src)
    # the next save works
    assert c.save(Mixed(6), step=3).step == 3
    c.close()


def test_fsync_failure_fails_the_save(tmp_path, monkeypatch):
    c = CheckpointClient("fsync", storage=_uri(tmp_path))
    real = os.fsync
    state = {"n": 0}

    def bad_fsync(fd):
        state["n"] += 1
        if state["n"] == 3:
            raise OSError(5, "EIO")
        return real(fd)

    monkeypatch.setattr(os, "fsync", bad_fsync)
    with pytest.raises(Exception, match="fsync of .* failed"):
        c.save(Mixed(0), step=1)
    monkeypatch.setattr(os, "fsync", real)
    assert c.list_steps() == []
    c.close()


def test_save_and_load_through_zarr_python(tmp_path):
    """The stored group is readable without ckptd: full parameter values via zarr-python."""
    import zarr

    src = Mixed(0)
    c = CheckpointClient("zarr", storage=_uri(tmp_path), pack_threshold=0)
    c.save(src, step=1)
    g = zarr.open_group(str(_committed_attempt_dir(tmp_path, "zarr", 1)), mode="r")
    assert np.array_equal(g["model/w32"][:], src.w32.detach().numpy())
    raw = g["model/wbf16"][:]
    assert raw.dtype == np.uint16 and g["model/wbf16"].attrs["ckptd"]["torch_dtype"] == "bfloat16"
    assert torch.equal(torch.from_numpy(raw.astype(np.int32)).to(torch.int16).view(torch.bfloat16),
                       src.wbf16.detach())
    assert np.array_equal(g["model/mask"][:], src.mask.numpy())
    c.close()


def test_repeated_saves_reuse_the_state_map_and_see_every_change(tmp_path, monkeypatch):
    """After the first save the adapter reads live tensors from a cached map (no
    get_model_state_dict call in the loop), yet each save holds the state of its moment:
    in-place updates, a replaced parameter, optimizer state that appeared later."""
    import torch.distributed.checkpoint.state_dict as sd

    calls = {"n": 0}
    real = sd.get_model_state_dict

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(sd, "get_model_state_dict", counting)
    model = torch.nn.Sequential(torch.nn.Linear(300, 400), torch.nn.Linear(400, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    c = CheckpointClient("cache", storage=_uri(tmp_path))
    c.save(model, optimizer=opt, step=1)                       # no optimizer state yet
    model(torch.randn(3, 300)).sum().backward()
    opt.step()                                                 # state appears, params move
    c.save(model, optimizer=opt, step=2)
    with torch.no_grad():
        model[1].weight = torch.nn.Parameter(torch.full((2, 400), 7.0))  # replaced object
    c.save(model, optimizer=opt, step=3)
    assert calls["n"] == 1
    for step in (2, 3):
        fresh = torch.nn.Sequential(torch.nn.Linear(300, 400), torch.nn.Linear(400, 2))
        fopt = torch.optim.Adam(fresh.parameters(), lr=0.5)
        c.load(fresh, optimizer=fopt, step=step, strict=step == 2)
        assert torch.equal(fresh[0].weight, model[0].weight)
        want = model[1].weight if step == 3 else None
        if want is not None:
            assert torch.equal(fresh[1].weight, want)
        st = fopt.state_dict()["state"]
        assert torch.equal(st[0]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
    c.close()


def _train_two_steps(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        model(torch.randn(5, 4, generator=g)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
], ids=["adamw", "amsgrad", "adagrad", "sgd"])
def test_optimizer_saved_before_its_first_step(tmp_path, make_opt):
    """Saving an optimizer that has no state yet (Adagrad has some from the start) does not
    change training, and loading that checkpoint leaves a fresh optimizer fresh (only
    hyperparameters restored): both runs train exactly like one that never saw a
    checkpoint."""
    def run(save: bool, load: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = make_opt(model.parameters())
        if save:
            CheckpointClient("fresh", storage=_uri(tmp_path)).save(model, optimizer=opt, step=0)
        if load:
            with torch.no_grad():
                model.weight.add_(1.0)
            opt.param_groups[0]["lr"] = 0.5
            CheckpointClient("fresh", storage=_uri(tmp_path)).load(model, optimizer=opt)
            assert opt.param_groups[0]["lr"] == 0.1
        _train_two_steps(model, opt)
        return model

    plain = run(save=False, load=False)
    _equal(run(save=True, load=False), plain)
    _equal(run(save=False, load=True), plain)


class _PartlyTrained(torch.nn.Module):
    """A layer forward never uses and a frozen layer: neither has optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(4, 3)
        self.unused = torch.nn.Linear(4, 3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.used(x))


def test_parameters_without_optimizer_state_load_strictly(tmp_path):
    """Parameters that had no optimizer state when saved (no gradient yet) get none when
    loaded into a fresh optimizer, so a strict load works and training goes on exactly as
    in the saving run."""
    torch.manual_seed(0)
    model = _PartlyTrained()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)  # the frozen layer too
    _train_two_steps(model, opt)
    c = CheckpointClient("partly", storage=_uri(tmp_path))
    c.save(model, optimizer=opt, step=2)
    fresh = _PartlyTrained()
    fopt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    c.load(fresh, optimizer=fopt)
    assert sorted(fopt.state_dict()["state"]) == sorted(opt.state_dict()["state"]) == [0, 1]
    _train_two_steps(model, opt)
    _train_two_steps(fresh, fopt)
    _equal(fresh, model)
    c.close()


def test_a_damaged_commit_marker_hides_only_its_step(tmp_path):
    """list_steps and the 'not committed' error still work when one step's COMMITTED is
    damaged; loading that step names the damage."""
    model = torch.nn.Linear(2, 2)
    c = CheckpointClient("marker", storage=_uri(tmp_path))
    for step in (1, 2):
        c.save(model, step=step)
    with open(tmp_path / paths.committed_key("marker", 2), "w") as f:
        f.write("{")
    assert c.list_steps() == [1]
    assert c.load(model).step == 1  # the latest loadable step, as list_steps says
    with pytest.raises(CheckpointNotFoundError, match=r"committed steps: \[1\]"):
        c.load(model, step=3)
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        c.load(model, step=2)
    assert c.load(model, step=1).step == 1
    c.close()


def test_a_copied_job_loads_its_own_objects_and_a_copied_step_is_refused(tmp_path):
    """A job directory copied to another name (a fork of a run) loads from the copy, also
    once the original is gone; a step directory copied to another step number is not
    that step: it is reported as damaged and `load()` takes the latest real step."""
    import shutil

    src = Mixed(0)
    c = CheckpointClient("run1", storage=_uri(tmp_path))
    c.save(src, step=1)
    c.close()
    shutil.copytree(tmp_path / "run1", tmp_path / "run2")
    shutil.rmtree(tmp_path / "run1")
    fork = CheckpointClient("run2", storage=_uri(tmp_path))
    dst = Mixed(1)
    info = fork.load(dst)
    assert (info.job, info.step) == ("run2", 1)
    _equal(dst, src)
    shutil.copytree(tmp_path / "run2" / "000000000001", tmp_path / "run2" / "000000000007")
    assert fork.list_steps() == [1]
    assert fork.load(Mixed(2)).step == 1
    with pytest.raises(CorruptCheckpointError, match=r"records step 1, expected 7"):
        fork.load(Mixed(2), step=7)
    fork.close()


def test_a_directory_that_is_not_a_job_is_named_as_such(tmp_path):
    """A URI/JOB whose directory holds no step directories (a storage root given as the
    job, a typo) is reported as not a ckptd job, not as 'only uncommitted attempts'."""
    c = CheckpointClient("j", storage=_uri(tmp_path))
    c.save(torch.nn.Linear(2, 2), step=1)
    c.close()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    storage = open_storage(str(tmp_path.parent))
    with pytest.raises(CheckpointNotFoundError, match=r"is not a ckptd job: .*found j, notes"):
        resolve_step(storage, tmp_path.name, None)


def _two_layer(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def test_other_param_groups_fail_before_anything_is_loaded_and_load_with_strict_false(tmp_path):
    """An optimizer built with other param groups (e.g. a no-weight-decay group added for
    fine-tuning): strict load fails before the model or optimizer changed; strict=False
    loads every tensor and keeps the optimizer's own hyperparameters."""
    model = _two_layer(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    c = CheckpointClient("groups", storage=_uri(tmp_path))
    c.save(model, optimizer=opt, step=1)
    fresh = _two_layer(1)
    opt2 = torch.optim.AdamW([{"params": fresh[0].parameters()},
                              {"params": fresh[1].parameters(), "weight_decay": 0.0}], lr=0.5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(StateMismatchError, match="2 param groups.* saved 1"):
        c.load(fresh, optimizer=opt2)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    assert not opt2.state
    c.load(fresh, optimizer=opt2, strict=False)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key, v in opt.state[p].items():
            assert torch.equal(opt2.state[q][key], v), key
    assert [g["lr"] for g in opt2.param_groups] == [0.5, 0.5]
    assert [g["weight_decay"] for g in opt2.param_groups] == [0.01, 0.0]
    c.close()


def test_strict_load_with_an_optimizer_of_a_model_only_checkpoint_fails(tmp_path):
    """A checkpoint saved without optimizer=: strict load with an optimizer says so instead of
    silently leaving the optimizer fresh; strict=False (or no optimizer) loads the model."""
    model = _two_layer(0)
    c = CheckpointClient("modelonly", storage=_uri(tmp_path))
    c.save(model, step=1)
    fresh = _two_layer(1)
    opt = torch.optim.Adam(fresh.parameters())
    with pytest.raises(StateMismatchError, match="saved without optimizer state"):
        c.load(fresh, optimizer=opt)
    assert not torch.equal(fresh[0].weight, model[0].weight)
    c.load(fresh, optimizer=opt, strict=False)
    assert torch.equal(fresh[0].weight, model[0].weight) and not opt.state
    c.close()


def test_saving_with_a_closed_client_says_so(tmp_path):
    """After close() (e.g. the end of a `with` block) a save fails at once with a clear
    error, not with the writer pool's 'cannot schedule new futures after shutdown'."""
    model = torch.nn.Linear(2, 2)
    with CheckpointClient("closed", storage=_uri(tmp_path)) as c:
        c.save(model, step=1)
    with pytest.raises(ConfigError, match="closed CheckpointClient"):
        c.save_async(model, step=2)
    assert c.list_steps() == [1]


def test_saving_a_model_on_the_meta_device_names_the_tensor_and_what_to_do(tmp_path):
    """A model built under torch.device("meta") (deferred init) has no data: the save says
    which tensor and how to materialize it, before anything is staged or written."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    c = CheckpointClient("meta", storage=_uri(tmp_path))
    with pytest.raises(ConfigError, match=r"cannot save step 1: 'model/0.weight' and 6 more tensors "
                                          r"are on the meta device.*`model.to_empty\(device=...\)`"):
        c.save_async(model, step=1)
    assert c.list_steps() == []
    model.to_empty(device="cpu")
    for m in model:
        m.reset_parameters()
    c.save(model, step=1)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    c.load(fresh)
    _equal(fresh, model)
    c.close()


def _decay_groups(model: torch.nn.Module, no_decay_first: bool, **kw) -> list[dict]:
    """AdamW groups as fine-tuning scripts build them: weights decay, biases do not."""
    decay = {"params": [p for n, p in model.named_parameters() if n.endswith("weight")],
             "weight_decay": kw.get("wd", 0.1), "lr": kw.get("lr", 0.01)}
    no_decay = {"params": [p for n, p in model.named_parameters() if n.endswith("bias")],
                "weight_decay": 0.0, "lr": kw.get("nd_lr", 0.02)}
    return [no_decay, decay] if no_decay_first else [decay, no_decay]


def test_param_groups_in_another_order_get_their_own_hyperparameters(tmp_path):
    """The no-decay group first instead of second: each group's weight decay and lr come
    back onto the parameters they belonged to, not by position, and training goes on
    exactly as in the saving run."""
    model = _two_layer(0)
    opt = torch.optim.AdamW(_decay_groups(model, no_decay_first=False))
    _train_two_steps(model, opt)
    c = CheckpointClient("regrouped", storage=_uri(tmp_path))
    c.save(model, optimizer=opt, step=2)
    fresh = _two_layer(1)
    opt2 = torch.optim.AdamW(_decay_groups(fresh, no_decay_first=True, wd=0.5, lr=1.0,
                                           nd_lr=1.0))
    c.load(fresh, optimizer=opt2)
    no_decay, decay = opt2.param_groups
    assert (no_decay["weight_decay"], no_decay["lr"]) == (0.0, 0.02)
    assert (decay["weight_decay"], decay["lr"]) == (0.1, 0.01)
    _train_two_steps(model, opt)
    _train_two_steps(fresh, opt2)
    _equal(fresh, model)
    c.close()


def test_param_groups_holding_other_parameters_fail_before_loading_or_keep_their_own(
        tmp_path, caplog):
    """As many groups as saved, but grouped otherwise (by layer instead of by decay): the
    saved hyperparameters belong to no live group. strict: fails before anything changed;
    strict=False: loads the tensors, keeps the live hyperparameters and warns."""
    model = _two_layer(0)
    opt = torch.optim.AdamW(_decay_groups(model, no_decay_first=False))
    _train_two_steps(model, opt)
    c = CheckpointClient("other-groups", storage=_uri(tmp_path))
    c.save(model, optimizer=opt, step=2)
    fresh = _two_layer(1)
    opt2 = torch.optim.AdamW([{"params": fresh[0].parameters(), "weight_decay": 0.3},
                              {"params": fresh[1].parameters(), "weight_decay": 0.4}], lr=0.5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(StateMismatchError, match=(
            r"optimizer param group 0 holds other parameters than every saved group, so the "
            r"saved hyperparameters .* cannot be matched to it \(compared with saved group "
            r"\d: 1 not in it \(0.bias\), 1 only in it \(1.weight\)\).*Build the optimizer as "
            r"in the saved run")):
        c.load(fresh, optimizer=opt2)
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    assert not opt2.state
    with caplog.at_level("WARNING", logger="ckptd.client"):
        c.load(fresh, optimizer=opt2, strict=False)
    assert "keeping the optimizer's own hyperparameters" in caplog.text
    _equal(fresh, model)
    assert [(g["weight_decay"], g["lr"]) for g in opt2.param_groups] == [(0.3, 0.5), (0.4, 0.5)]
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key, v in opt.state[p].items():
            assert torch.equal(opt2.state[q][key], v), key
    c.close()


def test_rolling_back_to_a_checkpoint_from_before_the_first_step(tmp_path, caplog):
    """A checkpoint saved before the optimizer's first step has no optimizer state. Loading
    it into an optimizer that has taken steps says so (not a list of every optimizer tensor
    it lacks) and what to do; a freshly constructed optimizer rolls back completely;
    strict=False rolls back the model only and warns that the optimizer keeps its state."""
    model = _two_layer(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    c = CheckpointClient("rollback", storage=_uri(tmp_path))
    c.save(model, optimizer=opt, step=0)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    _train_two_steps(model, opt)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateMismatchError) as info:
        c.load(model, optimizer=opt, step=0)
    msg = str(info.value)
    assert ("the checkpoint has no optimizer state: step 0 was saved before the optimizer's "
            "first step (only its param groups were saved), but this optimizer has state for 4 "
            "parameters") in msg, msg
    assert "load into a freshly constructed optimizer" in msg, msg
    assert "strict=False loads the model and keeps this optimizer's current state" in msg, msg
    assert "missing" not in msg and "optim/" not in msg, msg
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    with caplog.at_level("WARNING", logger="ckptd.client"):
        c.load(model, optimizer=opt, step=0, strict=False)
    assert "keeping the optimizer's current state (strict=False)" in caplog.text
    assert all(torch.equal(v, initial[k]) for k, v in model.state_dict().items())
    assert len(opt.state) == 4
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    c.load(model, optimizer=opt, step=0)
    assert not opt.state and opt.param_groups[0]["lr"] == 0.01
    c.close()


def test_overlap_saves_share_one_stager_thread_and_each_saves_its_own_step(tmp_path):
    """Overlapped saves queue their copy on one reused thread (save_async does not wait for
    a new thread to start); each save still holds the values of its own step, because the
    optimizer's next step() waits for the copy; close() stops the thread."""
    import threading

    torch.manual_seed(0)
    m = torch.nn.Linear(16, 8)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    client = CheckpointClient("ovl", storage=f"file://{tmp_path}")
    expected, handles = {}, []
    for step in (1, 2, 3):
        m(torch.randn(4, 16)).sum().backward()
        expected[step] = {k: v.clone() for k, v in m.state_dict().items()}
        handles.append(client.save_async(m, optimizer=opt, step=step, overlap=True))
        opt.step()
        opt.zero_grad()
    for h in handles:
        h.result(60)
    stagers = [t for t in threading.enumerate() if t.name.startswith("ckptd-stage")]
    assert len(stagers) == 1
    for step, want in expected.items():
        back = torch.nn.Linear(16, 8)
        client.load(back, step=step)
        for k, v in want.items():
            assert torch.equal(back.state_dict()[k], v), (step, k)
    client.close()
    assert not stagers[0].is_alive()


def test_a_load_waits_for_an_overlapped_save_still_copying_from_the_model(tmp_path,
                                                                         monkeypatch):
    """save_async(overlap=True) then load (a rollback) before the optimizer's next step: the
    load must not overwrite the parameters under the save's background copy, which saved
    the step with values of the loaded one.  The copy is held until the load either waits
    for the save or has overwritten the model, so the order is not left to timing."""
    import threading

    from ckptd.format.reader import CheckpointReader
    from ckptd_client import client as client_mod
    from ckptd_client.client import SaveHandle

    go = threading.Event()
    real_stage, real_wait, real_result, real_read = (
        client_mod.stage, SaveHandle.wait_staged, SaveHandle.result, CheckpointReader.read_targets)

    def held_stage(*args, **kwargs):
        assert go.wait(60)
        return real_stage(*args, **kwargs)

    def wait_staged(self, timeout=None):
        go.set()
        return real_wait(self, timeout)

    def result(self, timeout=None):
        go.set()
        return real_result(self, timeout)

    def read_targets(self, targets):
        out = real_read(self, targets)
        go.set()
        return out

    m = torch.nn.Linear(64, 32)
    client = CheckpointClient("ovl-load", storage=f"file://{tmp_path}")
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(1.0)
    client.save(m, step=1)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(2.0)
    monkeypatch.setattr(client_mod, "stage", held_stage)
    monkeypatch.setattr(SaveHandle, "wait_staged", wait_staged)
    monkeypatch.setattr(SaveHandle, "result", result)
    monkeypatch.setattr(CheckpointReader, "read_targets", read_targets)
    h = client.save_async(m, step=2, overlap=True)
    client.load(m, step=1)
    assert h.result(60).step == 2
    assert all(torch.equal(p, torch.ones_like(p)) for p in m.parameters())
    back = torch.nn.Linear(64, 32)
    client.load(back, step=2)
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in back.parameters())
    client.close()


def test_a_script_that_exits_right_after_save_async_still_commits_that_save(tmp_path):
    """The last save of a training script (embedded mode, copy and overlap) is written when
    the interpreter exits without waiting for it: its writer was refused by concurrent.futures
    at exit ("cannot schedule new futures after interpreter shutdown"), exit code 0, step lost."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from ckptd_client import CheckpointClient\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Linear(64, 64)\n"
        f"a = CheckpointClient('copy', storage={_uri(tmp_path)!r})\n"
        f"b = CheckpointClient('overlap', storage={_uri(tmp_path)!r})\n"
        "a.save_async(m, step=7)\n"
        "b.save_async(m, step=8, overlap=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    storage = open_storage(_uri(tmp_path))
    assert resolve_step(storage, "copy", None).step == 7, proc.stderr
    assert resolve_step(storage, "overlap", None).step == 8, proc.stderr
    torch.manual_seed(0)
    saved = torch.nn.Linear(64, 64)
    for job in ("copy", "overlap"):
        back = torch.nn.Linear(64, 64)
        CheckpointClient(job, storage=_uri(tmp_path)).load(back)
        _equal(back, saved)


class _Doubling(torch.nn.Linear):
    """Loads every tensor doubled (a module with its own loading logic)."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        for k in list(state_dict):
            if k.startswith(prefix):
                state_dict[k] = state_dict[k] * 2
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def test_torch_load_state_dict_runs_only_where_it_would_do_more_than_copy_in_place(
        tmp_path, monkeypatch):
    """A plain module is read straight into its parameters and buffers, without torch's
    load_state_dict (which, for a container with thousands of children, costs seconds and
    would only copy each tensor onto itself); a module with load hooks or its own
    ``_load_from_state_dict`` still goes through it, so that logic runs."""
    import torch.distributed.checkpoint.state_dict as sd

    calls = []
    real = sd.set_model_state_dict
    monkeypatch.setattr(sd, "set_model_state_dict",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    plain = torch.nn.Sequential(*(torch.nn.Linear(3, 3) for _ in range(20)),
                                torch.nn.LayerNorm(3))
    plain.register_buffer("count", torch.arange(5))
    hooked = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    seen = []
    hooked[1].register_load_state_dict_post_hook(lambda mod, keys: seen.append(mod))
    custom = torch.nn.Sequential(_Doubling(3, 3))
    client = CheckpointClient("j", storage=f"file://{tmp_path}")
    for i, model in enumerate((plain, hooked, custom)):
        want = {k: v.clone() for k, v in model.state_dict().items()}
        client.save(model, step=i)
        with torch.no_grad():
            for v in model.state_dict().values():
                v.add_(1)
        client.load(model, step=i)
        factor = 2 if model is custom else 1
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[k] * factor), k
    assert len(calls) == 2          # hooked and custom only
    assert seen == [hooked[1]]
    client.close()
