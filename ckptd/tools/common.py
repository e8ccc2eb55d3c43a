"""Shared helpers of the operator tools: ``URI/JOB`` parsing, object ages, output.

Tools print tables on a terminal (rich) and JSON with ``--json``; progress bars go to
stderr and only when stderr is a terminal and ``--json`` is off.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ckptd.errors import ConfigError
from ckptd.format import paths
from ckptd.storage import bare_scheme, open_storage
from ckptd.storage.base import StorageBackend

# --------------------------------------------------------------------------- URIs


def strip_slashes(uri: str) -> str:
    """``uri`` without surrounding blanks and trailing ``/``, keeping a scheme's ``//`` and a
    lone root ``/`` (``s3://`` stays ``s3://``, ``file:///`` stays ``file:///``)."""
    u = uri.strip()
    m = re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", u)
    head, rest = (u[: m.end()], u[m.end():]) if m else ("", u)
    return head + (rest.rstrip("/") or rest[:1])


def split_job_uri(uri: str) -> tuple[str, str]:
    """``URI/JOB`` -> (storage URI, job): the last path component is the job.

    ``file:///ckpt/myjob`` -> (``file:///ckpt``, ``myjob``); ``s3://bucket/prefix/myjob``
    -> (``s3://bucket/prefix``, ``myjob``); ``/ckpt/myjob``, ``ckpt/myjob``,
    ``~/ckpt/myjob`` or ``file:/ckpt/myjob`` -> (that directory, ``myjob``), as
    :func:`ckptd.storage.open_storage` reads the same forms.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError("expected URI/JOB, e.g. file:///ckpt/myjob or s3://bucket/prefix/myjob")
    u = strip_slashes(uri)
    if u.startswith("s3://"):
        rest = u[len("s3://"):]
        if not rest:
            raise ConfigError(f"{uri!r} names no bucket: expected s3://bucket[/prefix]/JOB")
        if "/" not in rest:
            raise ConfigError(
                f"{uri!r} names a bucket but no job: expected s3://bucket[/prefix]/JOB"
            )
        base, job = rest.rsplit("/", 1)
        root = f"s3://{base}"
    elif u.startswith("file://"):
        path = u[len("file://"):]
        if not path.startswith("/"):
            raise ConfigError(
                f"file URI {uri!r} is not absolute: expected file:///absolute/path/JOB"
            )
        base, job = path.rsplit("/", 1)
        root = f"file://{base or '/'}"
    elif u.startswith("file:/"):  # RFC 8089's short form of an absolute file URI
        base, job = u[len("file:"):].rsplit("/", 1)
        root = f"file://{base or '/'}"
    elif "://" in u:
        raise ConfigError(
            f"storage URI scheme {u.split('://', 1)[0]!r} is not supported in {uri!r}: expected "
            "file:// or s3://"
        )
    else:
        scheme = bare_scheme(u)
        if scheme:  # e.g. 's3:/bucket/job': a mistyped URI must not become a local directory
            raise ConfigError(
                f"{uri!r} looks like a URI with scheme {scheme!r} but lacks '//': "
                "expected file:///absolute/path/JOB or s3://bucket[/prefix]/JOB. For a local "
                "directory whose name contains ':', write it as './name/JOB'"
            )
        u = os.path.expanduser(u)
        base, _, job = u.rpartition("/") if "/" in u else ("", "", u)
        root = os.path.abspath(base or ".") if not u.startswith("/") or base else "/"
    if not job:
        raise ConfigError(f"{uri!r} has no job name: expected URI/JOB")
    try:
        paths.check_job(job)
    except ConfigError as exc:
        raise ConfigError(f"in {uri!r}: {exc}") from None
    return root, job


def open_job(uri: str) -> tuple[StorageBackend, str]:
    root, job = split_job_uri(uri)
    return open_storage(root), job


# --------------------------------------------------------------------------- formatting


def human_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.1f}{unit}" if s < 10 * size else f"{s / size:.0f}{unit}"
    return f"{s:.0f}s"


def parse_duration(text: str) -> float:
    """``3600``, ``90s``, ``30m``, ``1h``, ``2d`` -> seconds."""
    t = str(text).strip().lower()
    mult = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if t and t[-1] in mult:
            v = float(t[:-1]) * mult[t[-1]]
        else:
            v = float(t)
    except ValueError:
        raise ConfigError(
            f"duration {text!r} is invalid: expected seconds or a number with s/m/h/d, e.g. 1h"
        ) from None
    if v < 0:
        raise ConfigError(f"duration {text!r} is negative")
    return v


def thread_count(text: str) -> int:
    """argparse type of ``--threads``: an integer in [1, 256]."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of threads, got {text!r}") \
            from None
    if not 1 <= n <= 256:
        raise argparse.ArgumentTypeError(f"expected a number of threads in [1, 256], got {n}")
    return n


def print_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")
    sys.stdout.flush()


def print_table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]],
                *, right: Iterable[str] = ()) -> None:
    from rich.console import Console
    from rich.table import Table

    right = set(right)
    table = Table(title=title, show_lines=False, header_style="bold")
    for c in columns:
        table.add_column(c, justify="right" if c in right else "left", overflow="fold")
    for r in rows:
        table.add_row(*("" if v is None else str(v) for v in r))
    Console(soft_wrap=False, width=None if sys.stdout.isatty() else 200).print(table)


def print_lines(lines: Iterable[str]) -> None:
    for line in lines:
        print(line)


class _Advance:
    """``advance(n)`` adds n bytes; ``advance.set_total(n)`` sets the total."""

    def __init__(self, prog: Any = None, task: Any = None) -> None:
        self._prog, self._task = prog, task

    def __call__(self, n: int) -> None:
        if self._prog is not None:
            self._prog.advance(self._task, n)

    def set_total(self, n: int) -> None:
        if self._prog is not None:
            self._prog.update(self._task, total=n)


@contextmanager
def progress_bar(description: str, total: int, enabled: bool) -> Iterator[_Advance]:
    """A bytes progress bar on stderr (only if ``enabled`` and stderr is a terminal)."""
    if not enabled or not sys.stderr.isatty():
        yield _Advance()
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=False) as prog:
        yield _Advance(prog, prog.add_task(description, total=total or None))
