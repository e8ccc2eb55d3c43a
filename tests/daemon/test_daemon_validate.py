"""The daemon's checks of client plans (unit): a real plan passes; every kind of tampering
is a StagingError/ConfigError naming the problem."""

from __future__ import annotations

import json

import pytest
import torch
from ckptd_client.adapters import adapter_for

from ckptd.daemon import validate
from ckptd.errors import ConfigError, StagingError
from ckptd.format.plan import plan_rank_save


def real_plan() -> tuple[dict, int]:
    m = torch.nn.Sequential(torch.nn.Linear(600, 500), torch.nn.LayerNorm(500))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 600)).sum().backward()
    opt.step()
    state = adapter_for(m).save_state(m, opt)
    plan = plan_rank_save(list(state.items), 0, 1)
    return plan.to_json(), plan.nbytes


def test_real_plan_passes():
    doc, n = real_plan()
    p = validate.plan(json.dumps(doc).encode(), n)
    assert p.nbytes == n and p.writes


def _mutated(fn) -> tuple[bytes, int]:
    doc, n = real_plan()
    fn(doc)
    return json.dumps(doc).encode(), n


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d["writes"][0].__setitem__(1, 10**12), "outside"),
    (lambda d: d["writes"][0].__setitem__(2, -5), "outside"),
    (lambda d: d.__setitem__("nbytes", 10**15), "segment holds"),
    (lambda d: d["writes"][0].__setitem__(0, "../../etc/passwd"), "safe"),
    (lambda d: d["writes"][0].__setitem__(0, "_ranks/0.json"), "safe"),
    (lambda d: d["writes"].append(list(d["writes"][0])), "twice"),
    (lambda d: d["writes"].pop(0), "does not write"),
    (lambda d: d["writes"][0].__setitem__(3, 7), "padding"),
    (lambda d: next(iter(d["arrays"].values())).__setitem__("dtype", "float128"), "dtype"),
    (lambda d: next(iter(d["array_meta"].values())).__setitem__("chunk_shape", [0]), "shape"),
    (lambda d: d.__setitem__("arrays", {"../x": {"shape": [1], "dtype": "float32",
                                                  "chunk_shape": [1], "chunks": {}}}), "safe"),
    (lambda d: d.pop("writes"), "malformed"),
    (lambda d: d.__setitem__("copies", "x"), "malformed"),
])
def test_tampered_plans_are_rejected(mutate, match):
    data, n = _mutated(mutate)
    with pytest.raises(StagingError, match=match):
        validate.plan(data, n)


def test_plan_larger_than_segment_and_garbage():
    doc, n = real_plan()
    with pytest.raises(StagingError, match="segment holds"):
        validate.plan(json.dumps(doc).encode(), n - 1)
    for junk in (b"", b"[]", b"\xff", b"{}"):
        with pytest.raises(StagingError):
            validate.plan(junk, n)


def test_identity_and_keys():
    validate.identity("job-1", 3, "a.1", 1, 2, "fsdp2")
    with pytest.raises(ConfigError):
        validate.identity("../job", 3, "a", 0, 1, "x")
    with pytest.raises(ConfigError):
        validate.identity("job", 3, "../a", 0, 1, "x")
    with pytest.raises(ConfigError, match="outside world"):
        validate.identity("job", 3, "a", 2, 2, "x")
    with pytest.raises(ConfigError, match="out of range"):
        validate.identity("job", 3, "a", 0, 0, "x")
    with pytest.raises(ConfigError, match="framework"):
        validate.identity("job", 3, "a", 0, 1, "x/../y")
    assert validate.job_key("job", "job/000000000001/COMMITTED")
    assert validate.job_key("job", "job") == "job"
    for bad in ("jobx/1", "other/job/1", "job/../other", "/job/1", "job//1"):
        with pytest.raises(ConfigError):
            validate.job_key("job", bad)
    with pytest.raises(StagingError):
        validate.param_groups(b'{"a": 1}')
    assert validate.param_groups(b"") == []


def test_plan_cache_reuses_a_check_only_for_the_same_bytes_and_size():
    doc, n = real_plan()
    data = json.dumps(doc).encode()
    cache = validate.PlanCache(capacity=2)
    p = cache.plan(data, n)
    assert cache.plan(data, n) is p and (cache.hits, cache.misses) == (1, 1)
    # the same plan against another segment size is checked again (and may fail there)
    with pytest.raises(StagingError, match="segment holds"):
        cache.plan(data, n - 1)
    assert cache.plan(data, n + 4096).nbytes == n and cache.misses == 2
    # a changed plan after a good one is checked in full: a tampered write is rejected...
    doc["writes"][0][1] = 10**12
    bad = json.dumps(doc).encode()
    for _ in range(2):  # ...every time: failures are not cached
        with pytest.raises(StagingError, match="outside"):
            cache.plan(bad, n)
    assert cache.misses == 2 and len(cache) == 2
    # bounded (LRU): the oldest plan is dropped and checked again when it comes back
    cache.plan(json.dumps(real_plan()[0], indent=1).encode(), n)  # other bytes: a miss
    assert len(cache) == 2 and cache.misses == 3
    assert cache.plan(data, n) is not p and cache.misses == 4


def _rr(key: str = "job/1/a/c/0", start: int = 0, length: int = 16, offset: int = 0,
        whole: bool = False) -> validate.ReadSpec:
    return validate.ReadSpec(key, start, length, offset, whole)


def test_read_ranges_inside_the_segment_below_the_job_and_disjoint():
    ok = validate.read_ranges("job", [_rr(offset=0), _rr(offset=16, whole=True),
                                      _rr(offset=1008, length=16), _rr(length=0, offset=1024)],
                              1024)
    assert [r.offset for r in ok] == [0, 16, 1008, 1024]
    with pytest.raises(StagingError, match=r"\[1020, 1036\) lie outside"):
        validate.read_ranges("job", [_rr(offset=1020)], 1024)
    with pytest.raises(StagingError, match="outside"):
        validate.read_ranges("job", [_rr(offset=0, length=1 << 63)], 1024)
    with pytest.raises(StagingError, match="ranges 0 and 1 overlap"):
        validate.read_ranges("job", [_rr(offset=0), _rr(offset=15)], 1024)
    with pytest.raises(StagingError, match="must start at 0"):
        validate.read_ranges("job", [_rr(start=4, whole=True)], 1024)
    with pytest.raises(StagingError, match="at most 4096"):
        validate.read_ranges("job", [_rr(offset=0, length=0)] * 4097, 1024)
    for key in ("other/1", "job", "job/../other/x", "/job/1"):
        with pytest.raises(ConfigError):
            validate.read_ranges("job", [_rr(key=key)], 1024)
