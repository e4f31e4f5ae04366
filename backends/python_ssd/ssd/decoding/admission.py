"""Admission control: request slots (``max_active_requests``) and the engines' KV budget, in tokens.

A request first takes one of ``limit`` slots (``RequestSlots``); over the limit it waits in a
bounded queue, in arrival order, and is refused only when its wait runs out, with the seconds a
retry should wait. Then it reserves its KV (``KvBudget``). Every engine holds the KV of each live sequence: at most its prompt + max_tokens + one round's
draft (the drafter adds its speculation tree, B x K rows, on top while a round runs). A request
reserves that much before it decodes and gives it back when it ends (its sequences are released
in every engine then), so the KV the engines hold stays within the budget whatever the load.
A request that cannot fit now waits, first come first served, up to ``max_wait`` seconds; one
that could never fit is refused at once.
"""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from typing import Callable

TURNOVER_WINDOW_S = 60.0  # how far back the rate at which admitted requests end is measured
RETRY_MAX_S = 300


class BudgetExceeded(Exception):
    """The request cannot be admitted: ``retryable`` says whether waiting could help."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


class Turnover:
    """When admitted requests ended lately: the basis of a refusal's "retry in N s"."""

    def __init__(self, fallback_s: float):
        self.fallback_s = fallback_s
        self._ends: deque[float] = deque(maxlen=64)

    def ended(self) -> None:
        self._ends.append(time.monotonic())

    def retry_after(self, ahead: int) -> int:
        """Seconds until ``ahead`` + 1 more requests will have ended at the rate they ended in the last
        minute (a request refused now that retries then finds room); the queue's own wait when none ended."""
        now = time.monotonic()
        recent = [t for t in self._ends if now - t <= TURNOVER_WINDOW_S]
        if not recent:
            return int(min(RETRY_MAX_S, max(1, math.ceil(self.fallback_s))))
        rate = len(recent) / max(now - recent[0], 1.0)  # ends per second
        return int(min(RETRY_MAX_S, max(1, math.ceil((ahead + 1) / rate))))


class RequestSlots:
    """At most ``limit`` requests admitted at once (``max_active_requests``). The rest wait, first
    come first served, at most ``max_queued`` of them, each up to ``max_wait`` seconds; a request the
    queue cannot take, or whose wait runs out, is refused with the seconds a retry should wait."""

    def __init__(self, limit: int, max_wait: float, max_queued: int):
        self.limit, self.max_wait, self.max_queued = limit, max_wait, max_queued
        self.held = 0
        self.turnover = Turnover(max_wait)
        self._waiters: deque[asyncio.Future] = deque()
        self.on_queue: Callable[[int], None] | None = None  # hears the queue's length at each change

    def _queue_changed(self) -> None:
        if self.on_queue is not None:
            self.on_queue(self.waiting)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _refusal(self, waited: float) -> BudgetExceeded:
        wait = (f"waited {waited:.0f} s (queue_wait_s={self.max_wait:g})" if waited > 0 else
                f"the queue is full (max_queued_requests={self.max_queued})" if self.max_wait > 0 else "queue_wait_s=0")
        return BudgetExceeded(
            f"server busy: {self.held} requests admitted and {self.waiting} waiting (max_active_requests="
            f"{self.limit}); {wait}; retry in {self.turnover.retry_after(self.waiting)} s", retryable=True)

    async def acquire(self, max_wait: float | None = None) -> None:
        """Takes a slot, waiting up to ``max_wait`` (default: the queue's) for one."""
        wait = self.max_wait if max_wait is None else min(max_wait, self.max_wait)
        if not self._waiters and self.held < self.limit:
            self.held += 1
            return
        if wait <= 0 or self.waiting >= self.max_queued:
            raise self._refusal(0.0)
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._queue_changed()
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(fut), wait)
        except asyncio.TimeoutError:
            if fut.done() and not fut.cancelled():  # granted just as the wait ran out: keep it
                return
            self._drop(fut)
            raise self._refusal(time.monotonic() - t0) from None
        except asyncio.CancelledError:  # the client went away while it waited
            if fut.done() and not fut.cancelled():
                self.held -= 1  # granted, never used: not a request that ended
                self._grant()
            else:
                self._drop(fut)
            raise

    def _drop(self, fut: asyncio.Future) -> None:
        fut.cancel()
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass
        self._queue_changed()

    def release(self) -> None:
        self.held = max(0, self.held - 1)
        self.turnover.ended()
        self._grant()

    def _grant(self) -> None:
        granted = False
        while self._waiters and self.held < self.limit:
            fut = self._waiters.popleft()
            granted = True
            if fut.done():
                continue
            self.held += 1
            fut.set_result(None)
        if granted:
            self._queue_changed()


class KvBudget:
    def __init__(self, tokens: int, max_wait: float = 30.0):
        self.tokens = tokens  # 0: no budget
        self.max_wait = max_wait
        self.reserved = 0
        self.turnover = Turnover(max_wait)
        self._waiters: deque[tuple[int, asyncio.Future]] = deque()

    def _fits(self, n: int) -> bool:
        return self.tokens <= 0 or self.reserved + n <= self.tokens

    async def acquire(self, n: int) -> None:
        if self.tokens > 0 and n > self.tokens:
            raise BudgetExceeded(
                f"input 'max_tokens': prompt + max_tokens + draft need {n} KV tokens, more than the "
                f"engines' KV budget kv_budget_tokens={self.tokens}", retryable=False)
        if not self._waiters and self._fits(n):
            self.reserved += n
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.max_wait)
        except asyncio.TimeoutError:
            if fut.done() and not fut.cancelled():  # granted just as the wait ran out: keep it
                return
            self._drop(entry)
            raise BudgetExceeded(
                f"server busy: KV budget full ({self.reserved} of kv_budget_tokens={self.tokens} tokens "
                f"reserved; this request needs {n}); waited {time.monotonic() - t0:.0f} s; retry in "
                f"{self.turnover.retry_after(self.waiting)} s",
                retryable=True) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(n)
            else:
                self._drop(entry)
            raise

    def _drop(self, entry) -> None:
        try:
            self._waiters.remove(entry)
        except ValueError:
            pass
        self._grant()

    def release(self, n: int) -> None:
        self.reserved = max(0, self.reserved - n)
        self.turnover.ended()
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            n, fut = self._waiters.popleft()
            if fut.done():
                continue
            self.reserved += n
            fut.set_result(None)

    @property
    def waiting(self) -> int:
        return len(self._waiters)
