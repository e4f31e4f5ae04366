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
