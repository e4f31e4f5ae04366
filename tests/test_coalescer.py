"""The round barrier that lets concurrent sequences share engine forwards (decoding/coalescer.py)."""
from __future__ import annotations

import asyncio
import os
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


class Timeline(Engine):
    """A fake pair of engine processes that records when each message ran: (op, start, end)."""

    def __init__(self, step: float):
        super().__init__(step)
        self.spans = []

    async def call_many(self, op, calls):
        t0 = time.perf_counter()
        out = await super().call_many(op, calls)
        self.spans.append((op, t0, time.perf_counter()))
        return out


def _call(seq, threads):
    from ssd.workers.protocol import VerifyCall
    return VerifyCall(seq, [1, 2], [], threads=threads)


def _overlap(a, b):
    return a[1] < b[2] and b[1] < a[2]


def test_a_wide_message_owns_the_cores_and_split_messages_share_them():
    """Sequences whose rounds drifted apart: one verifies on both cores while another drafts on
    both. The two messages take turns; on the split layout the two engines run side by side."""
    async def main(threads):
        eng = Timeline(0.05)
        client = CoalescingClient(eng, expected=lambda: 1)
        await asyncio.gather(client.verify(_call("a", threads)), client.draft(_call("b", threads)),
                             client.speculate(_call("c", 0)) if not threads else asyncio.sleep(0))
        return eng.spans

    wide = asyncio.run(main(2))
    assert [op for op, *_ in wide] == ["verify", "draft"] and not _overlap(*wide)
    split = asyncio.run(main(0))
    assert len(split) == 3 and all(_overlap(a, b) for a in split for b in split if a is not b)


def test_the_core_gate_serves_engines_in_turn():
    """A drafter message that waits for a wide verify goes next: verify messages that come after it
    (the other sequences' next steps) wait behind it, so neither engine starves the other."""
    from ssd.decoding.coalescer import CoreGate

    async def main():
        gate, order = CoreGate(), []

        async def message(name, key, start, hold):
            await asyncio.sleep(start)
            await gate.enter(key)
            order.append((name, "in"))
            await asyncio.sleep(hold)
            order.append((name, "out"))
            gate.leave()

        await asyncio.gather(message("v1", "target", 0.0, 0.05), message("d1", "drafter", 0.01, 0.05),
                             message("v2", "target", 0.02, 0.05), message("s1", "split", 0.03, 0.01),
                             message("s2", "split", 0.03, 0.01))
        return order, gate

    order, gate = asyncio.run(main())
    assert order[:4] == [("v1", "in"), ("v1", "out"), ("d1", "in"), ("d1", "out")]
    assert order[4:6] == [("v2", "in"), ("v2", "out")]
    assert sorted(order[6:8]) == [("s1", "in"), ("s2", "in")]  # split messages enter together
    assert gate.count == 0 and not gate.waiting


def test_a_caller_cancelled_at_the_gate_leaves_no_trace():
    from ssd.decoding.coalescer import CoreGate

    async def main():
        gate = CoreGate()
        await gate.enter("target")
        waiter = asyncio.ensure_future(gate.enter("drafter"))
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        gate.leave()
        await asyncio.wait_for(gate.enter("split"), 1.0)  # nobody holds or waits: in at once
        return gate

    gate = asyncio.run(main())
    assert gate.key == "split" and gate.count == 1 and not gate.waiting


def test_a_waiter_cancelled_before_it_runs_is_passed_over():
    """Cancelled in the same tick as the holder leaves: the gate skips it and admits the next."""
    from ssd.decoding.coalescer import CoreGate

    async def main():
        gate = CoreGate()
        await gate.enter("target")
        first = asyncio.ensure_future(gate.enter("drafter"))
        second = asyncio.ensure_future(gate.enter("split"))
        await asyncio.sleep(0.01)
        first.cancel()
        gate.leave()  # before the cancelled waiter has run its handler
        await asyncio.gather(first, return_exceptions=True)
        await asyncio.wait_for(second, 1.0)
        return gate, first

    gate, first = asyncio.run(main())
    assert first.cancelled() and gate.key == "split" and gate.count == 1 and not gate.waiting


def test_a_verify_call_waiting_for_a_verify_message_raises_the_flag_until_it_leaves():
    """The target's waiting flag (workers/waiting.py): raised when a verify call arrives while a
    verify message is in flight, lowered when the next verify message leaves; draft calls and a
    call that finds nothing in flight leave it down."""
    from ssd.workers.waiting import WaitingFlag

    flag = WaitingFlag()
    seen = []

    class Recorder(Engine):
        async def call_many(self, op, calls):
            seen.append((op, list(calls), flag.is_raised()))
            return await super().call_many(op, calls)

    async def main():
        eng = Recorder(0.05)
        client = CoalescingClient(eng, expected=lambda: 1, window_frac=0.0, max_window=0.0, waiting=flag)
        first = asyncio.ensure_future(client.verify("a0"))
        await asyncio.sleep(0.01)
        raised_before = flag.is_raised()
        draft = asyncio.ensure_future(client.draft("d0"))
        await asyncio.sleep(0.01)
        raised_by_draft = flag.is_raised()
        second = asyncio.ensure_future(client.verify("b0"))
        await asyncio.sleep(0.01)
        raised_by_verify = flag.is_raised()
        await asyncio.gather(first, draft, second)
        return raised_before, raised_by_draft, raised_by_verify, flag.is_raised()

    before, by_draft, by_verify, after = asyncio.run(main())
    assert (before, by_draft, by_verify, after) == (False, False, True, False)
    # each verify message left with the flag down: b0's message lowered it as it left
    assert [(op, calls, up) for op, calls, up in seen if op == "verify"] == [("verify", ["a0"], False),
                                                                             ("verify", ["b0"], False)]


def test_the_waiting_flag_is_shared_through_its_file(tmp_path):
    """Two processes' flags on one file (the orchestrator's and the target's) see each other."""
    from ssd.workers.waiting import WaitingFlag, flag_path

    a, b = WaitingFlag(tmp_path / "f"), WaitingFlag(tmp_path / "f")
    a.raise_()
    assert b.is_raised()
    b.clear()
    assert not a.is_raised()
    a.unlink()
    assert not (tmp_path / "f").exists()
    assert flag_path("target") != flag_path("other") and flag_path("target").name.endswith("target.waiting")


def test_flags_of_servers_that_are_gone_are_removed(tmp_path):
    """A killed server leaves its flag file; the next orchestrator removes those whose server
    process is gone and keeps a live server's."""
    import subprocess
    import sys

    from ssd.workers.waiting import remove_stale

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone, live = tmp_path / f"ssd-{dead.pid}-target.waiting", tmp_path / f"ssd-{os.getpid()}-target.waiting"
    for f in (gone, live):
        f.write_bytes(b"\0")
    assert remove_stale(tmp_path) == [gone]
    assert not gone.exists() and live.exists()
