"""The KV budget's admission control (decoding/admission.py): fit, wait in order, refuse."""
from __future__ import annotations

import asyncio

import pytest

from ssd.decoding.admission import BudgetExceeded, KvBudget


def test_requests_that_fit_are_admitted_and_released():
    async def go():
        kv = KvBudget(100)
        await kv.acquire(60)
        await kv.acquire(40)
        assert kv.reserved == 100
        kv.release(60)
        kv.release(40)
        assert kv.reserved == 0
    asyncio.run(go())


def test_a_request_larger_than_the_budget_is_refused_at_once_naming_the_budget():
    async def go():
        kv = KvBudget(100)
        with pytest.raises(BudgetExceeded) as e:
            await kv.acquire(101)
        assert not e.value.retryable and "kv_budget_tokens=100" in str(e.value) and "max_tokens" in str(e.value)
        assert kv.reserved == 0
    asyncio.run(go())


def test_waiters_are_admitted_in_arrival_order_as_room_frees():
    async def go():
        kv = KvBudget(100, max_wait=60)
        await kv.acquire(90)
        order = []

        async def want(name, n):
            await kv.acquire(n)
            order.append(name)

        big = asyncio.ensure_future(want("big", 50))
        await asyncio.sleep(0)
        small = asyncio.ensure_future(want("small", 10))  # would fit now, but must not overtake
        await asyncio.sleep(0)
        assert order == [] and kv.waiting == 2
        kv.release(90)
        await asyncio.gather(big, small)
        assert order == ["big", "small"] and kv.reserved == 60
    asyncio.run(go())


def test_a_wait_that_runs_out_is_a_retryable_refusal_and_frees_its_place():
    async def go():
        kv = KvBudget(100, max_wait=0.05)
        await kv.acquire(100)
        with pytest.raises(BudgetExceeded) as e:
            await kv.acquire(10)
        assert e.value.retryable and "server busy" in str(e.value)
        assert kv.waiting == 0 and kv.reserved == 100
    asyncio.run(go())


def test_a_cancelled_waiter_leaves_the_queue():
    async def go():
        kv = KvBudget(100, max_wait=60)
        await kv.acquire(100)
        t = asyncio.ensure_future(kv.acquire(10))
        await asyncio.sleep(0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert kv.waiting == 0
        kv.release(100)
        assert kv.reserved == 0
    asyncio.run(go())


def test_error_messages_map_to_the_status_they_stand_for():
    from ssd.serving import errors

    assert errors.http_status(errors.BUSY + "32 requests decoding (max_active_requests=32)") == 503
    assert errors.http_status(errors.UNAVAILABLE + "'target' is restarting") == 503
    assert errors.http_status(errors.INTERNAL + "generation failed") == 500
    assert errors.http_status("input 'top_p': must be in (0, 1], got 1.5") == 400
    # the KV budget's refusal after a wait is a busy server too
    assert KvBudget(1, max_wait=0.01) and errors.http_status("server busy: KV budget full") == 503
