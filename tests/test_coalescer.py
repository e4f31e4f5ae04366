"""The round barrier that lets concurrent sequences share engine forwards (decoding/coalescer.py)."""
from __future__ import annotations

import asyncio
import time

from ssd.decoding.coalescer import CoalescingClient


class Engine:
    """A fake engine that records which calls were sent in the same event-loop tick."""

    def __init__(self, step: float):
        self.step, self.sent = step, []

    async def verify(self, call):
        self.sent.append((round(time.perf_counter(), 3), call))
        await asyncio.sleep(self.step)
        return f"ok {call}"

    draft = speculate = verify

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
    # round 0: no latency measured yet, so no window (b came 20 ms late); from then on aligned
    assert len({t for t, c in sent if c in ("a0", "b0")}) == 2
    for i in (1, 2):  # round i of both sequences left in the same tick
        times = {t for t, c in sent if c in (f"a{i}", f"b{i}")}
        assert len(times) == 1, sent


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
        async def verify(self, call):
            if call == "bad":
                raise RuntimeError("boom")
            return await super().verify(call)

    async def main():
        client = CoalescingClient(Failing(0.01), expected=lambda: 2)
        return await asyncio.gather(client.verify("bad"), client.verify("good"), return_exceptions=True)

    bad, good = asyncio.run(main())
    assert isinstance(bad, RuntimeError) and good == "ok good"
