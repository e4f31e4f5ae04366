"""Admission control (decoding/admission.py): request slots and the KV budget: fit, wait in order, refuse."""
from __future__ import annotations

import asyncio
import re
import time

import pytest

from ssd.decoding.admission import BudgetExceeded, KvBudget, RequestSlots, Turnover


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


def test_a_request_over_the_slot_limit_waits_in_order_and_gets_the_next_free_slot():
    async def go():
        slots, seen = RequestSlots(limit=2, max_wait=60, max_queued=4), []
        slots.on_queue = seen.append
        await slots.acquire()
        await slots.acquire()
        order = []

        async def want(name):
            await slots.acquire()
            order.append(name)

        first = asyncio.ensure_future(want("first"))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(want("second"))
        await asyncio.sleep(0)
        assert order == [] and slots.waiting == 2 and seen[-1] == 2  # the queue's gauge follows it
        slots.release()
        await first
        assert order == ["first"] and slots.held == 2 and slots.waiting == 1
        slots.release()
        await second
        assert order == ["first", "second"] and slots.waiting == 0 and seen[-1] == 0
    asyncio.run(go())


def test_a_slot_wait_that_runs_out_is_refused_with_the_seconds_to_wait():
    async def go():
        slots = RequestSlots(limit=1, max_wait=0.05, max_queued=4)
        await slots.acquire()
        with pytest.raises(BudgetExceeded) as e:
            await slots.acquire()
        msg = str(e.value)
        assert e.value.retryable and msg.startswith("server busy: ") and "max_active_requests=1" in msg, msg
        assert "queue_wait_s=0.05" in msg and re.search(r"retry in [1-9]\d* s$", msg), msg
        assert slots.waiting == 0 and slots.held == 1
    asyncio.run(go())


def test_a_full_queue_and_no_queue_refuse_at_once():
    async def go():
        full = RequestSlots(limit=1, max_wait=60, max_queued=1)
        await full.acquire()
        waiter = asyncio.ensure_future(full.acquire())
        await asyncio.sleep(0)
        with pytest.raises(BudgetExceeded) as e:
            await full.acquire()
        assert "max_queued_requests=1" in str(e.value)
        waiter.cancel()
        none = RequestSlots(limit=1, max_wait=0, max_queued=8)
        await none.acquire()
        with pytest.raises(BudgetExceeded) as e:
            await none.acquire()
        assert "queue_wait_s=0" in str(e.value)
    asyncio.run(go())


def test_a_cancelled_slot_waiter_leaves_the_queue_and_takes_no_slot():
    async def go():
        slots = RequestSlots(limit=1, max_wait=60, max_queued=4)
        await slots.acquire()
        t = asyncio.ensure_future(slots.acquire())
        await asyncio.sleep(0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert slots.waiting == 0 and slots.held == 1
        slots.release()
        assert slots.held == 0
    asyncio.run(go())


def test_retry_after_follows_the_rate_at_which_requests_end():
    t = Turnover(fallback_s=30)
    assert t.retry_after(ahead=0) == 30  # nothing ended yet: the queue's own wait
    now = time.monotonic()
    t._ends.extend([now - 10 + i for i in range(10)])  # ten ends in the last ten seconds: 1 a second
    assert t.retry_after(ahead=0) in (1, 2) and 4 <= t.retry_after(ahead=4) <= 6
