"""ByteBudget: the node-wide staging budget (unit tests, one event loop, no timing)."""

from __future__ import annotations

import asyncio

import pytest

from ckptd.daemon.budget import ByteBudget
from ckptd.errors import BackpressureError, StagingError


def run(coro):
    return asyncio.run(coro)


def test_acquire_release_and_nowait_failure():
    async def main():
        b = ByteBudget(100)
        await b.acquire(60)
        assert (b.in_use, b.free) == (60, 40)
        with pytest.raises(BackpressureError, match="in use"):
            await b.acquire(50, wait=False)
        assert b.in_use == 60 and b.waiting == 0
        await b.acquire(40, wait=False)
        b.release(60)
        b.release(40)
        assert b.in_use == 0

    run(main())


def test_request_larger_than_capacity_fails_at_once():
    async def main():
        b = ByteBudget(100)
        with pytest.raises(StagingError, match="never fit"):
            await b.acquire(101)          # would otherwise wait forever
        with pytest.raises(StagingError):
            await b.acquire(-1)

    run(main())


def test_waiters_are_served_fifo_and_large_ones_are_not_starved():
    async def main():
        b = ByteBudget(100)
        await b.acquire(90)
        order = []

        async def want(n, tag):
            await b.acquire(n)
            order.append(tag)

        big = asyncio.create_task(want(80, "big"))
        await asyncio.sleep(0)
        small = asyncio.create_task(want(10, "small"))  # would fit now, but big is first
        await asyncio.sleep(0)
        assert order == [] and b.waiting == 2
        assert not b.try_acquire(5)                    # nobody jumps the queue
        b.release(90)
        await asyncio.gather(big, small)
        assert order == ["big", "small"] and b.in_use == 90

    run(main())


def test_timeout_and_cancellation_leave_the_budget_unchanged():
    async def main():
        b = ByteBudget(100)
        await b.acquire(100)
        with pytest.raises(BackpressureError, match="waited"):
            await b.acquire(50, timeout=0.01)
        assert b.waiting == 0 and b.in_use == 100
        t = asyncio.create_task(b.acquire(50))
        await asyncio.sleep(0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert b.waiting == 0
        b.release(100)
        assert b.in_use == 0
        # a big waiter leaving unblocks a smaller one queued behind it
        await b.acquire(60)
        bigt = asyncio.create_task(b.acquire(70))
        await asyncio.sleep(0)
        smallt = asyncio.create_task(b.acquire(30))
        await asyncio.sleep(0)
        assert not smallt.done()
        bigt.cancel()
        await asyncio.gather(bigt, return_exceptions=True)
        await smallt
        assert b.in_use == 90

    run(main())


def test_grant_racing_cancellation_is_returned():
    async def main():
        b = ByteBudget(10)
        await b.acquire(10)
        t = asyncio.create_task(b.acquire(10))
        await asyncio.sleep(0)
        b.release(10)      # grants the waiter (in_use back to 10) ...
        t.cancel()         # ... which is cancelled before it runs
        await asyncio.gather(t, return_exceptions=True)
        assert b.in_use in (0, 10)
        if t.cancelled():
            assert b.in_use == 0

    run(main())


def test_release_more_than_taken_is_a_bug():
    b = ByteBudget(10)
    with pytest.raises(RuntimeError):
        b.release(1)
