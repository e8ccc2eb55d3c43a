"""Fixtures of the daemon tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from daemon_helpers import Daemons


@pytest.fixture
def daemons(tmp_path) -> Iterator[Daemons]:
    d = Daemons(str(tmp_path))
    try:
        yield d
    finally:
        d.close()
