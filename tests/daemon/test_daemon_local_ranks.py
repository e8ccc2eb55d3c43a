"""A save's write waits for the node's other ranks of the same attempt (unit tests, one
event loop): writing one rank's bytes must not compete with ranks still copying theirs."""

from __future__ import annotations

import asyncio

from ckptd.daemon.budget import ByteBudget
from ckptd.daemon.metrics import Metrics
from ckptd.daemon.pipeline import AttemptTracker, SaveRecord
from ckptd.daemon.staging import LENT, Slot, StagingPool
from ckptd.format.writer import SaveIdentity


def _rec(rank: int) -> SaveRecord:
    ident = SaveIdentity("job", 1, "a.1", rank, 4, "plain")
    return SaveRecord(f"job/1/a.1/{rank}", ident, 0, 60.0)


def test_wait_for_ranks_returns_when_all_arrived_or_at_the_timeout():
    async def main():
        t = AttemptTracker(None, "job", 1, "a.1", 4)  # type: ignore[arg-type]
        t.add(_rec(0))
        await t.wait_for_ranks(1, 60.0)        # already there: returns at once
        waiter = asyncio.ensure_future(t.wait_for_ranks(3, 60.0))
        await asyncio.sleep(0)
        t.add(_rec(2))
        await asyncio.sleep(0)
        assert not waiter.done()               # 2 of 3 ranks
        t.add(_rec(2))                         # the same rank again does not count twice
        await asyncio.sleep(0)
        assert not waiter.done()
        t.add(_rec(3))
        await asyncio.wait_for(waiter, 60.0)   # the third rank releases it
        # a rank that never comes: the wait ends at its timeout instead
        await t.wait_for_ranks(4, 0.01)

    asyncio.run(main())


def test_local_ranks_counts_ranks_of_the_job_holding_segments():
    pool = StagingPool(ByteBudget(1 << 30), Metrics())
    sessions = [pool.register("job", r, 4, local=True) for r in (0, 1, 2)]
    pool.register("job", 3, 4, local=False)         # remote: streams, not this node's cores
    pool.register("other", 0, 4, local=True)        # another job
    dup = pool.register("job", 0, 4, local=True)    # a second client of rank 0
    assert pool.local_ranks("job", 4) == 0          # nobody holds a segment yet
    for i, s in enumerate([*sessions[:2], dup]):
        s.slots[f"s{i}"] = Slot(f"s{i}", s, 1 << 20, "shm", state=LENT)
    assert pool.local_ranks("job", 4) == 2          # ranks 0 and 1
    assert pool.local_ranks("job", 8) == 0          # another world size: another run
    sessions[1].closed = True
    assert pool.local_ranks("job", 4) == 1


def test_read_segment_is_never_freed_under_a_reading_thread():
    """A read segment released (or its session closed) while ranges are being read into it
    stays mapped and charged until the last range is done; save segments cannot be read
    into, read segments cannot be lent to a save."""
    from ckptd.daemon.rpcerrors import RpcFailure
    from ckptd.errors import StagingError

    async def main():
        budget = ByteBudget(64 << 20)
        pool = StagingPool(budget, Metrics())
        s = pool.register("job", 0, 1, local=True)
        s.attached = True
        slot = await pool.acquire(s, 3 << 20, wait=False, shm=True, timeout=None, read=True)
        assert slot.kind == "read" and slot.size == 3 << 20 and budget.in_use == 3 << 20
        assert slot.segment is not None and slot.segment.writable
        try:
            pool.begin_read(s, slot.id)
            raise AssertionError("a read segment must be fetched before it is read into")
        except RpcFailure as exc:
            assert exc.code == "FAILED_PRECONDITION"
        seg = pool.fetch(s, slot.id)
        try:
            pool.lend(s, slot.id, "shm")
            raise AssertionError("a read segment must not be lent to a save")
        except StagingError:
            pass
        held = pool.begin_read(s, slot.id)
        pool.begin_read(s, slot.id)
        pool.close_session(s, "test")            # the client died mid-load
        assert held.doomed and seg.mm is not None and budget.in_use == 3 << 20
        seg.write_view(0, 4)[:] = b"abcd"         # the reading thread may still write
        pool.end_read(held)
        assert seg.mm is not None                 # one range still being read
        pool.end_read(held)
        assert seg.mm is None and budget.in_use == 0 and held.state == "freed"
        # a save segment is mapped read-only in the daemon: never a read target
        s2 = pool.register("job", 0, 1, local=True)
        s2.attached = True
        save = await pool.acquire(s2, 1 << 20, wait=False, shm=True, timeout=None)
        pool.fetch(s2, save.id)
        try:
            pool.begin_read(s2, save.id)
            raise AssertionError("a save segment must not be read into")
        except RpcFailure as exc:
            assert exc.code == "FAILED_PRECONDITION" and "not a read segment" in str(exc)
        pool.release(s2, save.id)
        assert budget.in_use == 0

    asyncio.run(main())
