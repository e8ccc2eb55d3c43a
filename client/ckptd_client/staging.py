"""Copying a rank's shards into a staging buffer: the only part of a save that blocks.

A :class:`StagingBuffer` is allocated once, pre-faulted (every page touched) and reused
for every save, because copying into fresh memory ran ~20x slower than into touched memory
on the project's machine.  On CUDA hosts the buffer is page-locked so device-to-host copies
run at full speed and asynchronously.
"""

from __future__ import annotations

import torch

from ckptd.format.items import SaveItem
from ckptd.format.plan import RankPlan


class StagingBuffer:
    """A reusable host buffer of at least ``nbytes``; grows (reallocates) only if needed."""

    def __init__(self, pin: bool | None = None) -> None:
        self._pin = torch.cuda.is_available() if pin is None else pin
        self.tensor = torch.empty(0, dtype=torch.uint8)

    def ensure(self, nbytes: int) -> torch.Tensor:
        if self.tensor.numel() < nbytes:
            size = max(nbytes, int(self.tensor.numel() * 1.25))
            self.tensor = torch.empty(0, dtype=torch.uint8)  # free the old one first
            t = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
            t.zero_()  # pre-fault every page
            self.tensor = t
        return self.tensor[:nbytes]


def stage(plan: RankPlan, items: list[SaveItem], buffer: torch.Tensor,
          stream: object | None = None) -> None:
    """Copy every planned item into ``buffer`` (1-D uint8) and zero the alignment gaps.

    On return (after ``torch.cuda.current_stream().synchronize()`` if a stream was used)
    the buffer holds the save's bytes and the live tensors may change again.
    """
    end = 0
    for c in sorted(plan.copies, key=lambda c: c.offset):
        if c.offset > end:
            buffer[end:c.offset].zero_()
        item = items[c.item]
        dst = buffer[c.offset:c.offset + c.nbytes]
        src = item.local
        if c.nbytes:
            dst.view(item.dtype).view(src.shape).copy_(src, non_blocking=src.is_cuda)
        end = c.offset + c.nbytes
    if plan.nbytes > end:
        buffer[end:plan.nbytes].zero_()
    if any(items[c.item].local.is_cuda for c in plan.copies):
        torch.cuda.current_stream().synchronize()
