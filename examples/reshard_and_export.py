"""Reshard a stored checkpoint for another world size, verify it, export it to safetensors.

    python examples/reshard_and_export.py file:///tmp/ckpt/fsdp2-hf --to-world-size 4 \
        --out file:///tmp/ckpt/fsdp2-hf-w4 --export /tmp/fsdp2-hf.safetensors

Runs the operator tools a user would run by hand (`ckptd reshard`, `ckptd verify`,
`ckptd export`), then opens the exported file with `safetensors` and prints what is in it.
Works on any checkpoint ckptd wrote (FSDP2, FSDP1, fairscale FSDP: flat parameters come out
under their original names and shapes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def ckptd(*args: str) -> dict:
    cmd = [sys.executable, "-m", "ckptd.cli", *args, "--json"]
    print("$ ckptd " + " ".join(args), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"`ckptd {' '.join(args)}` failed ({proc.returncode}):\n{proc.stderr}")
    return json.loads(proc.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("checkpoint", help="URI/JOB of the source checkpoint")
    p.add_argument("--to-world-size", type=int, required=True)
    p.add_argument("--out", required=True, help="URI/JOB for the resharded checkpoint")
    p.add_argument("--export", required=True, help="path of the .safetensors file to write")
    args = p.parse_args()

    r = ckptd("reshard", args.checkpoint, "--to-world-size", str(args.to_world_size),
              "--out", args.out)
    print(f"  resharded step {r.get('step')} for {args.to_world_size} ranks")
    v = ckptd("verify", args.out)
    print(f"  verify: {'OK' if v.get('ok') else 'PROBLEMS: ' + str(v)}")
    if not v.get("ok"):
        sys.exit(1)
    ckptd("export", args.out, "--format", "safetensors", "--out", args.export)

    from safetensors.torch import load_file

    tensors = load_file(args.export)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"  {args.export}: {len(tensors)} tensors, {total / 1e6:.1f} MB")
    for name in sorted(tensors)[:8]:
        t = tensors[name]
        print(f"    {name:50s} {str(tuple(t.shape)):>16s} {t.dtype}")


if __name__ == "__main__":
    main()
