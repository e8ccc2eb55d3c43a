"""Copying a rank's shards into a staging buffer: the only part of a save that blocks.

A :class:`StagingBuffer` is allocated once, pre-faulted (every page touched) and reused
for every save, because copying into fresh memory ran ~20x slower than into touched memory
on the project's machine.  On CUDA hosts the buffer is page-locked so device-to-host copies
run at full speed and asynchronously.
"""

from __future__ import annotations

import contextlib

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


def ready_event(items: list[SaveItem]) -> object | None:
    """A CUDA event recorded now on the current stream if any item lives on a GPU.

    Call it on the training thread when the save is taken: the staging copies wait for it
    (the values as of this point), not for kernels the loop enqueues afterwards.
    """
    devs = {it.local.device for it in items if it.local.is_cuda}
    if not devs:
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(next(iter(devs))))
    return ev


_SIDE_STREAMS: dict[object, object] = {}


def _side_stream(device: torch.device) -> object:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def stage(plan: RankPlan, items: list[SaveItem], buffer: torch.Tensor,
          ready: object | None = None) -> None:
    """Copy every planned item into ``buffer`` (1-D uint8) and zero the alignment gaps.

    Device tensors are copied on a side stream (so the copies overlap the loop's compute)
    after ``ready`` (from :func:`ready_event`; the current stream's work so far if None),
    into the page-locked buffer, and waited for: on return the buffer holds the save's
    bytes.  Called from the training thread (copy mode) or a staging thread (overlap mode).
    """
    cuda = [items[c.item].local.device for c in plan.copies if items[c.item].local.is_cuda]
    ctx = contextlib.nullcontext()
    side = None
    if cuda:
        side = _side_stream(cuda[0])
        if ready is None:
            ready = ready_event([items[plan.copies[0].item]] if plan.copies else [])
        side.wait_event(ready)  # type: ignore[attr-defined]
        ctx = torch.cuda.stream(side)  # type: ignore[assignment]
    end = 0
    with ctx:
        for c in sorted(plan.copies, key=lambda c: c.offset):
            if c.offset > end:
                buffer[end:c.offset].zero_()
            item = items[c.item]
            dst = buffer[c.offset:c.offset + c.nbytes]
            src = item.local
            if c.chunk_shape is not None:
                dst.zero_()
                corner = tuple(slice(0, n) for n in src.shape)
                dst.view(item.dtype).view(c.chunk_shape)[corner].copy_(
                    src, non_blocking=src.is_cuda)
            elif c.nbytes:
                dst.view(item.dtype).view(src.shape).copy_(src, non_blocking=src.is_cuda)
            end = c.offset + c.nbytes
        if plan.nbytes > end:
            buffer[end:plan.nbytes].zero_()
    if side is not None:
        side.synchronize()  # type: ignore[attr-defined]
