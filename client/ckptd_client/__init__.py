"""ckptd_client: the training-side library of ckptd.

    from ckptd_client import CheckpointClient
    client = CheckpointClient(job="llama-ft", storage="file:///ckpt")   # or daemon="unix://..."
    handle = client.save_async(model, optimizer=opt, step=step)
    info = client.load(model, optimizer=opt)
"""

from __future__ import annotations

from ckptd_client.client import CheckpointClient, CheckpointInfo, SaveHandle

__all__ = ["CheckpointClient", "CheckpointInfo", "SaveHandle"]
