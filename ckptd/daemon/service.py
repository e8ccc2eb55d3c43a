"""The gRPC servicer of ``ckptd.v1.CheckpointService`` (thin: parse, check, delegate).

One instance per listening server (Unix socket, TCP); ``local`` says whether callers are
on this node (shared-memory staging is only offered to them).  Every handler turns
exceptions into a status with :mod:`ckptd.daemon.rpcerrors`; nothing a client sends can
raise out of a handler.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from ckptd import __version__
from ckptd.daemon import validate
from ckptd.daemon.config import STREAM_CHUNK_BYTES
from ckptd.daemon.pipeline import (
    ACCEPTED,
    COMMITTED,
    FAILED,
    WRITTEN,
    SaveRecord,
    WritePipeline,
    save_id_of,
)
from ckptd.daemon.rpcerrors import REASON_DRAINING, RpcFailure, status_of, trailing_metadata
from ckptd.daemon.segments import Segment, StreamBuffer
from ckptd.daemon.staging import StagingPool
from ckptd.errors import CheckpointNotFoundError, DaemonUnavailableError, StagingError
from ckptd.format import paths
from ckptd.format.commit import list_steps, mark_failed
from ckptd.storage.base import StorageBackend
from ckptd.v1 import ckptd_pb2 as pb
from ckptd.v1 import ckptd_pb2_grpc as pb_grpc

log = logging.getLogger("ckptd.daemon")

assert (pb.SAVE_STATE_ACCEPTED, pb.SAVE_STATE_WRITTEN, pb.SAVE_STATE_COMMITTED,
        pb.SAVE_STATE_FAILED) == (ACCEPTED, WRITTEN, COMMITTED, FAILED)

READ_RANGE = 16 << 20
ACQUIRE_WAIT_CAP = 600.0


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    code, cls, msg, reason = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("internal error in a request: %s", msg, exc_info=exc)
    context.set_trailing_metadata(trailing_metadata(cls, reason))
    await context.abort(code, msg)


def _unary(fn: Callable) -> Callable:
    @functools.wraps(fn)
    async def wrapper(self: Servicer, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a status
            await _abort(context, exc)
    return wrapper


def _streaming(fn: Callable) -> Callable:
    @functools.wraps(fn)
    async def wrapper(self: Servicer, request: Any,
                      context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(self, request, context):
                yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc)
    return wrapper


def _status(rec: SaveRecord) -> pb.SaveStatus:
    return pb.SaveStatus(save_id=rec.save_id, state=rec.state,  # type: ignore[arg-type]
                         segment_returned=rec.segment_returned, nbytes=rec.written_bytes,
                         error_class=rec.error_class, error_message=rec.error_message,
                         world_size=rec.ident.world_size)


class Servicer(pb_grpc.CheckpointServiceServicer):
    def __init__(self, pool: StagingPool, pipeline: WritePipeline, storage: StorageBackend, *,
                 local: bool, fd_socket: str, read_pool: Any, max_message_bytes: int,
                 test_read_gate: str | None = None) -> None:
        self.pool = pool
        self.pipeline = pipeline
        self.storage = storage
        self.local = local
        self.fd_socket = fd_socket if local else ""
        self.read_pool = read_pool
        self.max_message_bytes = max_message_bytes
        self.plans = validate.PlanCache()
        self.test_read_gate = test_read_gate

    def _accepting(self) -> None:
        if not self.pipeline.accepting:
            raise RpcFailure("UNAVAILABLE", DaemonUnavailableError,
                             "the ckptd daemon is shutting down (draining in-flight saves) and "
                             "accepts no new saves; retry against the restarted daemon",
                             REASON_DRAINING)

    async def _blocking(self, fn: Callable, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self.read_pool, functools.partial(fn, *args))

    # -- sessions and staging ------------------------------------------------------------
    @_unary
    async def RegisterRank(self, request: pb.RegisterRankRequest,
                           context: grpc.aio.ServicerContext) -> pb.RegisterRankResponse:
        self._accepting()
        validate.check_rank(request.rank, request.world_size)
        paths.check_job(request.job)
        s = self.pool.register(request.job, request.rank, request.world_size, local=self.local,
                               pid=request.pid, host=request.hostname[:255])
        return pb.RegisterRankResponse(
            session_id=s.id, session_secret=s.secret, fd_socket=self.fd_socket,
            staging_budget_bytes=self.pool.budget.capacity,
            max_message_bytes=self.max_message_bytes, daemon_version=__version__,
            storage_url=self.storage.url)

    @_unary
    async def AcquireStaging(self, request: pb.AcquireStagingRequest,
                             context: grpc.aio.ServicerContext) -> pb.AcquireStagingResponse:
        self._accepting()
        s = self.pool.get(request.session_id)
        if request.transfer not in (pb.TRANSFER_SHARED_MEMORY, pb.TRANSFER_STREAM):
            raise StagingError("transfer must be TRANSFER_SHARED_MEMORY or TRANSFER_STREAM")
        remaining = context.time_remaining()
        timeout = ACQUIRE_WAIT_CAP if remaining is None else max(0.0, min(ACQUIRE_WAIT_CAP,
                                                                          remaining - 0.5))
        slot = await self.pool.acquire(s, request.nbytes, request.wait,
                                       request.transfer == pb.TRANSFER_SHARED_MEMORY, timeout,
                                       read=request.use == pb.SEGMENT_USE_READ)
        return pb.AcquireStagingResponse(segment_id=slot.id, size=slot.size)

    @_unary
    async def ReleaseStaging(self, request: pb.ReleaseStagingRequest,
                             context: grpc.aio.ServicerContext) -> pb.ReleaseStagingResponse:
        s = self.pool.sessions.get(request.session_id)
        if s is not None and not s.closed:
            self.pool.release(s, request.segment_id)
        return pb.ReleaseStagingResponse()

    # -- saving --------------------------------------------------------------------------
    def _check_save(self, request: pb.SaveRequest | pb.AbandonSaveRequest
                    ) -> tuple[Any, Any, Any]:
        i = request.identity
        ident = validate.identity(i.job, i.step, i.attempt, i.rank, i.world_size, i.framework)
        s = self.pool.get(request.session_id)
        if (s.job, s.rank, s.world_size) != (ident.job, ident.rank, ident.world_size):
            raise StagingError(
                f"save identity (job {ident.job!r}, rank {ident.rank}/{ident.world_size}) is not "
                f"the session's (job {s.job!r}, rank {s.rank}/{s.world_size})")
        return ident, s, self.pipeline.find(save_id_of(ident))

    def _duplicate(self, existing: SaveRecord) -> pb.SaveResponse:
        if existing.state == FAILED:
            raise RpcFailure("FAILED_PRECONDITION", StagingError,
                             f"save {existing.save_id} already failed "
                             f"({existing.error_message}); save under a new attempt")
        return pb.SaveResponse(save_id=existing.save_id,
                               state=existing.state)  # type: ignore[arg-type]

    @_unary
    async def Save(self, request: pb.SaveRequest,
                   context: grpc.aio.ServicerContext) -> pb.SaveResponse:
        t0 = time.perf_counter()
        self._accepting()
        ident, session, existing = self._check_save(request)
        if existing is not None:
            return self._duplicate(existing)
        slot = self.pool.lend(session, request.segment_id, "shm")
        try:
            seg = slot.segment
            assert seg is not None
            seg.check()
            t1 = time.perf_counter()
            plan, extra, groups = self._parse(request, seg.size)
            t2 = time.perf_counter()
            buffer = seg.view(plan.nbytes)
        except BaseException:
            self.pool.give_back(slot)
            raise
        resp = self._submit(ident, request, slot, plan, buffer, extra, groups,
                            self.pool.local_ranks(ident.job, ident.world_size))
        if log.isEnabledFor(logging.DEBUG):
            t3 = time.perf_counter()
            log.debug("Save %s: check %.1f ms, parse %.1f ms, submit %.1f ms", resp.save_id,
                      (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3)
        return resp

    def _parse(self, request: pb.SaveRequest, size: int) -> tuple[Any, Any, Any]:
        """Validate a Save's plan (against ``size`` staged bytes; an unchanged plan was
        checked before and comes from the cache), extra and param groups."""
        return (self.plans.plan(request.plan_json, size),
                validate.json_doc(request.extra_json, "extra"),
                validate.param_groups(request.param_groups_json))

    def _submit(self, ident: Any, request: pb.SaveRequest, slot: Any, plan: Any, buffer: Any,
                extra: Any, groups: Any, local_ranks: int = 1) -> pb.SaveResponse:
        """Queue a validated save; the slot goes back to the pool once the rank is durable.
        ``local_ranks``: ranks of the job staging on this node (see WritePipeline.submit)."""
        rec = self.pipeline.submit(ident, plan, buffer, extra=extra, param_groups=groups,
                                   commit_timeout=request.commit_timeout_s,
                                   done=lambda: self.pool.give_back(slot),
                                   local_ranks=local_ranks)
        return pb.SaveResponse(save_id=rec.save_id, state=rec.state)  # type: ignore[arg-type]

    @_unary
    async def SaveStream(self, request_iterator: AsyncIterator[pb.SaveStreamRequest],
                         context: grpc.aio.ServicerContext) -> pb.SaveResponse:
        self._accepting()
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise StagingError("SaveStream carried no header") from None
        if first.WhichOneof("part") != "header":
            raise StagingError("the first SaveStream message must be the header")
        request = first.header
        ident, session, existing = self._check_save(request)
        if existing is not None:
            async for _ in it:  # drain the duplicate's bytes
                pass
            return self._duplicate(existing)
        slot = self.pool.lend(session, request.segment_id, "stream")
        try:
            plan, extra, groups = self._parse(request, slot.size)
            buf = slot.stream = StreamBuffer(plan.nbytes)
            async for msg in it:
                if msg.WhichOneof("part") != "data":
                    raise StagingError("SaveStream: only the first message may be a header")
                buf.append(msg.data)
            if buf.filled != plan.nbytes:
                raise StagingError(f"SaveStream sent {buf.filled} bytes, the plan needs "
                                   f"{plan.nbytes}")
            buffer = buf.view(plan.nbytes)
        except BaseException:
            self.pool.give_back(slot)
            raise
        return self._submit(ident, request, slot, plan, buffer, extra, groups)

    @_unary
    async def AbandonSave(self, request: pb.AbandonSaveRequest,
                          context: grpc.aio.ServicerContext) -> pb.AbandonSaveResponse:
        ident, _session, existing = self._check_save(request)
        if existing is not None and existing.state != FAILED:
            raise RpcFailure("FAILED_PRECONDITION", StagingError,
                             f"save {existing.save_id} was handed over to this daemon and "
                             "cannot be abandoned; it commits or fails by itself")
        log.info("rank %d abandoned its save of step %d of job %s (attempt %s): %s",
                 ident.rank, ident.step, ident.job, ident.attempt, request.error_message[:500])
        # the short-retry storage: the caller waits, and the record is best effort
        await self._blocking(mark_failed, self.storage, ident.job, ident.step, ident.attempt,
                             ident.rank, request.error_message or "no error given")
        return pb.AbandonSaveResponse()

    @_unary
    async def GetSaveStatus(self, request: pb.GetSaveStatusRequest,
                            context: grpc.aio.ServicerContext) -> pb.SaveStatus:
        rec = self.pipeline.find(request.save_id)
        if rec is None:
            raise RpcFailure("NOT_FOUND", StagingError,
                             f"save {request.save_id!r} is unknown to this daemon")
        return _status(rec)

    @_streaming
    async def WatchSave(self, request: pb.WatchSaveRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SaveStatus]:
        rec = self.pipeline.find(request.save_id)
        if rec is None:
            if not request.HasField("identity"):
                raise RpcFailure("NOT_FOUND", StagingError,
                                 f"save {request.save_id!r} is unknown to this daemon")
            i = request.identity
            ident = validate.identity(i.job, i.step, i.attempt, i.rank, i.world_size,
                                      i.framework)
            rec = await self.pipeline.adopt(ident, request.commit_timeout_s)
        async for r in rec.changes():
            yield _status(r)

    # -- listing and reading -------------------------------------------------------------
    @_unary
    async def ListSteps(self, request: pb.ListStepsRequest,
                        context: grpc.aio.ServicerContext) -> pb.ListStepsResponse:
        steps = await self._blocking(list_steps, self.storage, request.job)
        return pb.ListStepsResponse(steps=[
            pb.StepInfo(step=s.step, committed=s.committed, attempt=s.attempt or "",
                        world_size=s.world_size or 0, attempts=list(s.attempts))
            for s in steps])

    @_unary
    async def StatObject(self, request: pb.StatObjectRequest,
                         context: grpc.aio.ServicerContext) -> pb.StatObjectResponse:
        key = validate.job_key(request.job, request.key, allow_job_root=False)
        try:
            size = await self._blocking(self.storage.size, key)
        except FileNotFoundError:
            return pb.StatObjectResponse(exists=False)
        return pb.StatObjectResponse(exists=True, size=size)

    @_unary
    async def ListObjects(self, request: pb.ListObjectsRequest,
                          context: grpc.aio.ServicerContext) -> pb.ListObjectsResponse:
        key = validate.job_key(request.job, request.prefix.strip("/"))
        if request.recursive:
            sizes = await self._blocking(self.storage.list_files, key)
            return pb.ListObjectsResponse(sizes=sizes)
        names = await self._blocking(self.storage.list_dir, key)
        return pb.ListObjectsResponse(names=names)

    @_streaming
    async def ReadObject(self, request: pb.ReadObjectRequest,
                         context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ReadObjectResponse]:
        key = validate.job_key(request.job, request.key, allow_job_root=False)
        start = request.start if request.HasField("start") else 0
        if request.HasField("end"):
            end = request.end
        else:
            try:
                end = await self._blocking(self.storage.size, key)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"no object {key!r}") from None
        pos = start
        first = True
        while pos < end or first:
            hi = min(end, pos + READ_RANGE)
            try:
                data = await self._blocking(self.storage.get, key, pos, hi)
            except FileNotFoundError:
                raise CheckpointNotFoundError(f"no object {key!r}") from None
            first = False
            self.pool.metrics.bytes_read.labels("stream").inc(len(data))
            for off in range(0, len(data), STREAM_CHUNK_BYTES):
                yield pb.ReadObjectResponse(data=data[off:off + STREAM_CHUNK_BYTES])
            if len(data) < hi - pos:
                break
            pos = hi

    @_unary
    async def ReadIntoSegment(self, request: pb.ReadIntoSegmentRequest,
                              context: grpc.aio.ServicerContext) -> pb.ReadIntoSegmentResponse:
        if not self.local:
            raise RpcFailure("FAILED_PRECONDITION", StagingError,
                             "ReadIntoSegment needs shared memory and is served only on the "
                             "daemon's Unix socket; over TCP read with ReadObject")
        session = self.pool.get(request.session_id)
        slot = self.pool.begin_read(session, request.segment_id)
        try:
            seg = slot.segment
            assert seg is not None
            seg.check()
            ranges = validate.read_ranges(session.job, request.ranges, seg.size)
        except BaseException:
            self.pool.end_read(slot)
            raise
        # Each range is read by a thread of the read pool.  The segment stays held until
        # every thread that started has finished -- also when this call fails or is
        # cancelled (the client died) -- so it is never unmapped under a writing thread.
        loop = asyncio.get_running_loop()
        left = len(ranges)
        in_flight = self.pool.metrics.reads_in_flight
        in_flight.inc(left)

        def finished() -> None:
            nonlocal left
            left -= 1
            in_flight.dec()
            if left == 0:
                self.pool.end_read(slot)

        if not ranges:
            self.pool.end_read(slot)
        futures = []
        try:
            for r in ranges:
                cf = self.read_pool.submit(self._read_range, seg, r)
                cf.add_done_callback(lambda _cf: loop.call_soon_threadsafe(finished))
                futures.append(asyncio.wrap_future(cf))
        except BaseException:  # e.g. the pool is shut down: ranges never started are done
            for _ in range(len(ranges) - len(futures)):
                finished()
            raise
        return pb.ReadIntoSegmentResponse(nbytes=await asyncio.gather(*futures))

    def _read_range(self, seg: Segment, r: validate.ReadSpec) -> int:
        """Read one range into ``seg`` (a read-pool thread); -1 if the object is absent."""
        if self.test_read_gate:
            while not os.path.exists(self.test_read_gate):
                time.sleep(0.01)
        try:
            if r.whole:
                size = self.storage.size(r.key)
                if size != r.length:
                    return size
            view = seg.write_view(r.offset, r.length)
            try:
                n = self.storage.get_into(r.key, view, r.start)
            finally:
                view.release()
            self.pool.metrics.bytes_read.labels("shared_memory").inc(n)
            return n
        except FileNotFoundError:
            return -1
