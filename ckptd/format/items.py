"""What a framework adapter hands to the format layer, and what it asks back at load.

An adapter turns a model/optimizer into :class:`SaveItem` s (one per local shard of a
stored array) and, at load time, into :class:`LoadTarget` s (one per local tensor to
fill).  Names are *logical* names:

* ``model/<fqn>`` for parameters and buffers, ``<fqn>`` as in the unwrapped module's
  ``state_dict()`` (no FSDP/DDP wrapper prefixes);
* ``optim/<fqn>/<state key>`` for per-parameter optimizer state (``exp_avg``, ``step``...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptd.format.dtypes import DType
from ckptd.format.layout import Region, Shape

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Placeholder:
    """Stands in for a local tensor when only the layout is planned (reshard plans the
    destination ranks' saves without any tensor data, and without torch)."""

    shape: Shape
    dtype: str


@dataclass(frozen=True, slots=True)
class FlatView:
    """A logical tensor stored as elements ``[start, start + numel)`` of a 1-D array."""

    name: str
    shape: Shape
    dtype: DType
    start: int


@dataclass(slots=True)
class SaveItem:
    """One local shard of a stored array.

    ``region`` is where ``local`` sits in the array of shape ``global_shape``.  If
    ``replicated`` is True every rank holds the whole tensor and the planner picks one
    rank to write it.  ``writer`` False means another rank writes the same region (e.g.
    an HSDP replica), so this rank skips it.  ``logical`` False marks a storage-only array
    (a fairscale flat parameter) whose logical tensors are ``views``.
    """

    name: str
    global_shape: Shape
    dtype: DType
    local: torch.Tensor | Placeholder
    region: Region
    replicated: bool = False
    writer: bool = True
    chunk_shape: Shape | None = None
    logical: bool = True
    views: list[FlatView] = field(default_factory=list)


@dataclass(slots=True)
class LoadTarget:
    """A local tensor ``out`` to fill from logical tensor ``name``.

    Exactly one of ``region`` (``out`` is that box of the logical tensor) or
    ``flat_range`` (``out`` is 1-D and holds flat elements ``[lo, hi)`` of the logical
    tensor in C order) is set.
    """

    name: str
    global_shape: Shape
    dtype: torch.dtype
    out: torch.Tensor
    region: Region | None = None
    flat_range: tuple[int, int] | None = None
