"""ckptd: async, sharded, world-size-independent checkpointing for FSDP training."""

from __future__ import annotations

__version__ = "0.1.0"
FORMAT_VERSION = 1
