"""Shared pytest set-up: the tests directory is importable (helpers such as distributed.py),
and the SeaweedFS S3 fixtures (s3_server, s3_uri, s3_options) are available everywhere."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

pytest_plugins = ["s3fixture"]
