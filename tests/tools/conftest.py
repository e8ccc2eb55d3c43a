"""Fixtures of the tools tests: checkpoints saved once per session by real gloo ranks."""

from __future__ import annotations

import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


SAVE_WORLDS = (2, 4)
FRAMEWORKS = ("fsdp2", "fsdp1", "fairscale")


@pytest.fixture(scope="session")
def saved_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A storage root with ``<framework>-w<world>`` (FSDP2, FSDP1, fairscale FSDP, saved
    at world sizes 2 and 4, step 3) and ``<job>.expected.pt`` files."""
    from fastworld import run_world_fast
    from reshard_jobs import save_all

    root = str(tmp_path_factory.mktemp("saved"))
    for w in SAVE_WORLDS:
        run_world_fast(save_all, w, root)
    return root


@pytest.fixture
def work_root(saved_root: str, tmp_path) -> str:
    """A private copy of the saved checkpoints (tests that modify or add jobs)."""
    dst = str(tmp_path / "ckpt")
    shutil.copytree(saved_root, dst)
    return dst
