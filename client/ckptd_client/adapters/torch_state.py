"""PyTorch adapter: FSDP2 (``fully_shard``), FSDP1 (sharded state dicts), DDP and plain modules.

Uses ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` /
``get_optimizer_state_dict`` with ``full_state_dict=False``), which yields clean FQNs and
the local shards as DTensors (FSDP2), ShardedTensors (FSDP1) or plain tensors (DDP/plain).
Each becomes a :class:`SaveItem`:

* DTensor: the local region from the mesh coordinates; dims sharded by exactly one mesh
  dim get a regular chunk grid ``ceil(d / n)`` (``torch.chunk`` semantics), so every rank
  writes whole chunks; ranks that are replicas along a ``Replicate`` mesh dim (HSDP) write
  nothing.  Other layouts (strided shards: TP x FSDP2) are stored as per-rank piece
  arrays; a DTensor whose local part is not one box (Partial, scattered strided shards,
  ``from_local`` with uneven sizes) is a ConfigError.
* ShardedTensor: one item per local shard, chunk grid along dim 0.
* plain tensor: replicated; one rank writes it.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ckptd.errors import ConfigError, StateMismatchError
from ckptd.format.items import LoadTarget, SaveItem
from ckptd.format.layout import Region, Shape, dim0_chunk_shape
from ckptd_client.adapters.base import FrameworkAdapter, LoadPlan, SaveState, TensorMeta


def _is_dtensor(v: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(v, DTensor)


def _is_sharded_tensor(v: Any) -> bool:
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(v, ShardedTensor)


def framework_of(model: torch.nn.Module) -> str:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        FSDPModule = ()  # type: ignore[assignment,misc]
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    mods = list(model.modules())
    if any(isinstance(m, FSDPModule) for m in mods):  # type: ignore[arg-type]
        return "fsdp2"
    if any(isinstance(m, FullyShardedDataParallel) for m in mods):
        return "fsdp1"
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    return "plain"


def _dtensor_layout(name: str, v: Any) -> tuple[Region, Shape | None, bool]:
    """(local region, chunk shape or None, whether this rank writes it) of a DTensor.

    ConfigError for a layout ckptd cannot store as boxes: a placement other than Shard,
    _StridedShard and Replicate (Partial values need a reduction first), strided shards
    whose local rows are not one contiguous range, or a local tensor of another shape than
    the placements give (``DTensor.from_local`` with uneven local sizes).
    """
    mesh = v.device_mesh
    try:
        region, chunk, writer = _layout(tuple(v.shape), mesh, tuple(v.placements))
    except _LayoutError as e:
        raise ConfigError(
            f"cannot checkpoint {name!r}: a DTensor of shape {list(v.shape)} with placements "
            f"{tuple(v.placements)} on a mesh of shape {tuple(mesh.shape)}: {e}"
        ) from None
    local = tuple(_local_of(v).shape)
    if local != region.shape:
        raise ConfigError(
            f"cannot checkpoint {name!r}: a DTensor of shape {list(v.shape)} with placements "
            f"{tuple(v.placements)} on a mesh of shape {tuple(mesh.shape)}: its local tensor "
            f"on this rank has shape {list(local)}, but these placements give this rank "
            f"(mesh coordinate {mesh.get_coordinate()}) the box at offsets "
            f"{list(region.offsets)} of shape {list(region.shape)} (torch.chunk split, as "
            "distribute_tensor splits). ckptd stores DTensors split that way only: build it "
            "with distribute_tensor, or DTensor.from_local with the local sizes torch.chunk "
            "gives, or save its full_tensor() instead."
        )
    return region, chunk, writer


class _LayoutError(ValueError):
    pass


def _chunk(n: int, k: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``k`` of a length-``n`` sequence, as torch.chunk splits it."""
    c = -(-n // k)
    return min(n, i * c), min(n, (i + 1) * c)


def _take(ivs: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Positions ``[lo, hi)`` of the index sequence made of the intervals ``ivs``."""
    out = []
    pos = 0
    for a, b in ivs:
        s, e = max(lo, pos), min(hi, pos + b - a)
        if s < e:
            out.append((a + s - pos, a + e - pos))
        pos += b - a
    return out


def _shard_indices(n: int, mesh_shape: Shape, coord: Sequence[int], placements: tuple,
                   dim: int) -> list[tuple[int, int]]:
    """The indices of tensor dim ``dim`` (length ``n``) that mesh coordinate ``coord``
    holds, as intervals in the order the local tensor holds them: placements applied left
    to right, ``Shard`` taking its torch.chunk part, ``_StridedShard(sf)`` splitting into
    ``sf`` parts first and taking its part of each (as ``_StridedShard._split_tensor``)."""
    ivs = [(0, n)] if n else []
    for m, p in enumerate(placements):
        if not _is_shard_like(p) or p.dim != dim:
            continue
        total = sum(b - a for a, b in ivs)
        sf = int(p.split_factor) if _is_strided_shard(p) else 1
        nxt: list[tuple[int, int]] = []
        for j in range(sf):
            a, b = _chunk(total, sf, j)
            lo, hi = _chunk(b - a, mesh_shape[m], coord[m])
            nxt += _take(ivs, a + lo, a + hi)
        ivs = nxt
    merged: list[tuple[int, int]] = []
    for a, b in ivs:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


def _strided_dims_not_boxes(shape: Shape, mesh_shape: Shape, placements: tuple) -> list[int]:
    """Tensor dims where some rank's strided shard is not one contiguous, ascending range.

    torch reports a rank's part of each dim as (first offset, length); with ``_StridedShard``
    the true indices may be scattered (``Shard(0), _StridedShard(0, split_factor=2)`` gives
    mesh coordinate (0, 0) rows 0 and 2 of 8), which no box describes.  Checked for every
    coordinate (pure arithmetic on intervals), so that all ranks refuse such a layout.
    """
    bad = []
    for dim in sorted({p.dim for p in placements if _is_strided_shard(p)}):
        mdims = [m for m, p in enumerate(placements) if _is_shard_like(p) and p.dim == dim]
        coord = [0] * len(mesh_shape)
        for sub in itertools.product(*(range(mesh_shape[m]) for m in mdims)):
            for m, c in zip(mdims, sub):
                coord[m] = c
            if len(_shard_indices(shape[dim], mesh_shape, coord, placements, dim)) > 1:
                bad.append(dim)
                break
    return bad


def _is_strided_shard(p: Any) -> bool:
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - torch without strided shards
        return False
    return isinstance(p, _StridedShard)


def _is_shard_like(p: Any) -> bool:
    """Shard or _StridedShard (which is not a Shard subclass in torch >= 2.10)."""
    from torch.distributed.tensor import Shard

    return isinstance(p, Shard) or _is_strided_shard(p)


@functools.lru_cache(maxsize=65536)
def _layout(shape: Shape, mesh: Any, placements: tuple) -> tuple[Region, Shape | None, bool]:
    """Cached: a layout depends only on the global shape, the mesh and the placements, and
    computing it costs ~0.1 ms per tensor, which adds up in the training loop's stall."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for mdim, p in enumerate(placements):
        if not (_is_shard_like(p) or isinstance(p, Replicate)):
            raise _LayoutError(
                f"mesh dim {mdim} has placement {p}; ckptd stores Shard, _StridedShard and "
                "Replicate placements only (a Partial DTensor holds per-rank values still to "
                "be reduced). Reduce it first (t.redistribute(placements=...) with Replicate() "
                "or Shard(d) in place of each Partial), or keep it out of the saved state."
            )
    bad = _strided_dims_not_boxes(shape, tuple(mesh.shape), placements)
    if bad:
        raise _LayoutError(
            f"with these strided shards a rank's part of dim {bad[0]} is not one contiguous "
            "range of indices, which ckptd cannot store as a box. Redistribute it to "
            "another layout (t.redistribute(placements=...)) or save its full_tensor()."
        )
    local_shape, offset = compute_local_shape_and_global_offset(torch.Size(shape), mesh,
                                                                placements)
    region = Region(tuple(int(x) for x in offset), tuple(int(x) for x in local_shape))
    coord = mesh.get_coordinate() or [0] * mesh.ndim
    for dim in {p.dim for p in placements if _is_strided_shard(p)}:
        ivs = _shard_indices(shape[dim], tuple(mesh.shape), coord, placements, dim)
        box = (region.offsets[dim], region.offsets[dim] + region.shape[dim])
        if (ivs[0] if ivs else None) != (box if region.shape[dim] else None):
            raise _LayoutError(
                f"torch places this rank's part of dim {dim} at [{box[0]}, {box[1]}) but "
                f"ckptd computes {ivs}: ckptd does not know this torch version's strided "
                "shards. Redistribute it to Shard/Replicate placements "
                "(t.redistribute(placements=...)) or save its full_tensor()."
            )
    # replicas along a Replicate mesh dim (HSDP) skip it; every shard writes its part
    writer = all(c == 0 for c, p in zip(coord, placements) if not _is_shard_like(p))
    per_dim: dict[int, list[int]] = {}
    grid_ok = True
    for mdim, p in enumerate(placements):
        if type(p) is Shard:
            per_dim.setdefault(p.dim, []).append(mesh.size(mdim))
        elif not isinstance(p, Replicate):
            grid_ok = False  # _StridedShard: no regular grid; stored as per-rank pieces
    chunk: Shape | None = None
    if grid_ok and all(len(ns) == 1 for ns in per_dim.values()):
        chunk = tuple(
            max(1, -(-d // per_dim[i][0])) if i in per_dim else max(1, d)
            for i, d in enumerate(shape)
        )
    return region, chunk, writer


def _local_of(v: Any) -> torch.Tensor:
    """A DTensor's local shard, without grad.  ``_local_tensor`` skips the autograd function
    and dispatch of ``to_local()`` (~10 us per tensor, on the save's critical path)."""
    local = getattr(v, "_local_tensor", None)
    return (local if isinstance(local, torch.Tensor) else v.to_local()).detach()


def _items_for(name: str, v: Any) -> list[SaveItem]:
    if _is_dtensor(v):
        region, chunk, writer = _dtensor_layout(name, v)
        local = _local_of(v)
        return [SaveItem(name, tuple(v.shape), v.dtype, local, region, writer=writer,
                         chunk_shape=chunk)]
    if _is_sharded_tensor(v):
        shape = tuple(v.size())
        pg = getattr(v, "_process_group", None)
        nshards = len(v.metadata().shards_metadata)
        writer = True
        if dist.is_initialized() and pg is not None:
            # HSDP (FSDP1 hybrid): shard groups are blocks of consecutive ranks; replica 0
            # (the first block) writes.
            writer = dist.get_rank() < dist.get_world_size(pg)
        out = []
        for sh in v.local_shards():
            md = sh.metadata
            region = Region(tuple(md.shard_offsets), tuple(md.shard_sizes))
            out.append(SaveItem(name, shape, sh.tensor.dtype, sh.tensor, region, writer=writer,
                                chunk_shape=dim0_chunk_shape(shape, nshards)))
        return out
    if isinstance(v, torch.Tensor):
        if v.layout != torch.strided or v.is_nested:
            raise ConfigError(
                f"state entry {name!r} is a {'nested' if v.is_nested else str(v.layout)} "
                "tensor; ckptd stores dense (strided) tensors. Keep it dense in the module "
                "(e.g. register `t.to_dense()` and sparsify in forward), or make it a "
                "non-persistent buffer and save what rebuilds it in `extra=`."
            )
        return [SaveItem(name, tuple(v.shape), v.dtype, v.detach(), Region.full(v.shape),
                         replicated=True)]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(
            f"state entry {name!r} is a {type(v).__name__}; ckptd stores tensors and numbers "
            "in model/optimizer state. Put other values in `extra=`."
        )
    t = torch.tensor(v, dtype=torch.float64 if isinstance(v, float) else torch.int64)
    return [SaveItem(name, (), t.dtype, t, Region((), ()), replicated=True)]


def _targets_for(name: str, v: Any, out: list[LoadTarget]) -> TensorMeta:
    if _is_dtensor(v):
        region, _, _ = _dtensor_layout(name, v)
        out.append(LoadTarget(name, tuple(v.shape), v.dtype, v.to_local(), region=region))
        return TensorMeta(tuple(v.shape), v.dtype)
    if _is_sharded_tensor(v):
        shape = tuple(v.size())
        dtype = None
        for sh in v.local_shards():
            md = sh.metadata
            dtype = sh.tensor.dtype
            out.append(LoadTarget(name, shape, sh.tensor.dtype, sh.tensor,
                                  region=Region(tuple(md.shard_offsets), tuple(md.shard_sizes))))
        return TensorMeta(shape, dtype or v.dtype)
    if isinstance(v, torch.Tensor):
        out.append(LoadTarget(name, tuple(v.shape), v.dtype, v, region=Region.full(v.shape)))
        return TensorMeta(tuple(v.shape), v.dtype)
    raise ConfigError(f"cannot load state entry {name!r} of type {type(v).__name__}")


def materialize_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state if it has none yet.

    Takes one step with zero gradients and learning rate 0 (so parameters do not move),
    then clears the gradients; the checkpoint then overwrites the state it created.
    """
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return
    saved_lr = []
    for g in optimizer.param_groups:
        saved_lr.append(g.get("lr"))
        if "lr" in g:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, saved_lr):
            if lr is not None:
                g["lr"] = lr
        optimizer.zero_grad(set_to_none=True)


def json_param_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``param_groups`` as JSON values (tuples become lists, tensors become numbers)."""

    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.item() if v.numel() == 1 else v.tolist()
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {str(k): conv(x) for k, x in v.items()}
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        return repr(v)

    return [{k: conv(v) for k, v in g.items()} for g in groups]


def apply_hyperparameters(groups: list[dict[str, Any]], saved: list[dict[str, Any]] | None) -> None:
    """Restore saved hyperparameters onto live ``param_groups`` by group index.

    ``saved`` is in the live groups' order: ``CheckpointClient.load`` matches the saved
    groups to the live ones by their parameters' names before calling this.
    """
    if not saved:
        return
    if len(saved) != len(groups):
        raise StateMismatchError(
            f"the optimizer has {len(groups)} param groups but the checkpoint saved "
            f"{len(saved)}; build the optimizer with the same groups as the saved run"
        )
    for g, s in zip(groups, saved):
        for k, v in s.items():
            if k == "params" or k not in g:
                continue
            cur = g[k]
            if isinstance(cur, torch.Tensor):
                cur.fill_(v) if cur.numel() == 1 else cur.copy_(torch.tensor(v))
            elif isinstance(cur, tuple):
                g[k] = tuple(v)
            else:
                g[k] = v


def check_optimizer_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                           action: str) -> None:
    """ConfigError unless every parameter the optimizer holds is a parameter of ``model``.

    torch's ``get_optimizer_state_dict`` names an optimizer's parameters through the model
    and fails with a bare ``KeyError: 0`` for one it cannot find; the usual cause is an
    optimizer built before the model was sharded (``fully_shard`` and ``FSDP(...)`` replace
    the parameters, so such an optimizer updates tensors the model no longer uses).
    """
    own = {id(p) for p in model.parameters()}
    stray = [(gi, pi, p) for gi, g in enumerate(optimizer.param_groups)
             for pi, p in enumerate(g["params"]) if id(p) not in own]
    if not stray:
        return
    gi, pi, p = stray[0]
    total = sum(len(g["params"]) for g in optimizer.param_groups)
    raise ConfigError(
        f"cannot {action}: {len(stray)} of the optimizer's {total} parameters are not "
        f"parameters of the model (the first: param group {gi}, parameter {pi}, shape "
        f"{list(p.shape)}). Usually the optimizer was built before the model was wrapped: "
        "fully_shard / FSDP(...) replace the parameters, so build the optimizer from "
        "model.parameters() after wrapping (or pass the model the optimizer was built for)."
    )


def _fsdp1_flat_param_mates(model: torch.nn.Module, saved: set[str]) -> dict[str, str]:
    """For each FSDP1-managed parameter without saved optimizer state whose flat parameter
    has a parameter with saved state: that parameter's name."""
    try:
        from torch.distributed.fsdp._optim_utils import _get_fqn_to_fsdp_param_info
    except ImportError:  # pragma: no cover - torch without this helper: load as saved
        return {}
    by_flat: dict[int, list[str]] = {}
    for fqn, info in _get_fqn_to_fsdp_param_info(model).items():
        by_flat.setdefault(id(info.handle.flat_param), []).append(fqn)
    out: dict[str, str] = {}
    for fqns in by_flat.values():
        mate = next((f for f in fqns if f in saved), None)
        if mate is not None:
            out.update((f, mate) for f in fqns if f not in saved)
    return out


def _copy_scalar_state(src: dict[str, Any], dst: dict[str, Any]) -> None:
    """Give ``dst`` the scalar entries (e.g. ``step``) of ``src``; per-element ones stay."""
    for key, v in src.items():
        if key not in dst:
            continue
        if isinstance(v, (int, float)):
            dst[key] = v
        elif isinstance(v, torch.Tensor) and not _is_dtensor(v) and v.dim() == 0:
            dst[key] = v.clone()


def _resolve(model: torch.nn.Module, fqn: str) -> tuple[torch.nn.Module, str] | None:
    """The (module, attribute) that holds state entry ``fqn`` (clean FQN; DDP's ``module.``
    and torch.compile's ``_orig_mod.`` prefixes are tried too), or None."""
    for prefix in ("", "module.", "_orig_mod.", "module._orig_mod."):
        path, _, attr = (prefix + fqn).rpartition(".")
        try:
            owner = model.get_submodule(path) if path else model
        except AttributeError:
            continue
        if attr in owner._parameters or attr in owner._buffers:
            return owner, attr
    return None


def _loaded_in_place(model: torch.nn.Module, msd: dict[str, Any]) -> bool:
    """Whether ``set_model_state_dict(model, msd)`` would change nothing, because the reader
    filled ``msd``'s tensors and they are the live parameters' and buffers' own memory.

    True only for plain tensors (no DTensor, ShardedTensor: FSDP1/FSDP2/TP keep the torch
    call) in modules with torch's own ``load_state_dict`` / ``_load_from_state_dict`` and no
    load-state-dict hooks: torch would then only ``copy_`` each tensor onto itself, which
    for a module with thousands of children costs seconds (its ``load_state_dict`` filters
    the whole state dict once per child).  Anything else keeps torch's call, so custom
    loading logic and hooks run as they would without ckptd.
    """
    base = torch.nn.Module
    for m in model.modules():
        cls = type(m)
        if (m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks
                or cls._load_from_state_dict is not base._load_from_state_dict
                or cls.load_state_dict is not base.load_state_dict
                or cls.set_extra_state is not base.set_extra_state):
            return False
    for fqn, v in msd.items():
        where = _resolve(model, fqn)
        if where is None or type(v) is not torch.Tensor:
            return False
        live = getattr(*where)
        if type(live) not in (torch.Tensor, torch.nn.Parameter) or not (
                live.data_ptr() == v.data_ptr() and live.dtype == v.dtype
                and live.device == v.device and live.shape == v.shape
                and live.stride() == v.stride()):
            return False
    return True


def _storage_ptr(t: Any) -> int:
    if _is_dtensor(t):
        t = t._local_tensor
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else -1


def _model_state_dict(model: torch.nn.Module, opts: Any) -> dict[str, Any]:
    """``get_model_state_dict``; {} for a module without any state (which torch's function
    refuses outside a process group)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    if next(model.parameters(), None) is None and not any(
            b is not None and name not in mod._non_persistent_buffers_set
            for mod in model.modules() for name, b in mod._buffers.items()):
        return {}
    return get_model_state_dict(model, options=opts)


@dataclass
class _SaveCache:
    """Where each state entry lives, found once by ``get_*_state_dict`` and reused.

    Valid while the model's modules and the optimizer's parameters are the same objects
    (checked on every save by a cheap fingerprint).  Only for FSDP2, DDP and plain modules,
    whose state-dict values are the live tensors themselves (FSDP1 builds new ones).
    """

    fingerprint: tuple
    model_refs: list[tuple[str, torch.nn.Module, str]]
    optim_refs: list[tuple[str, torch.nn.Parameter]]
    param_fqns: dict[int, str]


def _fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple:
    mods = tuple(id(m) for m in model.modules())
    params = () if optimizer is None else tuple(
        id(p) for g in optimizer.param_groups for p in g["params"])
    return (id(model), mods, id(optimizer), params)


class TorchAdapter(FrameworkAdapter):
    framework = "torch"

    def __init__(self) -> None:
        self._cache: _SaveCache | None = None

    @classmethod
    def matches(cls, model: torch.nn.Module) -> bool:
        return isinstance(model, torch.nn.Module)

    def save_state(self, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer | None) -> SaveState:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        cache = self._cache
        if cache is not None and cache.fingerprint == _fingerprint(model, optimizer):
            fast = self._save_from_cache(cache, optimizer)
            if fast is not None:
                return fast
        self.framework = framework_of(model)
        opts = StateDictOptions(full_state_dict=False)
        items: list[SaveItem] = []
        msd = _model_state_dict(model, opts)
        for fqn, v in msd.items():
            items += _items_for(f"model/{fqn}", v)
        groups: list[dict[str, Any]] = []
        osd: dict[str, Any] = {"state": {}, "param_groups": []}
        if optimizer is not None:
            check_optimizer_params(model, optimizer, "save")
            fresh = not optimizer.state
            osd = get_optimizer_state_dict(model, optimizer, options=opts)
            if fresh:
                # get_optimizer_state_dict creates the state of an optimizer that has none
                # (a step with lr 0), which would move e.g. Adam's step count: a save before
                # the first step must not change training, so drop that state again and
                # save only the param groups.
                optimizer.state.clear()
                osd["state"] = {}
            for fqn, state in osd["state"].items():
                for key, v in state.items():
                    items += _items_for(f"optim/{fqn}/{key}", v)
            groups = json_param_groups(osd["param_groups"])
        self._cache = self._build_cache(model, optimizer, msd, osd)
        return SaveState(items, groups)

    def _build_cache(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                     msd: dict[str, Any], osd: dict[str, Any]) -> _SaveCache | None:
        if self.framework == "fsdp1":
            return None
        model_refs = []
        for fqn, v in msd.items():
            where = _resolve(model, fqn)
            if where is None or _storage_ptr(getattr(*where)) != _storage_ptr(v):
                return None
            model_refs.append((f"model/{fqn}", *where))
        optim_refs: list[tuple[str, torch.nn.Parameter]] = []
        param_fqns: dict[int, str] = {}
        if optimizer is not None:
            if len(osd["param_groups"]) != len(optimizer.param_groups):
                return None
            for g, sg in zip(optimizer.param_groups, osd["param_groups"]):
                if len(g["params"]) != len(sg["params"]):
                    return None
                for p, fqn in zip(g["params"], sg["params"]):
                    param_fqns[id(p)] = fqn
                    live = optimizer.state.get(p, {})
                    saved = osd["state"].get(fqn, {})
                    if list(live) != list(saved) or any(
                            isinstance(live[k], torch.Tensor)
                            and _storage_ptr(live[k]) != _storage_ptr(saved[k]) for k in live):
                        return None
                    optim_refs.append((fqn, p))
        return _SaveCache(_fingerprint(model, optimizer), model_refs, optim_refs, param_fqns)

    def _save_from_cache(self, cache: _SaveCache,
                         optimizer: torch.optim.Optimizer | None) -> SaveState | None:
        items: list[SaveItem] = []
        for name, owner, attr in cache.model_refs:
            t = getattr(owner, attr, None)
            if t is None:
                return None
            items += _items_for(name, t)  # it detaches (DTensor: the local shard)
        groups: list[dict[str, Any]] = []
        if optimizer is not None:
            for fqn, p in cache.optim_refs:
                for key, v in optimizer.state.get(p, {}).items():
                    items += _items_for(f"optim/{fqn}/{key}", v)
            groups = json_param_groups([
                {**{k: v for k, v in g.items() if k != "params"},
                 "params": [cache.param_fqns[id(p)] for p in g["params"]]}
                for g in optimizer.param_groups])
        return SaveState(items, groups)

    def load_plan(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                  available: Mapping[str, TensorMeta]) -> LoadPlan:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        self.framework = framework_of(model)
        if optimizer is not None:
            check_optimizer_params(model, optimizer, "load")
        opts = StateDictOptions(full_state_dict=False, strict=False)
        msd = _model_state_dict(model, opts)
        targets: list[LoadTarget] = []
        model_names = {f"model/{k}": _targets_for(f"model/{k}", v, targets)
                       for k, v in msd.items()}
        optim_names: dict[str, TensorMeta] = {}
        osd: dict[str, Any] | None = None
        scalars: list[tuple[dict, str, torch.Tensor]] = []
        fill: dict[str, str] = {}  # parameter without saved state -> one with, same flat param
        # An optimizer without state, loaded from a checkpoint without optimizer state (saved
        # before the first step), stays as it is: materializing its state would make it
        # differ from a fresh one (e.g. Adam's step count).
        fresh_optim = optimizer is not None and not optimizer.state and not any(
            n.startswith("optim/") for n in available)
        if optimizer is not None and not fresh_optim:
            created = not optimizer.state
            materialize_optimizer_state(optimizer)
            osd = get_optimizer_state_dict(model, optimizer, options=opts)
            if created:
                # Parameters that had no state when the checkpoint was saved (no gradient
                # yet: unused or frozen layers) get none now either, instead of the state
                # materializing just created for them -- except where FSDP1 needs it: it
                # keeps one optimizer state per flat parameter and cannot save or load one
                # whose parameters have state only in part.  Those keep the state that
                # materializing created (what zero gradients give) and take their flat
                # parameter's step (see finish).
                saved = {n[len("optim/"):].rpartition("/")[0]
                         for n in available if n.startswith("optim/")}
                if self.framework == "fsdp1":
                    # only parameters the optimizer holds: a frozen one (LoRA) shares the
                    # flat parameter under use_orig_params=True but has no optimizer state
                    fill = {f: m for f, m in _fsdp1_flat_param_mates(model, saved).items()
                            if f in osd["state"]}
                osd["state"] = {k: v for k, v in osd["state"].items()
                                if k in saved or k in fill}
            for fqn, state in osd["state"].items():
                if fqn in fill:
                    continue
                for key, v in state.items():
                    name = f"optim/{fqn}/{key}"
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        holder = torch.tensor(v, dtype=torch.float64 if isinstance(v, float)
                                              else torch.int64)
                        scalars.append((state, key, holder))
                        v = holder
                    optim_names[name] = _targets_for(name, v, targets)
        group_params: list[list[str]] | None = None
        if optimizer is not None:
            groups: Any
            if osd is None:
                # torch names a group's parameters only in an optimizer state dict, which it
                # builds by creating the state (as in save_state): drop that state again.
                groups = get_optimizer_state_dict(model, optimizer, options=opts)["param_groups"]
                optimizer.state.clear()
            else:
                groups = osd["param_groups"]
            group_params = [list(g["params"]) for g in groups]

        def finish(param_groups: list[dict[str, Any]] | None) -> None:
            if not _loaded_in_place(model, msd):
                set_model_state_dict(model, msd, options=opts)
            if optimizer is not None and osd is not None:
                for state, key, holder in scalars:
                    state[key] = holder.item()
                for fqn, mate in fill.items():
                    _copy_scalar_state(osd["state"][mate], osd["state"][fqn])
                set_optimizer_state_dict(model, optimizer, osd, options=opts)
            if optimizer is not None:
                apply_hyperparameters(optimizer.param_groups, param_groups)

        return LoadPlan(targets, model_names, optim_names, finish, group_params)


def numel(shape: Shape) -> int:
    return math.prod(shape)
