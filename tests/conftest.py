"""Shared pytest fixtures: the tests directory is importable (helpers like distributed.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
