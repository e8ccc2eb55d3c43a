"""CheckpointClient: save_async / load / list_steps for FSDP training.

Threads: every public method is called from the training thread.  ``save_async`` extracts
the local shards (on every rank at the same point: adapters may run collectives), copies
them into the staging buffer, hands the buffer to the transport and returns a
:class:`SaveHandle`.  The transport writes in the background (a writer thread in embedded
mode, the node's daemon otherwise) and runs the commit protocol.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ckptd.errors import (
    BackpressureError,
    CkptdError,
    ConfigError,
    CorruptCheckpointError,
    StateMismatchError,
)
from ckptd.format import paths
from ckptd.format.commit import list_steps as _list_steps
from ckptd.format.commit import read_index, resolve_step
from ckptd.format.dtypes import SUPPORTED, dtype_from_name, dtype_name
from ckptd.format.items import LoadTarget, SaveItem
from ckptd.format.layout import Region
from ckptd.format.plan import DEFAULT_PACK_THRESHOLD, RankPlan, plan_rank_save
from ckptd.format.reader import CheckpointReader
from ckptd.format.writer import SaveIdentity
from ckptd_client import extra as extra_state
from ckptd_client.adapters import TensorMeta, adapter_for
from ckptd_client.collectives import all_gather_ints, broadcast_str, min_over_ranks
from ckptd_client.staging import ready_event, stage
from ckptd_client.transport.base import Lease, Transport

log = logging.getLogger("ckptd.client")

BACKPRESSURE_POLICIES = ("block", "skip", "error")
EXTRA_PREFIX = "_extra/"


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed (or loaded) checkpoint."""

    job: str
    step: int
    attempt: str
    world_size: int
    framework: str
    storage: str
    nbytes: int = 0
    extra: Any = None
    missing_keys: tuple[str, ...] = ()
    unexpected_keys: tuple[str, ...] = ()
    skipped: bool = False


class SaveHandle:
    """The future of one save.

    ``wait_staged()`` returns once the bytes are staged and handed over (parameters may
    change); ``result(timeout)`` once the step is committed (or raises the save's error);
    ``done()`` says whether it has finished either way.  None of these starts work.
    """

    def __init__(self, step: int, staged: Future, committed: Future) -> None:
        self.step = step
        self._staged = staged
        self._committed = committed

    def wait_staged(self, timeout: float | None = None) -> None:
        self._staged.result(timeout)

    def done(self) -> bool:
        return self._committed.done()

    def result(self, timeout: float | None = None) -> CheckpointInfo:
        return self._committed.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._committed.exception(timeout)

    def add_done_callback(self, fn: Any) -> None:
        self._committed.add_done_callback(lambda _f: fn(self))


def _done_future(value: Any = None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


#: what a rank contributes to the ranks' agreement on a save (skip/error backpressure)
_FAILED, _NO_ROOM, _READY = 0, 1, 2


@dataclass
class _Counters:
    saves: int = 0
    skipped: int = 0
    failed: int = 0
    last_error: BaseException | None = None
    seq: int = 0
    next_step: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class CheckpointClient:
    """Save and load sharded training state.

    Exactly one of ``storage`` (embedded mode: this process writes, e.g.
    ``"file:///ckpt"`` or ``"s3://bucket/prefix"``) or ``daemon`` (``"unix:///run/ckptd/
    ckptd.sock"``; the node's ``ckptd serve`` writes) must be given; ``CKPTD_STORAGE`` /
    ``CKPTD_DAEMON`` are used when both are None.  Create it on every rank at the same point
    (rank 0 broadcasts the launch's attempt id).
    """

    def __init__(
        self,
        job: str,
        storage: str | None = None,
        daemon: str | None = None,
        *,
        process_group: Any = None,
        storage_options: Mapping[str, Any] | None = None,
        pack_threshold: int = DEFAULT_PACK_THRESHOLD,
        write_concurrency: int = 8,
        commit_timeout: float | None = 1800.0,
        backpressure: str = "block",
        token: str | None = None,
    ) -> None:
        self.job = paths.check_job(job)
        if storage is None and daemon is None:
            storage = os.environ.get("CKPTD_STORAGE") or None
            daemon = os.environ.get("CKPTD_DAEMON") or None
        if (storage is None) == (daemon is None):
            raise ConfigError(
                "CheckpointClient needs exactly one of storage=URI (embedded mode, e.g. "
                "'file:///ckpt') or daemon=ADDRESS (e.g. 'unix:///run/ckptd/ckptd.sock'); got "
                f"storage={storage!r}, daemon={daemon!r}"
            )
        if backpressure not in BACKPRESSURE_POLICIES:
            raise ConfigError(
                f"backpressure must be one of {BACKPRESSURE_POLICIES}, got {backpressure!r}"
            )
        self.group = process_group
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
        else:
            self.rank, self.world_size = 0, 1
        self.pack_threshold = pack_threshold
        self.backpressure = backpressure
        self._counters = _Counters()
        launch = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
        self.launch_id = broadcast_str(launch, process_group)
        self._transport: Transport
        if storage is not None:
            from ckptd_client.transport.embedded import EmbeddedTransport

            self._transport = EmbeddedTransport(
                storage, storage_options=dict(storage_options or {}),
                write_concurrency=write_concurrency, commit_timeout=commit_timeout)
        else:
            from ckptd_client.transport.daemon import DaemonTransport

            self._transport = DaemonTransport(
                daemon, job=self.job, rank=self.rank, world_size=self.world_size,  # type: ignore[arg-type]
                token=token, commit_timeout=commit_timeout)
        if self.world_size > 1:
            self._check_same_storage()
        self._inflight: list[SaveHandle] = []
        self._closed = False
        self._adapter_for: tuple[torch.nn.Module, Any] | None = None
        self._last_plan: tuple[tuple, RankPlan] | None = None
        # overlap mode's copies run here: one thread, started with the first overlapped save
        # and reused, so save_async only queues the work (a new Thread's start() waits until
        # that thread runs -- milliseconds on busy cores -- and the copy then competes with
        # the caller for the GIL before save_async has returned)
        self._stager: ThreadPoolExecutor | None = None
        #: seconds spent in each phase of the last ``save_async`` call (copy mode: collect,
        #: plan, acquire, stage, submit; the transport may add its own sub-phases)
        self.last_phases: dict[str, float] = {}
        _OPEN_CLIENTS.add(self)

    def _check_same_storage(self) -> None:
        """Every rank must write where the others do (a daemon started with another
        --storage on one node): otherwise no save could ever commit, and each would fail
        only at its commit timeout, naming missing rank manifests.  Local paths are compared
        by scheme only: a shared filesystem may be mounted at another path on some nodes."""
        url = self._transport.url
        key = "file" if url.startswith("file:") else url
        mine = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big", signed=True)
        hashes = [h[0] for h in all_gather_ints([mine], self.group)]
        if len(set(hashes)) == 1:
            return
        first = broadcast_str(url, self.group)
        other = [r for r, h in enumerate(hashes) if h != hashes[0]]
        self._transport.close()
        raise ConfigError(
            f"the ranks of job {self.job!r} write to different storage: rank 0 to {first!r}, "
            f"ranks {other} elsewhere (this rank, {self.rank}: {url!r}), so no checkpoint "
            "could commit. Give every node's daemon the same --storage (CKPTD_STORAGE), or "
            "every embedded client the same storage=.")

    def _check_world(self, what: str, *, saving: bool) -> None:
        """A client that runs as the only rank while the job has more: every rank would save
        a world-size-1 checkpoint of the same step, each replacing the others' (the shards of
        all but one rank silently lost)."""
        if self.world_size != 1 or self.group is not None:
            return
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(
                f"{what}: this CheckpointClient (job {self.job!r}) was created before "
                "torch.distributed.init_process_group(), so it runs as the only rank, but the "
                f"process group now has {dist.get_world_size()} ranks. Create the "
                "CheckpointClient after init_process_group(), on every rank.")
        env_world = os.environ.get("WORLD_SIZE", "1").strip() or "1"
        if saving and env_world.isdigit() and int(env_world) > 1 and not (
                dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"{what}: WORLD_SIZE={env_world} is set (a launcher such as torchrun started "
                f"{env_world} processes) but no torch.distributed process group is "
                "initialized, so each process would save as the only rank of a world-size-1 "
                "job and overwrite the others' checkpoint. Call "
                "torch.distributed.init_process_group() before creating the CheckpointClient "
                "(or unset WORLD_SIZE if this process really is alone).")

    # -- saving --------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        c = self._counters
        return {"saves": c.saves, "skipped": c.skipped, "failed": c.failed}

    def _next_attempt(self) -> str:
        with self._counters.lock:
            self._counters.seq += 1
            return f"{self.launch_id}.{self._counters.seq}"

    def _adapter(self, model: torch.nn.Module) -> Any:
        """One adapter per model, kept across saves (adapters cache where state lives)."""
        if self._adapter_for is None or self._adapter_for[0] is not model:
            self._adapter_for = (model, adapter_for(model))
        return self._adapter_for[1]

    def _plan(self, items: list[SaveItem]) -> RankPlan:
        """Plan the save; reuse the previous plan when the layout is unchanged (the usual
        case: the same model saved every N steps), which keeps planning off the stall."""
        key = (self.rank, self.world_size, self.pack_threshold, tuple(
            (it.name, it.global_shape, it.dtype, it.region, it.replicated, it.writer,
             it.chunk_shape, it.logical, tuple(it.views), tuple(it.local.shape))
            for it in items))
        if self._last_plan is not None and self._last_plan[0] == key:
            return self._last_plan[1]
        plan = plan_rank_save(items, self.rank, self.world_size, self.pack_threshold)
        self._last_plan = (key, plan)
        return plan

    def _collect(self, model: torch.nn.Module, optimizer: Any, extra: Any) -> tuple[
            list[SaveItem], list[dict], Any, str]:
        adapter = self._adapter(model)
        state = adapter.save_state(model, optimizer)
        tensors: list[torch.Tensor] = []
        doc = {
            "user": extra_state.encode(extra, tensors, "extra") if extra is not None else None,
            "rng": extra_state.encode(extra_state.capture_rng(), tensors, "rng"),
        }
        items = list(state.items)
        for i, t in enumerate(tensors):
            t = t.detach().contiguous()
            items.append(SaveItem(f"{EXTRA_PREFIX}{self.rank}/{i}", tuple(t.shape), t.dtype, t,
                                  Region.full(t.shape)))
        return items, state.param_groups, doc, adapter.framework

    def save_async(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | None = None,
        extra: Any = None,
        *,
        overlap: bool = False,
    ) -> SaveHandle:
        """Start saving ``model`` (and ``optimizer``, ``extra``) as ``step``.

        Copy mode (default): returns once the state is staged and handed over, so training
        may change the parameters.  ``overlap=True``: returns at once; the copy runs in the
        background and the optimizer's next ``step()`` waits for it (a pre-step hook), so
        no update can change a tensor before it is staged.
        """
        if self._closed:
            raise ConfigError(
                f"save_async(step={step}) on a closed CheckpointClient (job {self.job!r}): "
                "close() or the end of its `with` block released its writer. Keep the client "
                "open for the whole training loop, or create a new one."
            )
        self._check_world(f"save_async(step={step})", saving=True)
        if step is None:
            step = self._counters.next_step
        step = paths.check_step(step)
        self._counters.next_step = step + 1
        self._counters.saves += 1
        phases = self.last_phases = {}
        t0 = time.perf_counter()
        # counted before anything can fail, so that the ranks' attempt names stay in step
        # when one rank's save fails here and another's does not
        attempt = self._next_attempt()
        try:
            items, groups, doc, framework = self._collect(model, optimizer, extra)
            _check_not_meta(items, step)
            t1 = time.perf_counter()
            try:
                plan = self._plan(items)
            except TypeError:
                _check_dtypes(items, step)  # names the tensors ckptd cannot store
                raise
        except Exception as exc:
            self._abandon(step, attempt, exc)
            raise
        t2 = time.perf_counter()
        phases["collect"], phases["plan"] = t1 - t0, t2 - t1
        ident = SaveIdentity(self.job, step, attempt, self.rank, self.world_size, framework)
        try:
            lease = self._acquire(plan.nbytes)
        except Exception as exc:  # e.g. the node's daemon is restarting: the others' step
            self._transport.abandon(ident, f"{type(exc).__name__}: {exc}")  # cannot commit
            raise
        phases["acquire"] = time.perf_counter() - t2
        if isinstance(lease, str):  # skipped, and why
            self._counters.skipped += 1
            log.warning("ckptd: skipped save of step %d: %s; %d skipped so far", step, lease,
                        self._counters.skipped)
            info = CheckpointInfo(self.job, step, ident.attempt, self.world_size, framework,
                                  self._transport.url, skipped=True)
            return SaveHandle(step, _done_future(), _done_future(info))

        ready = ready_event(items)  # CUDA: the values as of this call

        def do_stage() -> None:
            try:
                stage(plan, items, lease.buffer, ready)
            except BaseException:
                lease.release()
                raise

        if not overlap:
            t3 = time.perf_counter()
            do_stage()
            t4 = time.perf_counter()
            committed = self._transport.submit(ident, plan, lease, doc, groups)
            t5 = time.perf_counter()
            phases["stage"], phases["submit"] = t4 - t3, t5 - t4
            phases.update(getattr(self._transport, "last_phases", {}))
            if log.isEnabledFor(logging.DEBUG):
                log.debug("save_async step %d (copy mode): %s", step, ", ".join(
                    f"{k} {v * 1e3:.1f} ms" for k, v in phases.items()))
            handle = SaveHandle(step, _done_future(), committed)
        else:
            staged: Future = Future()
            committed_f: Future = Future()

            def background() -> None:
                try:
                    do_stage()
                except BaseException as exc:  # noqa: BLE001 - delivered through the handle
                    staged.set_exception(exc)
                    committed_f.set_exception(exc)
                    return
                try:  # staged = copied *and* handed over (the daemon acknowledged it)
                    inner = self._transport.submit(ident, plan, lease, doc, groups)
                except BaseException as exc:  # noqa: BLE001 - delivered through the handle
                    staged.set_result(None)
                    committed_f.set_exception(exc)
                    return
                staged.set_result(None)
                inner.add_done_callback(lambda f: _chain(f, committed_f))

            if self._stager is None:
                self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-stage")
            self._stager.submit(background)
            handle = SaveHandle(step, staged, committed_f)
            if optimizer is not None:
                self._hook_optimizer(optimizer, handle)
        handle.add_done_callback(self._count_failure)
        self._inflight = [h for h in self._inflight if not h.done()] + [handle]
        return handle

    def _abandon(self, step: int, attempt: str, exc: Exception) -> None:
        """This rank's part of a save failed before it was handed over, so the attempt can
        never commit: let the other ranks know instead of waiting (a ConfigError about a
        tensor only some ranks hold, e.g. a DTensor's local shard)."""
        if self.world_size <= 1:
            return
        if self.backpressure != "block":
            min_over_ranks(_FAILED, self.group)  # the others are in _acquire's
        self._transport.abandon(
            SaveIdentity(self.job, step, attempt, self.rank, self.world_size, "unknown"),
            f"{type(exc).__name__}: {exc}")

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
             step: int | None = None, extra: Any = None,
             timeout: float | None = None) -> CheckpointInfo:
        """``save_async(...).result(timeout)``."""
        return self.save_async(model, optimizer, step, extra).result(timeout)

    def _count_failure(self, handle: SaveHandle) -> None:
        exc = handle.exception()
        if exc is not None:
            self._counters.failed += 1
            self._counters.last_error = exc

    def _acquire(self, nbytes: int) -> Lease | str:
        """A lease for ``nbytes``, or why this step is skipped."""
        together = self.backpressure != "block" and self.world_size > 1
        try:
            lease = self._transport.acquire(nbytes, block=False)
        except BaseException:
            if together:
                min_over_ranks(_FAILED, self.group)  # the other ranks skip, not hang
            raise
        if together:
            # the ranks skip (or raise) together: a step that one rank skipped can never
            # commit, and the ranks that did hand it over would wait commit_timeout for it
            agreed = min_over_ranks(_NO_ROOM if lease is None else _READY, self.group)
            if agreed != _READY and lease is not None:
                lease.release()
                lease = None
            if agreed == _FAILED:  # that rank raised its own error; this step is lost
                return ("another rank's save of this step failed before it was staged (that "
                        "rank raised the error)")
        if lease is not None:
            return lease
        if self.backpressure == "skip":
            return ("the previous save of this rank or another is still being written "
                    "(backpressure=skip)")
        if self.backpressure == "error":
            raise BackpressureError(
                f"cannot stage {nbytes} bytes: the previous save of this rank (or of another "
                "rank: the ranks skip a step together) is still being written and the staging "
                "budget is in use (backpressure='error'). Save less "
                "often, raise the staging budget, or use backpressure='block'/'skip'."
            )
        lease = self._transport.acquire(nbytes, block=True)
        assert lease is not None
        return lease

    def _hook_optimizer(self, optimizer: torch.optim.Optimizer, handle: SaveHandle) -> None:
        """Make the next optimizer.step() wait until ``handle`` is staged."""
        holder: dict[str, Any] = {}

        def pre_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
            holder["h"].remove()
            handle.wait_staged()

        holder["h"] = optimizer.register_step_pre_hook(pre_step)

    def wait(self, timeout: float | None = None) -> None:
        """Wait until every save started by this client has finished (committed or failed)."""
        for h in list(self._inflight):
            try:
                h.result(timeout)
            except Exception:  # noqa: BLE001 - errors stay on the handles
                pass

    # -- loading -------------------------------------------------------------------------
    def list_steps(self) -> list[int]:
        """Committed steps of this job, oldest first."""
        return [s.step for s in _list_steps(self._transport.storage(), self.job) if s.committed]

    def load(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        step: int | None = None,
        *,
        strict: bool = True,
        restore_rng: bool = True,
    ) -> CheckpointInfo:
        """Restore the latest committed step (or ``step``) into ``model``/``optimizer``.

        Works at any world size and across frameworks.  With ``strict`` every tensor of
        the model (and optimizer) must be in the checkpoint with the same shape and dtype,
        and nothing else may be; otherwise missing tensors keep their values, unexpected
        ones are ignored, and dtypes are converted.  Shapes must always match.

        Optimizer hyperparameters (lr, weight decay, ...) are restored per param group, each
        saved group onto the live group that holds the same parameters (by name), so an
        optimizer that builds the same groups in another order gets each group's own values.
        These are mismatches too, reported before anything is read: a checkpoint saved
        without optimizer state; one saved before the optimizer's first step, loaded into an
        optimizer that has state (load into a freshly constructed optimizer to roll it back);
        param groups that hold other parameters, or another number of groups.  strict=False
        loads the tensors and keeps the optimizer's own state or hyperparameters there, with
        a warning.  Nothing is changed when a check fails.  It first waits for this client's
        saves in flight to finish (committed or failed), so every rank sees the same steps.
        """
        # This client's saves in flight finish first: an overlapped one may still be copying
        # from the model (the load would change its tensors under the copy), and a commit
        # that some ranks see before they resolve the latest step and others after made the
        # ranks load different steps.
        self._check_world(f"load(step={step})", saving=False)
        _check_model_not_meta(model)
        self.wait()
        storage = self._transport.storage()
        rec = resolve_step(storage, self.job, step)
        index = read_index(storage, rec)
        available = {
            name: TensorMeta(t.shape, dtype_from_name(t.dtype))
            for name, t in index.tensors.items() if not name.startswith(EXTRA_PREFIX)
        }
        adapter = adapter_for(model)
        # load_plan may create the state of an optimizer that has none (to have tensors to
        # fill); a load that fails its checks must leave the optimizer as it was
        fresh_optim = optimizer is not None and not optimizer.state
        plan = adapter.load_plan(model, optimizer, available)
        expected = dict(plan.model_names)
        if optimizer is not None:
            expected.update(plan.optim_names)
        scope = ("model/", "optim/") if optimizer is not None else ("model/",)
        missing = sorted(n for n in expected if n not in available)
        unexpected = sorted(n for n in available if n.startswith(scope) and n not in expected)
        bad_shape = sorted(
            f"{n}: checkpoint {list(available[n].shape)}, model {list(m.shape)}"
            for n, m in expected.items() if n in available and available[n].shape != m.shape)
        bad_dtype = sorted(
            f"{n}: checkpoint {available[n].dtype}, model {m.dtype}"
            for n, m in expected.items() if n in available and available[n].dtype != m.dtype
            and available[n].shape == m.shape)
        saved_optim_state = any(n.startswith("optim/") for n in available)
        # A checkpoint without any optimizer state is reported as such (below), not as a
        # list of every optimizer tensor it lacks.
        listed_missing = missing if saved_optim_state else [
            n for n in missing if not n.startswith("optim/")]
        problems = []
        if bad_shape:
            problems.append(("shape mismatches", bad_shape))
        if strict:
            problems += [(k, v) for k, v in (("missing from the checkpoint", listed_missing),
                                             ("unexpected in the checkpoint", unexpected),
                                             ("dtype mismatches", bad_dtype)) if v]
        # Checked here, before anything is loaded: hyperparameters are restored by group.
        saved_groups = index.param_groups or None
        optim_notes = []
        rollback = ""  # the checkpoint predates the optimizer's first step, the optimizer not
        if optimizer is not None and not saved_optim_state:
            if saved_groups is None:
                optim_notes.append(
                    "the checkpoint was saved without optimizer state (no optimizer= in save), "
                    "so the optimizer would stay as it is")
            elif not fresh_optim and plan.optim_names:
                rollback = (
                    f"the checkpoint has no optimizer state: step {rec.step} was saved before the "
                    "optimizer's first step (only its param groups were saved), but this "
                    f"optimizer has state for {len(optimizer.state)} parameters from the steps it "
                    "has taken")
                if strict:
                    optim_notes.append(
                        rollback + ". To roll the optimizer back too, load into a freshly "
                        "constructed optimizer (built as in the saved run, before its first "
                        "step); strict=False loads the model and keeps this optimizer's current "
                        "state, which belongs to a later point of training")
                else:
                    log.warning("ckptd: %s; loading the model and keeping the optimizer's current "
                                "state (strict=False). To roll the optimizer back too, load into "
                                "a freshly constructed optimizer.", rollback)
        if optimizer is not None and saved_groups is not None:
            if len(saved_groups) != len(optimizer.param_groups):
                group_note: str | None = (
                    f"the optimizer has {len(optimizer.param_groups)} param groups but the "
                    f"checkpoint saved {len(saved_groups)}, so its hyperparameters cannot be "
                    "restored")
            else:
                saved_groups, group_note = _match_param_groups(saved_groups, plan.group_params)
            if group_note is not None:
                optim_notes.append(group_note)
                if not strict:
                    log.warning("ckptd: %s; loading the tensors and keeping the optimizer's own "
                                "hyperparameters (strict=False)", group_note)
                    saved_groups = None
        if problems or (strict and optim_notes):
            lines = []
            for what, names in problems:
                shown = ", ".join(names[:20]) + (f", ... ({len(names) - 20} more)"
                                                 if len(names) > 20 else "")
                lines.append(f"{len(names)} {what}: {shown}")
            if strict:
                lines += optim_notes
            if bad_shape:
                hint = (" The model's architecture differs from the saved one (e.g. hidden size "
                        "or vocabulary); build it with the configuration the checkpoint was "
                        "saved with. Shapes must match even with strict=False.")
            elif problems:
                hint = " Pass strict=False to load the matching tensors and keep the rest."
            elif len(optim_notes) > bool(rollback):
                hint = (" Build the optimizer as in the saved run, load without optimizer=, or "
                        "pass strict=False to load the tensors and keep the optimizer's own "
                        "state and hyperparameters where the checkpoint has none.")
            else:
                hint = ""  # the rollback note says what to do
            if fresh_optim:
                optimizer.state.clear()  # type: ignore[union-attr]
            raise StateMismatchError(
                f"model/optimizer do not match step {rec.step} of job {self.job!r} "
                f"(saved by {index.framework} at world size {index.world_size}): "
                + "; ".join(lines) + "." + hint
            )
        skip = set(missing) | {n for n in expected if n in available
                               and available[n].shape != expected[n].shape}
        targets = [t for t in plan.targets if t.name not in skip]
        # an expanded tensor (stride 0 in a dim of size > 1) has elements sharing memory: it
        # cannot be filled in place (torch's load_state_dict fails on it too); say so before
        # anything is overwritten
        shared = [t.name for t in targets if any(
            st == 0 and n > 1 for st, n in zip(t.out.stride(), t.out.shape))]
        if shared:
            if fresh_optim:
                optimizer.state.clear()  # type: ignore[union-attr]
            raise ConfigError(
                f"cannot load step {rec.step} of job {self.job!r}: {len(shared)} tensors of the "
                f"model are expanded views whose elements share memory ({', '.join(shared[:5])}"
                f"{', ...' if len(shared) > 5 else ''}), so they cannot be filled in place; "
                "nothing was loaded. Give them their own memory before loading (e.g. "
                "`module.buf = module.buf.clone()`, or register `t.expand(...).clone()`)."
            )
        prefix = paths.attempt_prefix(rec.job, rec.step, rec.attempt)
        with CheckpointReader(storage, index, prefix) as reader:  # closing frees its window
            try:
                reader.read_targets(targets)
                plan.finish(saved_groups)
            except CkptdError as exc:  # e.g. a damaged chunk: raised again, saying what now
                if fresh_optim:
                    optimizer.state.clear()  # type: ignore[union-attr]
                raise _partly_loaded(exc, storage, rec, optimizer is not None) from exc

            mine = self.rank if self.rank in index.extras else 0
            doc = index.extras.get(mine) or {}

            def tensor_of(rank: int) -> Any:
                return lambda i: reader.read_region(f"{EXTRA_PREFIX}{rank}/{i}")

            user = extra_state.decode(doc.get("user"), tensor_of(mine))
            if restore_rng and self.rank in index.extras and doc.get("rng") is not None:
                extra_state.restore_rng(extra_state.decode(doc["rng"], tensor_of(mine)))
        self._counters.next_step = rec.step + 1
        return CheckpointInfo(rec.job, rec.step, rec.attempt, rec.world_size, index.framework,
                              storage.url, index.total_bytes, user, tuple(missing),
                              tuple(unexpected))

    def close(self) -> None:
        """Wait for in-flight saves, then release the transport.  Idempotent."""
        self._closed = True
        self.wait()
        if self._stager is not None:
            self._stager.shutdown(wait=True)
        self._transport.close()

    def _finish_at_exit(self) -> None:
        """Interpreter exit with saves in flight: hand them over (overlap mode's copy) and,
        in embedded mode, write this rank's part and try the commit.  Commits that wait for
        other ranks are not waited for (a dead rank would hold the exit for commit_timeout),
        nor, with a daemon, the daemon's writes."""
        if self._closed or all(h.done() for h in self._inflight):
            return
        self._closed = True
        log.info("ckptd: the interpreter is exiting with saves of job %r in flight; writing "
                 "this rank's part before it exits (call client.close() to also wait for the "
                 "commits)", self.job)
        if self._stager is not None:
            self._stager.shutdown(wait=True)
        self._transport.finish_at_exit()

    def __enter__(self) -> CheckpointClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: clients not closed yet; at interpreter exit their in-flight saves are finished
_OPEN_CLIENTS: weakref.WeakSet[CheckpointClient] = weakref.WeakSet()


def _finish_saves_at_exit() -> None:
    """Let the open clients' in-flight saves finish writing when the interpreter exits.

    It runs before concurrent.futures stops taking work at exit (``threading``'s exit hooks
    run last-registered first, and concurrent.futures registered its hook on import, above):
    a script that ended right after ``save_async`` lost that save (embedded mode, or overlap
    mode's copy) with exit code 0, its writer refused with "cannot schedule new futures
    after interpreter shutdown".  (``atexit`` handlers run too late for that.)
    """
    for client in list(_OPEN_CLIENTS):
        try:
            client._finish_at_exit()
        except Exception as exc:  # noqa: BLE001 - the next client's save must still finish
            log.error("ckptd: finishing the saves of job %r at exit failed: %s", client.job, exc)


threading._register_atexit(_finish_saves_at_exit)  # type: ignore[attr-defined]


def _match_param_groups(saved: list[dict[str, Any]], live: list[list[str]] | None) -> tuple[
        list[dict[str, Any]], str | None]:
    """The saved param groups in the order of the optimizer's, matched by the parameters
    each holds (hyperparameters belong to parameters, not to a group's position), or the
    saved groups unchanged and what differs.  ``live``: the parameter names of each live
    group (None: unknown, groups go by position).  Both lists have the same length."""
    if live is None or not all(isinstance(g.get("params"), list) for g in saved):
        return saved, None
    sets = [frozenset(g["params"]) for g in saved]
    free = list(range(len(saved)))
    order: list[int] = []
    for i, names in enumerate(live):
        want = frozenset(names)
        j = next((j for j in free if sets[j] == want), None)
        if j is None:
            near = max(range(len(saved)), key=lambda k: (len(sets[k] & want), k == i))
            added, gone = sorted(want - sets[near]), sorted(sets[near] - want)

            def few(xs: list[str]) -> str:
                return ", ".join(xs[:3]) + (", ..." if len(xs) > 3 else "")

            return saved, (
                f"optimizer param group {i} holds other parameters than every saved group, so "
                "the saved hyperparameters (lr, weight decay, ...) cannot be matched to it "
                f"(compared with saved group {near}: {len(added)} not in it ({few(added)}), "
                f"{len(gone)} only in it ({few(gone)}))")
        free.remove(j)
        order.append(j)
    if order != sorted(order):
        log.info("ckptd: the optimizer's param groups hold the saved groups' parameters in "
                 "another order (saved group for each: %s); restoring each group's "
                 "hyperparameters by its parameters", order)
    return [saved[j] for j in order], None


def _check_not_meta(items: list[SaveItem], step: int) -> None:
    """Refuse tensors without data (meta device) before anything is staged."""
    meta = [it for it in items if getattr(it.local, "is_meta", False)]
    if not meta:
        return
    names = [it.views[0].name if it.views else it.name for it in meta]
    which = f"{names[0]!r} and {len(names) - 1} more tensors are" if len(names) > 1 else (
        f"{names[0]!r} is")
    raise ConfigError(
        f"cannot save step {step}: {which} on the meta device (a tensor without "
        "data, e.g. a model built under `torch.device('meta')` for deferred initialization); "
        "ckptd saves real values only. Materialize the model first: `model.to_empty(device=...)`, "
        "then initialize its parameters (e.g. `reset_parameters()`) or load a checkpoint into "
        "it, then save."
    )


def _check_model_not_meta(model: torch.nn.Module) -> None:
    """Refuse a load into parameters or buffers on the meta device: they have no storage, so
    nothing would be written into them and the load would look successful."""
    names = [n for n, p in model.named_parameters() if p.is_meta]
    for mod_name, mod in model.named_modules():
        skip = getattr(mod, "_non_persistent_buffers_set", set())
        names += [f"{mod_name}.{n}" if mod_name else n
                  for n, b in mod.named_buffers(recurse=False)
                  if b is not None and b.is_meta and n not in skip]
    if not names:
        return
    which = f"{names[0]!r} and {len(names) - 1} more tensors are" if len(names) > 1 else (
        f"{names[0]!r} is")
    raise ConfigError(
        f"cannot load: {which} on the meta device (no data, e.g. a model built under "
        "`torch.device('meta')` for deferred initialization), so the checkpoint's values "
        "could not be written into them. Materialize the model first with "
        "`model.to_empty(device=...)` (after fully_shard, for FSDP2), then load.")


def _check_dtypes(items: list[SaveItem], step: int) -> None:
    """ConfigError naming the tensors whose dtype ckptd cannot store, if any."""
    bad = []
    for it in items:
        try:
            dtype_name(it.dtype)
        except TypeError:
            bad.append(f"{it.views[0].name if it.views else it.name} ({it.dtype})")
    if bad:
        raise ConfigError(
            f"cannot save step {step}: ckptd cannot store the dtype of {len(bad)} tensors: "
            + ", ".join(bad[:5]) + (", ..." if len(bad) > 5 else "") + f"; it stores "
            f"{', '.join(SUPPORTED)}. Convert them (e.g. dequantize a quantized tensor), or "
            "keep them out of the state dict (a non-persistent buffer) and save what you need "
            "to rebuild them in `extra=`."
        ) from None


def _partly_loaded(exc: CkptdError, storage: Any, rec: Any, optim: bool) -> CkptdError:
    """``exc`` (raised while a load was filling the model) again, as the same class, saying
    that the model is now partly overwritten and what to do: for damaged data, which other
    steps can be loaded."""
    what = "model and optimizer" if optim else "model"
    todo = "load again once the cause is fixed"
    if isinstance(exc, CorruptCheckpointError):
        try:
            others = [s.step for s in _list_steps(storage, rec.job)
                      if s.committed and s.step != rec.step]
            steps = f"the other committed steps are {others}" if others else (
                "no other step is committed")
        except Exception:  # noqa: BLE001 - only a hint
            steps = "`ckptd ls` lists the committed steps"
        todo = f"load another step (`load(..., step=N)`; {steps})"
    return type(exc)(
        f"loading step {rec.step} of job {rec.job!r} failed after it had begun to overwrite the "
        f"{what}: {exc} The {what} now hold values of step {rec.step} only in part: {todo}, or "
        "rebuild them before training on."
    )


def _chain(src: Future, dst: Future) -> None:
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


__all__ = ["CheckpointClient", "CheckpointInfo", "LoadTarget", "SaveHandle"]
