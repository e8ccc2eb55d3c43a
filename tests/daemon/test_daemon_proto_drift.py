"""The committed stubs in ckptd/v1/ are exactly what scripts/gen_proto.sh generates."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GENERATED = ("ckptd_pb2.py", "ckptd_pb2.pyi", "ckptd_pb2_grpc.py")


def test_generated_stubs_match_proto(tmp_path):
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "gen_proto.sh"), str(tmp_path)],
                   check=True, env=dict(os.environ, PYTHON=sys.executable))
    for name in GENERATED:
        with open(os.path.join(ROOT, "ckptd", "v1", name)) as f:
            committed = f.read()
        with open(tmp_path / "ckptd" / "v1" / name) as f:
            fresh = f.read()
        assert committed == fresh, (
            f"ckptd/v1/{name} is stale: run scripts/gen_proto.sh (or `make proto`) and commit")


def test_every_rpc_is_documented():
    """Each rpc in the proto is preceded by a comment naming its deadline, idempotency and
    status codes."""
    with open(os.path.join(ROOT, "proto", "ckptd", "v1", "ckptd.proto")) as f:
        lines = f.read().splitlines()
    rpcs = [i for i, line in enumerate(lines) if line.strip().startswith("rpc ")]
    assert len(rpcs) >= 10
    for i in rpcs:
        j = i - 1
        comment = []
        while j >= 0 and lines[j].strip().startswith("//"):
            comment.append(lines[j])
            j -= 1
        text = " ".join(comment).lower()
        assert "deadline" in text and "idempotent" in text, lines[i]
