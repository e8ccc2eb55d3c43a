"""Adapter for fairscale's ``FullyShardedDataParallel`` (FSDP1 of fairscale 0.4).

fairscale keeps each wrapped module's parameters as one 1-D *flat parameter* (or, with
``flatten_parameters=False``, each parameter flattened to 1-D on its own) and gives every
rank ``torch.chunk``'s piece of it, padded at the tail to a common length ``s =
ceil(N / world)`` (``FullyShardedDataParallel._get_shard``).  Rank ``r`` holds elements
``[r*s, min(N, (r+1)*s))``; trailing ranks may hold only padding.

Storage (see DESIGN.md, "Chunks align with save-time shards"):

* each flat parameter is one 1-D array ``flat/model/<fsdp path>.flat_param_<i>`` of its
  unpadded length ``N``, chunk length ``s``, with one :class:`FlatView` per original
  parameter (``model/<fqn>``, ``fqn`` as in the unwrapped module's ``state_dict()``);
* a parameter fairscale shards without flattening it with others is the array
  ``flat/model/<fqn>`` with a single view;
* per-element optimizer state (``exp_avg``...) is stored the same way as
  ``flat/optim/<flat name>/<key>`` with views ``optim/<fqn>/<key>``; scalar state
  (``step``, python numbers) is one replicated 0-d tensor ``optim/<fqn>/<key>`` per
  original parameter;
* buffers, and parameters outside every FSDP instance, are replicated logical tensors;
  the flat parameters of a one-rank FSDP instance in a multi-rank job are stored once too,
  and a save fails if the ranks hold different values for them (per-rank MoE experts).

The adapter reads shards with ``local_state_dict()`` / ``local_metadata_dict()`` (no
gather, no CUDA) and restores by copying into the local shards in place, because
fairscale's ``load_local_state_dict`` needs CUDA.  Load works at any world size: targets
are computed from the *loading* model's own sharding only.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ckptd.errors import ConfigError
from ckptd.format.checksum import crc32c
from ckptd.format.items import FlatView, LoadTarget, SaveItem
from ckptd.format.layout import Region, Shape, dim0_chunk_len, dim0_shard
from ckptd_client.adapters.base import FrameworkAdapter, LoadPlan, SaveState, TensorMeta
from ckptd_client.adapters.torch_state import apply_hyperparameters, json_param_groups
from ckptd_client.collectives import all_gather_ints

_FSDP_MODULE = "fairscale.nn.data_parallel.fully_sharded_data_parallel"
_WRAPPER_PARTS = frozenset({"_fsdp_wrapped_module", "_fpw_module"})
_SCALAR = Region((), ())


def _fsdp_class() -> type | None:
    """fairscale's FSDP class, or None if fairscale is absent.

    A model can only be a fairscale FSDP instance if fairscale's module was imported
    already, so this never imports fairscale for users of other frameworks.
    """
    mod = sys.modules.get(_FSDP_MODULE)
    return getattr(mod, "FullyShardedDataParallel", None) if mod is not None else None


def _clean(path: str) -> str:
    """Drop fairscale's wrapper segments, exactly like fairscale's ``_clean_path``."""
    return ".".join(s for s in path.split(".") if s and s not in _WRAPPER_PARTS)


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


@dataclass(frozen=True, slots=True)
class _View:
    """An original parameter inside a 1-D storage: elements ``[start, start+numel)``."""

    fqn: str
    shape: Shape
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(slots=True)
class _Storage:
    """One 1-D parameter fairscale shards: a flat parameter or a non-flattened one."""

    key: str  # "<fsdp path>.flat_param_0" or "<fqn>", no wrapper segments
    param: torch.nn.Parameter
    numel: int  # N, unpadded
    shard_len: int  # s: every rank's shard length, padding included
    region: Region  # this rank's valid elements of [0, N)
    views: list[_View]  # original parameters; optimizer state is named after these
    aliases: list[_View]  # tied parameters: extra model names of the same elements
    replicated: bool  # the owning FSDP instance has one rank but the job has more
    instance: Any  # the owning FSDP instance
    flat_param: bool  # a FlatParameter (else one parameter fairscale did not flatten)
    writer: bool = True
    saved: torch.Tensor | None = None  # the shard as local_state_dict returned it

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a tensor with the shard's shape) as a 1-D view."""
        if not t.is_contiguous():
            raise ConfigError(
                f"fairscale shard of {self.key!r} is not contiguous (strides {t.stride()}); "
                "ckptd restores shards in place and needs contiguous storage"
            )
        return t.view(-1)

    def valid(self, t: torch.Tensor) -> torch.Tensor:
        """The unpadded part of a shard-shaped tensor."""
        return self.flat(t)[: self.region.shape[0]]

    def chunk_shape(self) -> Shape:
        return (max(1, self.shard_len),)


@dataclass(slots=True)
class _Plain:
    """A parameter outside every FSDP instance: replicated on all ranks."""

    param: torch.nn.Parameter
    fqns: list[str]  # first is the owner of optimizer state; others are tied names


@dataclass(slots=True)
class _Buffer:
    fqn: str
    module: torch.nn.Module
    attr: str
    dtype: torch.dtype  # dtype of the logical tensor (fairscale's state_dict dtype)
    saved: torch.Tensor | None = None


@dataclass(slots=True)
class _Layout:
    storages: list[_Storage] = field(default_factory=list)
    plains: list[_Plain] = field(default_factory=list)
    buffers: list[_Buffer] = field(default_factory=list)
    instances: list[Any] = field(default_factory=list)
    _owner: dict[int, _Storage | _Plain] = field(default_factory=dict)

    def index(self) -> None:
        for s in self.storages:
            self._owner[id(s.param)] = s
        for p in self.plains:
            self._owner[id(p.param)] = p

    def owner(self, p: torch.Tensor) -> _Storage | _Plain:
        try:
            return self._owner[id(p)]
        except KeyError:
            raise ConfigError(
                f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not part of "
                "the model passed to ckptd; build the optimizer over model.parameters() of the "
                "fairscale FSDP model"
            ) from None


def _optim_fqns(o: _Storage | _Plain) -> list[str]:
    return [v.fqn for v in o.views] if isinstance(o, _Storage) else o.fqns[:1]


def _flat_views(views: Sequence[_View], prefix: str, suffix: str, dtype: torch.dtype) -> list:
    return [FlatView(f"{prefix}{v.fqn}{suffix}", v.shape, dtype, v.start) for v in views]


# --------------------------------------------------------------------------- collection


def _collect(model: torch.nn.Module, with_tensors: bool) -> _Layout:
    """Walk ``model``: every FSDP subtree via fairscale's metadata, the rest as plain."""
    fsdp_cls = _fsdp_class()
    if fsdp_cls is None:
        raise ConfigError("fairscale is not imported; this model is not a fairscale FSDP model")
    job_world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    layout = _Layout()
    plain_by_id: dict[int, _Plain] = {}

    def walk(mod: torch.nn.Module, prefix: str) -> None:
        if isinstance(mod, fsdp_cls):
            _collect_fsdp(mod, prefix, fsdp_cls, job_world, with_tensors, layout)
            return
        for name, p in mod._parameters.items():
            if p is None:
                continue
            fqn = _clean(_join(prefix, name))
            if id(p) in plain_by_id:
                plain_by_id[id(p)].fqns.append(fqn)
            else:
                plain_by_id[id(p)] = _Plain(p, [fqn])
                layout.plains.append(plain_by_id[id(p)])
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                layout.buffers.append(_Buffer(_clean(_join(prefix, name)), mod, name, b.dtype, b))
        for name, child in mod._modules.items():
            if child is not None:
                walk(child, _join(prefix, name))

    walk(model, "")
    layout.index()
    return layout


def _collect_fsdp(
    top: Any,
    prefix: str,
    fsdp_cls: type,
    job_world: int,
    with_tensors: bool,
    layout: _Layout,
) -> None:
    """Add the storages and buffers of the FSDP tree rooted at ``top``."""
    prefix = _clean(prefix)
    if not with_tensors:
        # local_state_dict (save) and the first forward run fairscale's lazy init, which
        # casts floating buffers to each instance's buffer_dtype; a fresh model loading a
        # checkpoint must present the same dtypes (a float64 or bf16 buffer was saved as
        # float32), so run it here too.
        top._lazy_init()
    meta = top.local_metadata_dict()
    sd = top.local_state_dict() if with_tensors else {}
    instances = [m for _, m in top.named_modules() if isinstance(m, fsdp_cls)]
    if len(instances) != len(meta["param_metadata"]):
        raise ConfigError(
            f"fairscale metadata lists {len(meta['param_metadata'])} FSDP instances under "
            f"{prefix or 'the root'!r} but the module tree has {len(instances)}"
        )
    layout.instances.extend(instances)
    for m, info in zip(instances, meta["param_metadata"]):
        path = info["fsdp_path"]
        entries = list(info["params"].items())
        params = list(m.params)[: len(entries)]
        shared = [
            (_join(prefix, path, s), _join(prefix, path, d)) for s, d in info["shared_param_info"]
        ]
        storages: list[_Storage] = []
        for i, ((backing, pinfo), p) in enumerate(zip(entries, params)):
            flat = i < int(m._num_flatten_params)
            storages.append(_storage(m, p, prefix, path, backing, pinfo, flat, job_world, sd))
        for src, dst in shared:
            for s in storages:
                for v in s.views:
                    if v.fqn == src:
                        s.aliases.append(_View(dst, v.shape, v.start))
        layout.storages.extend(storages)

    # Tied parameters that fairscale did not flatten: one Parameter under several names.
    nonflat = {id(s.param): s for s in layout.storages if not s.flat_param}
    for mod_name, mod in top.named_modules(remove_duplicate=False):
        for n, p in mod._parameters.items():
            s = nonflat.get(id(p)) if p is not None else None
            fqn = _join(prefix, _clean(_join(mod_name, n)))
            if s is not None and fqn != s.views[0].fqn and all(a.fqn != fqn for a in s.aliases):
                s.aliases.append(_View(fqn, s.views[0].shape, 0))

    # Buffers (persistent ones, as in state_dict); fairscale's state_dict returns floating
    # buffers in float32 under mixed precision, so that is their logical dtype.
    for mod_name, mod in top.named_modules():
        if isinstance(mod, fsdp_cls):
            continue
        for name, b in mod._buffers.items():
            if b is None or name in mod._non_persistent_buffers_set:
                continue
            rel = _clean(_join(mod_name, name))
            saved = sd.get(rel) if with_tensors else None
            if saved is None and with_tensors:
                saved = b
            dtype = b.dtype
            if top.mixed_precision and b.is_floating_point():
                dtype = torch.float32
            if saved is not None and saved.dtype != dtype:
                saved = saved.to(dtype)
            layout.buffers.append(_Buffer(_join(prefix, rel), mod, name, dtype, saved))


def _storage(
    m: Any,
    p: torch.nn.Parameter,
    prefix: str,
    path: str,
    backing: str,
    pinfo: Mapping[str, Any],
    flat_param: bool,
    job_world: int,
    sd: Mapping[str, torch.Tensor],
) -> _Storage:
    names = [_join(prefix, path, n) for n in pinfo["names"]]
    shapes = [tuple(int(d) for d in s) for s in pinfo["shapes"]]
    numels = [int(n) for n in pinfo["numels"]]
    views = []
    start = 0
    for n, shape, k in zip(names, shapes, numels):
        if math.prod(shape) != k:
            raise ConfigError(f"fairscale metadata of {n!r}: shape {shape} but numel {k}")
        views.append(_View(n, shape, start))
        start += k
    total = start
    world, rank = int(m.world_size), int(m.rank)
    key = _join(prefix, path, backing)
    if p._is_sharded:
        shard_len = p.data.numel()
        if total > 0 and shard_len != dim0_chunk_len(total, world):
            raise ConfigError(
                f"fairscale shard of {key!r} has {shard_len} elements; expected "
                f"ceil({total}/{world}) = {dim0_chunk_len(total, world)} (torch.chunk sharding)"
            )
        region = dim0_shard((total,), world, rank)
        padding = shard_len - region.shape[0]
        if padding != int(pinfo["padding"]):
            raise ConfigError(
                f"fairscale shard of {key!r} on rank {rank}: expected {padding} padding "
                f"elements, metadata says {pinfo['padding']}"
            )
    else:
        shard_len = total
        region = Region.full((total,))
        if p.data.numel() != total:
            raise ConfigError(f"unsharded fairscale parameter {key!r}: {p.data.numel()} != {total}")
    saved = sd.get(_join(path, backing)) if sd else None
    return _Storage(
        key=key,
        param=p,
        numel=total,
        shard_len=shard_len,
        region=region,
        views=views,
        aliases=[],
        replicated=world == 1 and job_world > 1,
        instance=m,
        flat_param=flat_param,
        saved=saved,
    )


def _assign_writers(layout: _Layout, job_world: int) -> None:
    """Pick one writing replica for instances sharded over a strict subgroup of the job.

    Each rank holds its subgroup's shard; among the subgroups of one instance the one with
    the lowest global rank writes.  Collective over the default group (same call order on
    every rank, since every rank has the same module tree).
    """
    partial = [m for m in layout.instances if 1 < int(m.world_size) < job_world]
    if not partial:
        return
    # the subgroups of one instance are disjoint: the leader holds the lowest global rank
    lowest = [min(dist.get_process_group_ranks(m.process_group)) for m in partial]
    gathered = all_gather_ints(lowest)
    writers: dict[int, bool] = {}
    for j, m in enumerate(partial):
        writers[id(m)] = lowest[j] == min(g[j] for g in gathered)
    for s in layout.storages:
        if id(s.instance) in writers:
            s.writer = writers[id(s.instance)]


def _check_replicas(layout: _Layout, job_world: int) -> None:
    """Fail if a one-rank FSDP instance of a multi-rank job holds other values on some rank.

    Such storages are saved once, as replicas (one rank writes them); per-rank parameters
    (e.g. MoE experts each in its own one-rank process group) would silently keep only
    that rank's values.  Collective over the default group whenever the module tree has
    such an instance (the same on every rank).
    """
    reps = [s for s in layout.storages if s.replicated]
    if not reps:
        return
    mine = []
    for s in reps:
        t = s.valid(s.saved if s.saved is not None else s.param.detach())
        mine.append(crc32c(t.detach().cpu().contiguous().view(torch.uint8).numpy()))
    gathered = all_gather_ints(mine)
    for j, s in enumerate(reps):
        differ = [r for r, g in enumerate(gathered) if g[j] != gathered[0][j]]
        if differ:
            names = ", ".join(v.fqn for v in s.views)
            raise ConfigError(
                f"fairscale parameters {names} (FSDP instance of one rank, {s.key!r}) differ "
                f"between rank 0 and ranks {differ}: ckptd saves what fairscale does not shard "
                "once, as a replica, so it expects the same values on every rank. Per-rank "
                "parameters (e.g. MoE experts in one-rank process groups) cannot be saved this "
                "way; shard them over a process group of several ranks, or keep them equal"
            )


# --------------------------------------------------------------------------- helpers


def _describe(o: _Storage | _Plain) -> str:
    """A parameter as the user knows it; a flat parameter by the parameters it holds."""
    if isinstance(o, _Storage) and o.flat_param:
        names = ", ".join(v.fqn for v in o.views)
        return f"fairscale flat parameter {o.key!r} (holding {names}; local shard)"
    return repr(_optim_fqns(o)[0])


def _scalar_tensor(key: str, v: Any, owner: str = "") -> torch.Tensor:
    if isinstance(v, torch.Tensor):
        return v
    if isinstance(v, bool):
        return torch.tensor(v, dtype=torch.bool)
    if isinstance(v, int):
        return torch.tensor(v, dtype=torch.int64)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float64)
    of = f" of {owner}" if owner else ""
    raise ConfigError(
        f"optimizer state {key!r}{of} is a {type(v).__name__}; expected a tensor or a python "
        "number (bool, int, float), the only state ckptd stores. Keep such values outside the "
        "optimizer state (e.g. in save's extra=)"
    )


def _optim_index(available: Mapping[str, TensorMeta]) -> dict[str, dict[str, TensorMeta]]:
    """``optim/<fqn>/<key>`` entries of the checkpoint as fqn -> key -> meta (the key is
    after the last ``/``: a module name, e.g. a ModuleDict key, may hold one)."""
    index: dict[str, dict[str, TensorMeta]] = {}
    for name, meta in available.items():
        if name.startswith("optim/"):
            fqn, sep, key = name[len("optim/") :].rpartition("/")
            if sep:
                index.setdefault(fqn, {})[key] = meta
    return index


def _state_keys(
    index: Mapping[str, Mapping[str, TensorMeta]], fqns: Sequence[str]
) -> dict[str, tuple[str, TensorMeta]]:
    """State key -> (first of ``fqns`` that has it in the checkpoint, its meta)."""
    keys: dict[str, tuple[str, TensorMeta]] = {}
    for fqn in fqns:
        for key, meta in index.get(fqn, {}).items():
            keys.setdefault(key, (fqn, meta))
    return keys


def _group_params(optimizer: torch.optim.Optimizer) -> Iterator[tuple[int, torch.Tensor]]:
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            yield gi, p


# --------------------------------------------------------------------------- adapter


class FairscaleAdapter(FrameworkAdapter):
    """fairscale ``FullyShardedDataParallel`` (nested, flat or not) and its optimizer."""

    framework = "fairscale"

    @classmethod
    def matches(cls, model: torch.nn.Module) -> bool:
        fsdp_cls = _fsdp_class()
        if fsdp_cls is None:
            return False
        return isinstance(model, fsdp_cls) or any(isinstance(m, fsdp_cls) for m in model.modules())

    # ----------------------------------------------------------------------- save

    def save_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> SaveState:
        layout = _collect(model, with_tensors=True)
        job_world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        _assign_writers(layout, job_world)
        _check_replicas(layout, job_world)
        items: list[SaveItem] = []
        for s in layout.storages:
            shard = s.saved if s.saved is not None else s.param.detach()
            dtype = shard.dtype
            items.append(
                SaveItem(
                    name=f"flat/model/{s.key}",
                    global_shape=(s.numel,),
                    dtype=dtype,
                    local=s.valid(shard),
                    region=s.region,
                    replicated=s.replicated,
                    writer=s.writer,
                    chunk_shape=s.chunk_shape(),
                    logical=False,
                    views=_flat_views(s.views + s.aliases, "model/", "", dtype),
                )
            )
        for pl in layout.plains:
            t = pl.param.detach()
            for fqn in pl.fqns:
                items.append(
                    SaveItem(f"model/{fqn}", tuple(t.shape), t.dtype, t, Region.full(t.shape), True)
                )
        for b in layout.buffers:
            assert b.saved is not None
            t = b.saved.detach()
            items.append(
                SaveItem(f"model/{b.fqn}", tuple(t.shape), t.dtype, t, Region.full(t.shape), True)
            )

        param_groups: list[dict[str, Any]] = []
        if optimizer is not None:
            items.extend(self._save_optim(layout, optimizer))
            groups = optimizer.param_groups
            param_groups = json_param_groups(
                [{k: v for k, v in g.items() if k != "params"} for g in groups]
            )
            for pg, group in zip(param_groups, groups):
                pg["params"] = [f for p in group["params"] for f in _optim_fqns(layout.owner(p))]
        return SaveState(items=items, param_groups=param_groups)

    def _save_optim(self, layout: _Layout, optimizer: torch.optim.Optimizer) -> list[SaveItem]:
        items: list[SaveItem] = []
        for _, p in _group_params(optimizer):
            owner = layout.owner(p)
            state = optimizer.state.get(p)
            if not state:
                continue
            fqns = _optim_fqns(owner)
            for key, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    if tuple(v.shape) != tuple(p.shape):
                        raise ConfigError(
                            f"optimizer state {key!r} of {_describe(owner)} has shape "
                            f"{tuple(v.shape)}; expected the parameter's {tuple(p.shape)} "
                            "(per-element state) or a scalar. ckptd cannot map other shapes "
                            "(e.g. factored second moments) onto the model's tensors; use an "
                            "optimizer whose state has the parameter's shape"
                        )
                    v = v.detach()
                    if isinstance(owner, _Storage):
                        items.append(
                            SaveItem(
                                name=f"flat/optim/{owner.key}/{key}",
                                global_shape=(owner.numel,),
                                dtype=v.dtype,
                                local=owner.valid(v),
                                region=owner.region,
                                replicated=owner.replicated,
                                writer=owner.writer,
                                chunk_shape=owner.chunk_shape(),
                                logical=False,
                                views=_flat_views(owner.views, "optim/", f"/{key}", v.dtype),
                            )
                        )
                    else:
                        items.append(
                            SaveItem(
                                f"optim/{fqns[0]}/{key}", tuple(v.shape), v.dtype, v,
                                Region.full(v.shape), True,
                            )
                        )
                else:
                    t = _scalar_tensor(key, v, _describe(owner)).detach()
                    for fqn in fqns:
                        items.append(SaveItem(f"optim/{fqn}/{key}", (), t.dtype, t, _SCALAR, True))
        return items

    # ----------------------------------------------------------------------- load

    def load_plan(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        available: Mapping[str, TensorMeta],
    ) -> LoadPlan:
        layout = _collect(model, with_tensors=False)
        targets: list[LoadTarget] = []
        model_names: dict[str, TensorMeta] = {}

        for s in layout.storages:
            p = s.param
            data = s.flat(p.data)
            a, n = s.region.offsets[0], s.region.shape[0]
            for v in s.views + s.aliases:
                model_names[f"model/{v.fqn}"] = TensorMeta(v.shape, p.dtype)
            for v in s.views:
                lo, hi = max(a, v.start), min(a + n, v.start + v.numel)
                if hi > lo:
                    targets.append(
                        LoadTarget(
                            name=f"model/{v.fqn}",
                            global_shape=v.shape,
                            dtype=p.dtype,
                            out=data[lo - a : hi - a],
                            flat_range=(lo - v.start, hi - v.start),
                        )
                    )
        for pl in layout.plains:
            shape = tuple(pl.param.shape)
            for fqn in pl.fqns:
                model_names[f"model/{fqn}"] = TensorMeta(shape, pl.param.dtype)
            targets.append(
                LoadTarget(
                    f"model/{pl.fqns[0]}", shape, pl.param.dtype, pl.param.data,
                    region=Region.full(shape),
                )
            )
        copies: list[tuple[_Buffer, torch.Tensor]] = []
        for b in layout.buffers:
            live = getattr(b.module, b.attr)
            shape = tuple(live.shape)
            model_names[f"model/{b.fqn}"] = TensorMeta(shape, b.dtype)
            out = live
            if live.dtype != b.dtype:
                out = torch.empty(shape, dtype=b.dtype, device=live.device)
                copies.append((b, out))
            targets.append(
                LoadTarget(f"model/{b.fqn}", shape, b.dtype, out, region=Region.full(shape))
            )

        optim_names: dict[str, TensorMeta] = {}
        new_state: dict[int, dict[str, Any]] = {}
        group_params: list[list[str]] | None = None
        if optimizer is not None:
            new_state = self._plan_optim(layout, optimizer, available, targets, optim_names)
            group_params = [[f for p in g["params"] for f in _optim_fqns(layout.owner(p))]
                            for g in optimizer.param_groups]

        def finish(param_groups: list[dict[str, Any]] | None) -> None:
            with torch.no_grad():
                for b, tmp in copies:
                    getattr(b.module, b.attr).copy_(tmp)
            for m in layout.instances:
                # Full parameters gathered before the load are stale (fairscale's own
                # load_local_state_dict frees them too); only reachable on CUDA.
                if getattr(m, "has_full_params", False):
                    m._free_full_params()
            if optimizer is not None:
                self._install_optim(layout, optimizer, new_state, param_groups)

        return LoadPlan(targets, model_names, optim_names, finish, group_params)

    def _plan_optim(
        self,
        layout: _Layout,
        optimizer: torch.optim.Optimizer,
        available: Mapping[str, TensorMeta],
        targets: list[LoadTarget],
        optim_names: dict[str, TensorMeta],
    ) -> dict[int, dict[str, Any]]:
        """Targets for every optimizer state tensor; returns the state to install."""
        new_state: dict[int, dict[str, Any]] = {}
        index = _optim_index(available)
        # Keys the optimizer keeps per element (some parameter has them with its own shape):
        # in a flat parameter, the view of a 0-d parameter (a learnable scale) has shape ()
        # for these keys too, and must not make the whole flat state a scalar.
        per_element = {k for keys in index.values() for k, m in keys.items() if m.shape}
        for _, p in _group_params(optimizer):
            owner = layout.owner(p)
            fqns = _optim_fqns(owner)
            existing = optimizer.state.get(p) or {}
            saved_keys = _state_keys(index, fqns)
            keys = list(saved_keys) + [k for k in existing if k not in saved_keys]
            if not keys:
                continue
            state: dict[str, Any] = {}
            for key in keys:
                src, meta = saved_keys.get(key, ("", None))
                cur = existing.get(key)
                if meta is None:
                    # Not in the checkpoint: keep what the optimizer has (the caller reports
                    # it as missing unless it loads non-strictly).
                    state[key] = cur
                    c = _scalar_tensor(key, cur) if not isinstance(cur, torch.Tensor) else cur
                    for fqn in fqns:
                        shape = self._logical_shape(owner, fqn) if c.dim() > 0 else ()
                        optim_names[f"optim/{fqn}/{key}"] = TensorMeta(shape, c.dtype)
                    continue
                if len(meta.shape) > 0 or (isinstance(owner, _Storage) and key in per_element):
                    dtype = meta.dtype
                    if p.is_floating_point() and dtype.is_floating_point:
                        dtype = p.dtype  # torch casts floating state to the param's dtype
                    for fqn in fqns:
                        shape = self._logical_shape(owner, fqn)
                        optim_names[f"optim/{fqn}/{key}"] = TensorMeta(shape, dtype)
                    if (
                        isinstance(cur, torch.Tensor)
                        and cur.shape == p.shape
                        and cur.dtype == dtype
                        and cur.device == p.device
                        and cur.is_contiguous()
                    ):
                        out = cur
                    else:
                        out = torch.zeros(p.shape, dtype=dtype, device=p.device)
                    state[key] = out
                    targets.extend(self._vector_targets(owner, key, out, dtype))
                else:
                    dtype = meta.dtype
                    for fqn in fqns:
                        optim_names[f"optim/{fqn}/{key}"] = TensorMeta((), dtype)
                    out = torch.zeros((), dtype=dtype)
                    state[key] = _ScalarSlot(out, cur, key)
                    targets.append(LoadTarget(f"optim/{src}/{key}", (), dtype, out, region=_SCALAR))
            new_state[id(p)] = state
        return new_state

    @staticmethod
    def _logical_shape(owner: _Storage | _Plain, fqn: str) -> Shape:
        if isinstance(owner, _Plain):
            return tuple(owner.param.shape)
        return next(v.shape for v in owner.views if v.fqn == fqn)

    @staticmethod
    def _vector_targets(
        owner: _Storage | _Plain, key: str, out: torch.Tensor, dtype: torch.dtype
    ) -> list[LoadTarget]:
        if isinstance(owner, _Plain):
            shape = tuple(out.shape)
            name = f"optim/{owner.fqns[0]}/{key}"
            return [LoadTarget(name, shape, dtype, out, Region.full(shape))]
        flat = owner.flat(out)
        a, n = owner.region.offsets[0], owner.region.shape[0]
        res = []
        for v in owner.views:
            lo, hi = max(a, v.start), min(a + n, v.start + v.numel)
            if hi > lo:
                res.append(
                    LoadTarget(
                        f"optim/{v.fqn}/{key}", v.shape, dtype, flat[lo - a : hi - a],
                        flat_range=(lo - v.start, hi - v.start),
                    )
                )
        return res

    def _install_optim(
        self,
        layout: _Layout,
        optimizer: torch.optim.Optimizer,
        new_state: dict[int, dict[str, Any]],
        param_groups: list[dict[str, Any]] | None,
    ) -> None:
        # ``param_groups`` were matched to the live groups by their parameters (and checked)
        # by the caller before anything was read.
        state: dict[int, dict[str, Any]] = {}
        for idx, (_, p) in enumerate(_group_params(optimizer)):
            st = new_state.get(id(p))
            if st:
                state[idx] = {
                    k: v.value() if isinstance(v, _ScalarSlot) else v for k, v in st.items()
                }
        # torch's own loader: state on the parameter's device and dtype by torch's policy
        # (``step`` kept as is unless capturable/fused).
        groups = optimizer.state_dict()["param_groups"]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        apply_hyperparameters(optimizer.param_groups, param_groups)


@dataclass(slots=True)
class _ScalarSlot:
    """A 0-d state value being loaded, and what the optimizer held before (if anything)."""

    out: torch.Tensor
    current: Any
    key: str

    def value(self) -> Any:
        cur = self.current
        if isinstance(cur, torch.Tensor):
            return self.out.to(dtype=cur.dtype, device=cur.device)
        if isinstance(cur, (bool, int, float)):
            return type(cur)(self.out.item())
        # Fresh optimizer: torch keeps ``step`` as a tensor; other float64/int64/bool 0-d
        # entries were python numbers when saved.
        if self.key != "step" and self.out.dtype in (torch.float64, torch.int64, torch.bool):
            return self.out.item()
        if self.key == "step" and not self.out.dtype.is_floating_point:
            # torch keeps ``step`` in its scalar dtype (float32 unless the default is float64)
            default = torch.get_default_dtype()
            return self.out.to(torch.float64 if default == torch.float64 else torch.float32)
        return self.out
