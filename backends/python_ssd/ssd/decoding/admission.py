"""Admission control against the engines' KV budget, in tokens.

Every engine holds the KV of each live sequence: at most its prompt + max_tokens + one round's
draft (the drafter adds its speculation tree, B x K rows, on top while a round runs). A request
reserves that much before it decodes and gives it back when it ends (its sequences are released
in every engine then), so the KV the engines hold stays within the budget whatever the load.
A request that cannot fit now waits, first come first served, up to ``max_wait`` seconds; one
that could never fit is refused at once.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque


class BudgetExceeded(Exception):
    """The request cannot be admitted: ``retryable`` says whether waiting could help."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


class KvBudget:
    def __init__(self, tokens: int, max_wait: float = 30.0):
        self.tokens = tokens  # 0: no budget
        self.max_wait = max_wait
        self.reserved = 0
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
                f"reserved; this request needs {n}); waited {time.monotonic() - t0:.0f} s, retry later",
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
