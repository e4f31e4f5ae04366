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

A verify call that arrives while a verify message is in flight raises the target's waiting flag
(workers/waiting.py): a multi-step AR message ends after its step in progress instead of holding
the call for up to ``ar_steps`` forwards. The flag is lowered when the next verify message leaves.

A wide message (calls with ``threads`` > 0: one engine on every core) owns the cores: it waits
until no message of the other engine is in flight, and one of the other engine waits for it
(``CoreGate``). Split messages (target and drafter on a core each) run side by side. Without the
gate, sequences whose rounds drift apart (a new request's prefill, a cache miss) put both engines'
threads on the same two cores, and OpenMP's barriers made each message several times slower.
"""
from __future__ import annotations

import asyncio
import collections
import time
from typing import Callable

from ..workers.protocol import ROUTE
from ..workers.waiting import WaitingFlag

OPS = ("verify", "draft", "speculate")
SPLIT = "split"


def cores_key(op: str, calls) -> str:
    """What a message holds: every core for its engine when a call asks for threads, else its own."""
    return ROUTE[op] if any(getattr(c, "threads", 0) > 0 for c in calls) else SPLIT


class CoreGate:
    """Messages with the same key run together; a message of another key waits until none is in
    flight. First come, first served: a waiting message also holds back later ones, so neither
    engine starves the other."""

    def __init__(self):
        self.key: str | None = None
        self.count = 0
        self.waiting: collections.deque[tuple[str, asyncio.Future]] = collections.deque()

    async def enter(self, key: str) -> None:
        if not self.waiting and (self.count == 0 or self.key == key):
            self.key, self.count = key, self.count + 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((key, fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # admitted as it was cancelled: give the place back
                self.leave()
            elif (key, fut) in self.waiting:
                self.waiting.remove((key, fut))
                self._admit()
            raise

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.key = None
        self._admit()

    def _admit(self) -> None:
        while self.waiting and (self.count == 0 or self.key == self.waiting[0][0]):
            key, fut = self.waiting.popleft()
            if fut.done():  # its caller was cancelled and has not yet left the queue
                continue
            self.key, self.count = key, self.count + 1
            fut.set_result(None)


class _Barrier:
    def __init__(self, op: str, send: Callable, expected: Callable[[], int], window_frac: float, max_window: float,
                 gate: CoreGate, waiting: WaitingFlag | None = None):
        self.op, self.send, self.expected, self.gate = op, send, expected, gate
        self.waiting = waiting  # the engine's flag for "a call of this op waits" (verify only)
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
        elif self.waiting is not None:
            self.waiting.raise_()
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
            if self.waiting is not None:  # every waiting call leaves with this message
                self.waiting.clear()
            self.in_flight = asyncio.ensure_future(self._run(batch))

    async def _run(self, batch: list[tuple[object, asyncio.Future]]) -> None:
        calls = [call for call, _ in batch]
        await self.gate.enter(cores_key(self.op, calls))
        t0 = time.perf_counter()  # the latency (the window's measure) is the engine's, not the gate's wait
        try:
            results = await self.send(self.op, calls)
        except Exception as e:  # noqa: BLE001 - the message failed as a whole: every caller sees it
            results = [e] * len(batch)
        else:
            dt = time.perf_counter() - t0
            self.latency = dt if self.latency == 0 else 0.9 * self.latency + 0.1 * dt
        finally:
            self.gate.leave()
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

    def __init__(self, inner, expected: Callable[[], int], window_frac: float = 0.1, max_window: float = 0.05,
                 waiting: WaitingFlag | None = None):
        self.inner = inner
        self.gate = CoreGate()
        self._barriers = {op: _Barrier(op, inner.call_many, expected, window_frac, max_window, self.gate,
                                       waiting if op == "verify" else None)
                          for op in OPS}

    async def verify(self, call):
        return await self._barriers["verify"](call)

    async def draft(self, call):
        return await self._barriers["draft"](call)

    async def speculate(self, call):
        return await self._barriers["speculate"](call)

    def __getattr__(self, name):  # fetch, fast_draft, release: straight through
        return getattr(self.inner, name)
