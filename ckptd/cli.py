"""The ``ckptd`` command line.  Each subcommand lives in its own module and registers
itself through an ``add_parser(subparsers)`` function listed in ``_COMMANDS``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ckptd import __version__
from ckptd.errors import CkptdError

# module path -> list of subcommands it provides (imported lazily, so `ckptd ls` does not
# import grpc and `ckptd serve` does not import the tools)
_COMMANDS: list[str] = [
    "ckptd.daemon.cli",   # serve, health
    "ckptd.tools.cli",    # ls, inspect, verify, export, gc, reshard
    "ckptd.demo",         # demo
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptd", description="Async sharded checkpointing for FSDP training (zarr v3).")
    parser.add_argument("--version", action="version", version=f"ckptd {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in _COMMANDS:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # ckptd's own progress at INFO; other libraries only warn unless -v (botocore's INFO
    # "Found credentials in environment variables." came with every command on S3)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(message)s", stream=sys.stderr)
    if not args.verbose:
        logging.getLogger("ckptd").setLevel(logging.INFO)
    try:
        return int(args.func(args) or 0)
    except CkptdError as exc:
        print(f"ckptd {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and closed: not an error
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
