"""The round barrier that lets concurrent sequences share engine forwards (decoding/coalescer.py)."""
from __future__ import annotations

import asyncio
import time

from ssd.decoding.coalescer import CoalescingClient


class Engine:
    """A fake engine process that records the messages it received (each a list of calls)."""

    def __init__(self, step: float):
        self.step, self.sent = step, []

    def answer(self, call):
        return f"ok {call}"

    async def call_many(self, op, calls):
        self.sent.append(list(calls))
        await asyncio.sleep(self.step)
        return [self.answer(c) for c in calls]

    async def release(self, seq_id):
        return seq_id


def test_staggered_sequences_are_sent_together():
    async def main():
        eng = Engine(0.05)
        client = CoalescingClient(eng, expected=lambda: 2, window_frac=1.0, max_window=1.0)

        async def seq(name, delay):
            out = []
            await asyncio.sleep(delay)
            for i in range(3):
                out.append(await client.verify(f"{name}{i}"))
                await asyncio.sleep(0.01 if name == "a" else 0.03)  # different turnaround per sequence
            return out

        a, b = await asyncio.gather(seq("a", 0.0), seq("b", 0.02))
        return eng.sent, a, b

    sent, a, b = asyncio.run(main())
    assert a == ["ok a0", "ok a1", "ok a2"] and b == ["ok b0", "ok b1", "ok b2"]  # each gets its own result
    # a0 leaves alone (no latency measured yet: no window); b0 comes while a0 is in flight, so it
    # waits and leaves with a's next call; from then on the two travel together
    assert sent == [["a0"], ["b0", "a1"], ["a2", "b1"], ["b2"]]


def test_a_lone_or_late_peer_does_not_block():
    async def main():
        eng = Engine(0.01)
        client = CoalescingClient(eng, expected=lambda: 3, window_frac=0.5, max_window=0.02)
        t0 = time.perf_counter()
        r = await client.verify("x")  # expected 3, only one comes: flushed after the window
        return r, time.perf_counter() - t0, await client.release("s")

    r, dt, rel = asyncio.run(main())
    assert r == "ok x" and dt < 0.5 and rel == "s"  # release passes straight through


def test_errors_reach_only_their_caller():
    class Failing(Engine):
        def answer(self, call):  # the engine reports a failed call in its place in the message
            return RuntimeError("boom") if call == "bad" else super().answer(call)

    async def main():
        eng = Failing(0.01)
        client = CoalescingClient(eng, expected=lambda: 2)
        out = await asyncio.gather(client.verify("bad"), client.verify("good"), return_exceptions=True)
        return eng.sent, out

    sent, (bad, good) = asyncio.run(main())
    assert sent == [["bad", "good"]]  # one message, two outcomes
    assert isinstance(bad, RuntimeError) and good == "ok good"


def test_a_failed_message_fails_each_of_its_callers():
    class Down(Engine):
        async def call_many(self, op, calls):
            raise ConnectionError("engine process gone")

    async def main():
        client = CoalescingClient(Down(0.01), expected=lambda: 2)
        return await asyncio.gather(client.speculate("a"), client.speculate("b"), return_exceptions=True)

    assert all(isinstance(r, ConnectionError) for r in asyncio.run(main()))
