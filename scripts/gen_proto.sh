#!/usr/bin/env bash
# Regenerate the Python gRPC stubs in ckptd/v1/ from proto/ckptd/v1/ckptd.proto.
# Usage: scripts/gen_proto.sh [OUTPUT_DIR]   (default: the repository root)
# tests/daemon/test_daemon_proto_drift.py runs this into a temporary directory and compares.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$root}"
cd "$root"
"${PYTHON:-python}" -m grpc_tools.protoc -Iproto --python_out="$out" --grpc_python_out="$out" \
  --pyi_out="$out" proto/ckptd/v1/ckptd.proto
touch "$out/ckptd/v1/__init__.py"
