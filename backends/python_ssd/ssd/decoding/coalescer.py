"""Makes concurrent sequences reach the engines together, so they share forwards.

Two sequences whose steps happen to alternate never meet on their own: while A's step runs, B's
call waits and then runs alone while A's next call waits (a convoy: 2 users got no more tokens/s
than 1). So each operation has a scheduler of one message in flight, as in continuous batching:
- a call that arrives while a message of its op is in flight waits for it to return (the engine
  is busy with it anyway), then leaves with the sequences of that message, which resubmit within
  a millisecond or two;
- with nothing in flight, calls leave as soon as every decoding sequence has one, or after a short
  window (``window_frac`` of the op's last latency, at most ``max_window``) for peers that are
  elsewhere (a prefill, a backup after a miss);
- a message is one ``call_many``: one BLS request, so the engine gets the whole round in one
  execute (sent as N requests in the same tick, they reached the engine in groups that took
  turns: Triton's queue hands the model what has arrived, not what was sent).
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

OPS = ("verify", "draft", "speculate")


class _Barrier:
    def __init__(self, op: str, send: Callable, expected: Callable[[], int], window_frac: float, max_window: float):
        self.op, self.send, self.expected = op, send, expected
        self.window_frac, self.max_window = window_frac, max_window
        self.pending: list[tuple[object, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.latency = 0.0  # EMA of this op's round trip, seconds
        self.in_flight: asyncio.Task | None = None  # the message being served (held: the loop keeps tasks weakly)

    async def __call__(self, call):
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((call, fut))
        if self.in_flight is None:
            self._schedule()
        return await fut

    def _schedule(self) -> None:
        """Nothing in flight: send now if every sequence is here, else after the window."""
        if not self.pending:
            return
        if len(self.pending) >= self.expected():
            self._flush()
        elif self.timer is None:
            window = min(self.max_window, self.window_frac * self.latency)
            self.timer = asyncio.get_running_loop().call_later(window, self._flush)

    def _flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        # a caller that went away (its request ended or was cancelled) must not reach the engine:
        # its call would recreate a sequence the engines have already released
        batch, self.pending = [(c, f) for c, f in self.pending if not f.done()], []
        if batch:
            self.in_flight = asyncio.ensure_future(self._run(batch))

    async def _run(self, batch: list[tuple[object, asyncio.Future]]) -> None:
        t0 = time.perf_counter()
        try:
            results = await self.send(self.op, [call for call, _ in batch])
        except Exception as e:  # noqa: BLE001 - the message failed as a whole: every caller sees it
            results = [e] * len(batch)
        else:
            dt = time.perf_counter() - t0
            self.latency = dt if self.latency == 0 else 0.9 * self.latency + 0.1 * dt
        for (_, fut), r in zip(batch, results):
            if fut.done():
                continue
            if isinstance(r, Exception):  # one call's error reaches only its caller
                fut.set_exception(r)
            else:
                fut.set_result(r)
        self.in_flight = None
        self._schedule()  # the callers held meanwhile; this message's sequences join within the window


class CoalescingClient:
    """Wraps a WorkerClient with ``call_many(op, calls) -> results | exceptions in order``: verify,
    draft and speculate calls go through one barrier each."""

    def __init__(self, inner, expected: Callable[[], int], window_frac: float = 0.1, max_window: float = 0.05):
        self.inner = inner
        self._barriers = {op: _Barrier(op, inner.call_many, expected, window_frac, max_window) for op in OPS}

    async def verify(self, call):
        return await self._barriers["verify"](call)

    async def draft(self, call):
        return await self._barriers["draft"](call)

    async def speculate(self, call):
        return await self._barriers["speculate"](call)

    def __getattr__(self, name):  # fetch, fast_draft, release: straight through
        return getattr(self.inner, name)
