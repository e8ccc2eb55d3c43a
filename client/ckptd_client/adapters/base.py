"""The framework-adapter seam.

An adapter knows one way of sharding a model (FSDP2, FSDP1, fairscale FSDP, plain/DDP)
and translates between it and ckptd's logical tensors.

Order of calls, all from the training thread:

* save: :meth:`FrameworkAdapter.save_state` once per save, on every rank at the same
  point of the program (it may run collectives, e.g. FSDP1's sharded state dict);
* load: :meth:`FrameworkAdapter.load_plan` on every rank; the caller fills every
  target's ``out`` tensor, then calls the returned plan's ``finish()`` (which may run
  collectives too, e.g. ``set_model_state_dict``).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptd.format.items import LoadTarget, SaveItem
from ckptd.format.layout import Shape


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Global shape and dtype of a logical tensor stored in a checkpoint."""

    shape: Shape
    dtype: torch.dtype


@dataclass(slots=True)
class SaveState:
    """What an adapter extracted for one save.

    ``param_groups`` is the optimizer's ``param_groups`` as JSON values, with ``params``
    replaced by the parameters' fully qualified names (empty if no optimizer).
    """

    items: list[SaveItem]
    param_groups: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class LoadPlan:
    """Targets to fill, and what to run once they are filled.

    ``model_names`` / ``optim_names``: every logical name the model/optimizer expects
    (targets may be a subset on ranks that hold nothing of a tensor); used for the
    missing/unexpected-key check.  ``group_params``: for each of the optimizer's
    ``param_groups`` in order, the names of its parameters as :attr:`SaveState.param_groups`
    records them, so saved groups are matched to live ones by their parameters; None when
    there is no optimizer (or the adapter cannot name them: groups then go by position).
    """

    targets: list[LoadTarget]
    model_names: dict[str, TensorMeta]
    optim_names: dict[str, TensorMeta]
    finish: Callable[[list[dict[str, Any]] | None], None]
    group_params: list[list[str]] | None = None


class FrameworkAdapter(abc.ABC):
    """Translate one framework's sharded state to and from logical tensors."""

    #: short name recorded in the checkpoint ("fsdp2", "fsdp1", "fairscale", "plain")
    framework: str = ""

    @classmethod
    @abc.abstractmethod
    def matches(cls, model: torch.nn.Module) -> bool:
        """Whether this adapter handles ``model``."""

    @abc.abstractmethod
    def save_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> SaveState:
        """The local shards of ``model`` (and ``optimizer``) as :class:`SaveItem` s.

        The returned tensors may alias live parameters: the caller copies them into
        staging before training goes on.
        """

    @abc.abstractmethod
    def load_plan(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        available: Mapping[str, TensorMeta],
    ) -> LoadPlan:
        """Targets for every local tensor of ``model``/``optimizer``.

        ``available`` lists the logical tensors of the checkpoint, so an adapter can
        create optimizer state that does not exist yet.  ``finish(param_groups)`` installs
        the filled tensors and the saved hyperparameters (``None`` if none were saved); the
        caller passes one saved group per live group, in the optimizer's order (matched by
        ``group_params``), and has checked them before reading anything.
        """
