"""Where every object of a checkpoint lives, relative to the storage root.

    <job>/<step:012d>/COMMITTED                       commit marker (names the attempt)
    <job>/<step:012d>/<attempt>/zarr.json             zarr v3 group of the attempt
    <job>/<step:012d>/<attempt>/index.json            consolidated index (written at commit)
    <job>/<step:012d>/<attempt>/_ranks/<rank>.json    per-rank manifests
    <job>/<step:012d>/<attempt>/_ranks/<rank>.failed  a rank's save failed (no manifest)
    <job>/<step:012d>/<attempt>/<array>/zarr.json     zarr v3 arrays, chunks at <array>/c/i/j
"""

from __future__ import annotations

import operator
import re

from ckptd.errors import ConfigError

_JOB = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ATTEMPT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
STEP_DIGITS = 12


def check_job(job: object) -> str:
    if not isinstance(job, str) or not _JOB.match(job) or ".." in job:
        raise ConfigError(
            f"job name {job!r} is invalid: expected 1-128 characters of letters, digits, '.', "
            "'_' or '-', starting with a letter or digit and without '..'"
        )
    return job


def check_attempt(attempt: object) -> str:
    if not isinstance(attempt, str) or not _ATTEMPT.match(attempt):
        raise ConfigError(
            f"attempt id {attempt!r} is invalid: expected 1-64 letters, digits, '.', '_' or '-'"
        )
    return attempt


def check_step(step: object) -> int:
    """``step`` as an int (integer-like values such as ``numpy.int64`` or a 0-dim integer
    tensor are accepted); ConfigError unless it is in ``[0, 10**12)``."""
    value: int | None = None
    if not isinstance(step, bool):
        try:
            value = operator.index(step)  # type: ignore[arg-type]
        except TypeError:
            value = None
    if value is None or not 0 <= value < 10**STEP_DIGITS:
        raise ConfigError(
            f"step {step!r} is invalid: expected an int in [0, {10**STEP_DIGITS})"
        )
    return value


def step_dir(job: str, step: int) -> str:
    return f"{check_job(job)}/{check_step(step):0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    return int(name) if len(name) == STEP_DIGITS and name.isdigit() else None


def committed_key(job: str, step: int) -> str:
    return f"{step_dir(job, step)}/COMMITTED"


def attempt_prefix(job: str, step: int, attempt: str) -> str:
    return f"{step_dir(job, step)}/{check_attempt(attempt)}"


def rank_manifest_key(prefix: str, rank: int) -> str:
    return f"{prefix}/_ranks/{rank}.json"


def rank_failure_key(prefix: str, rank: int) -> str:
    return f"{prefix}/_ranks/{rank}.failed"


def index_key(prefix: str) -> str:
    return f"{prefix}/index.json"
