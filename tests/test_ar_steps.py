"""Multi-step AR (ServerConfig.ar_steps): an AR round asks the target for several tokens in one
call and gets the tokens of one-step rounds, greedy and sampled, never past max_tokens, stopping
after an end token, batched beside verifies."""
from __future__ import annotations

import asyncio

import pytest

from conftest import PROMPTS
from decoding_clients import N_TOKENS, VerifyLog, generate, local_client


@pytest.mark.parametrize("steps", [2, 5])
def test_ar_steps_decode_the_target_tokens_in_fewer_calls(engines, codec, ar_outputs, steps):
    """An AR round of several steps (ServerConfig.ar_steps) gives the tokens of one-step rounds, in
    about 1/steps of the target calls, and never decodes past the request's max_tokens."""
    from ssd.decoding.generator import DecodeConfig, SharedState

    for prompt, ref in zip(PROMPTS, ar_outputs):
        client = VerifyLog(local_client(engines, "strong"))
        n = N_TOKENS - 1  # not a multiple of either step count: the last round is cut to fit
        ids = codec.encode_prompt(prompt)
        out, g = asyncio.run(generate(client, ids, DecodeConfig(mode="ar"), n=n, seq="steps",
                                       shared=SharedState(ar_steps=steps)))
        assert out == ref[:n]
        asked = [c.steps for c, _ in client.calls]
        got = [1 + len(r.decoded) for _, r in client.calls]
        assert asked[0] == 1  # the prefill's call is a single step
        assert sum(got) == n  # no call decodes past max_tokens
        # a call stops early only after an end token (take() itself goes on past them)
        ends = sum(t in engines["target"].eos_ids for t in ref[1:n - 1])
        assert 1 + -(-(n - 1) // steps) <= len(asked) <= 1 + -(-(n - 1) // steps) + ends
        assert g.stats.rounds == n - 1 and g.stats.tokens_per_round == [1] * (n - 1)


def test_ar_steps_sample_as_one_step_rounds(engines, codec):
    """Sampled AR: step s of a round samples with round + s's randomness, so a seed gives the same
    tokens whatever ar_steps is."""
    from ssd.algorithm.sampling import SamplingParams
    from ssd.decoding.generator import DecodeConfig, SharedState

    ids = codec.encode_prompt(PROMPTS[2])
    outs = [asyncio.run(generate(local_client(engines, "strong"), ids, DecodeConfig(mode="ar"), seq="sampled",
                                  params=SamplingParams(1.0), seed=7, shared=SharedState(ar_steps=s)))[0]
            for s in (1, 3, 8)]
    assert outs[0] == outs[1] == outs[2]
    assert outs[0] != asyncio.run(generate(local_client(engines, "strong"), ids, DecodeConfig(mode="ar"), seq="sampled",
                                            params=SamplingParams(1.0), seed=8))[0]


def test_target_steps_stop_at_an_end_token_and_batch_with_verifies(engines, codec, ar_outputs):
    """In one batched call: an AR call of 8 steps stops right after an end-of-sequence token, and
    a verify of a draft beside it gets what it gets alone."""
    from ssd.workers.protocol import VerifyCall
    from ssd.workers.target import TargetWorker

    target = engines["target"]
    worker = TargetWorker(target)
    ids, ref = codec.encode_prompt(PROMPTS[0]), ar_outputs[0]
    other, ref2 = codec.encode_prompt(PROMPTS[1]), ar_outputs[1]
    draft = ref2[1:4] + [ref2[4] + 1]  # three right, then a wrong one
    alone = worker.verify([VerifyCall("b", other + ref2[:1], draft)])[0]
    eos = target.eos_ids
    try:
        target.eos_ids = eos | {ref[3]}
        a, b = worker.verify([VerifyCall("a", ids, [], steps=8), VerifyCall("b", other + ref2[:1], draft)])
    finally:
        target.eos_ids = eos
        worker.release("a")
        worker.release("b")
    assert a.decoded + [a.token] == ref[:4]
    assert (b.accepted, b.token, b.decoded) == (alone.accepted, alone.token, []) == (3, ref2[4], [])


def test_a_raised_waiting_flag_ends_a_multi_step_call_after_its_step(engines, codec, ar_outputs):
    """The target reads the orchestrator's waiting flag between steps: raised, an 8-step AR call
    returns after its first step (no end token, no max_tokens), and the calls after it still give
    the target's own tokens."""
    from ssd.workers.protocol import VerifyCall
    from ssd.workers.target import TargetWorker
    from ssd.workers.waiting import WaitingFlag

    flag = WaitingFlag()
    worker = TargetWorker(engines["target"], waiting=flag)
    ids, ref = codec.encode_prompt(PROMPTS[0]), ar_outputs[0]
    try:
        flag.raise_()
        cut = worker.verify([VerifyCall("w", ids, [], steps=8)])[0]
        flag.clear()
        rest = worker.verify([VerifyCall("w", ids + [cut.token], [], steps=8)])[0]
    finally:
        worker.release("w")
    assert (cut.decoded, cut.token) == ([], ref[0])
    assert rest.decoded + [rest.token] == ref[1:9]


class _SlowTarget:
    """The tiny target with each forward slowed down, so that a multi-step call is still running
    when a second request arrives; ``second_call`` is set at the first sequence's second forward
    (the first step of its second call: its first call is the prefill)."""

    def __init__(self, engine, pause: float):
        import threading

        self.engine, self.pause, self.calls = engine, pause, 0
        self.second_call = threading.Event()

    def extend(self, calls):
        import time

        if any(c.seq_id == "first" for c in calls):  # one forward a step
            self.calls += 1
            if self.calls >= 2:
                self.second_call.set()
        time.sleep(self.pause)
        return self.engine.extend(calls)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.parametrize("wired", [True, False])
def test_a_request_arriving_during_a_multi_step_call_cuts_it_short(engines, codec, ar_outputs, wired):
    """Served path in process: the coalescer raises the target's flag when a second request's first
    call arrives while the first request's 8-step AR call runs, so that call returns before its 8
    steps (without the flag wired, it runs all 8); both requests still get the target's tokens."""
    from ssd.decoding.coalescer import CoalescingClient
    from ssd.decoding.generator import DecodeConfig, SharedState
    from ssd.decoding.local_client import LocalClient
    from ssd.workers.drafter import DrafterWorker
    from ssd.workers.fast_backup import NgramWorker
    from ssd.workers.target import TargetWorker
    from ssd.workers.waiting import WaitingFlag

    flag = WaitingFlag()
    slow = _SlowTarget(engines["target"], pause=0.02)
    shared = SharedState(ar_steps=8)
    inner = LocalClient(TargetWorker(slow, waiting=flag), DrafterWorker(engines["strong"]), NgramWorker())
    client = VerifyLog(CoalescingClient(inner, expected=lambda: shared.active, waiting=flag if wired else None))
    ids_a, ids_b = codec.encode_prompt(PROMPTS[0]), codec.encode_prompt(PROMPTS[1])

    async def main():
        first = asyncio.create_task(generate(client, ids_a, DecodeConfig(mode="ar"), seq="first", shared=shared))
        await asyncio.to_thread(slow.second_call.wait, 30)
        second = await generate(client, ids_b, DecodeConfig(mode="ar"), seq="second", shared=shared)
        return (await first)[0], second[0]

    out_a, out_b = asyncio.run(main())
    assert out_a == ar_outputs[0] and out_b == ar_outputs[1]
    second_call = [(c, r) for c, r in client.calls if c.seq_id == "first"][1]
    call, result = second_call
    assert call.steps == 8
    eos = engines["target"].eos_ids
    assert not any(t in eos for t in result.decoded + [result.token])
    if wired:
        assert 1 + len(result.decoded) < 8
    else:
        assert 1 + len(result.decoded) == 8
