"""Free drafts on real models (SmolLM2-135M, fp32 target): lookup rounds give the target's own
greedy tokens, from the sequence's own text and from the suffix cache of earlier requests; a
request switching between lookup, neural and AR rounds stays exact; a repeated request drafts
from the cache and takes fewer rounds. Sampled exactness: test_sampling_exactness.py ("lookup")."""
from __future__ import annotations

import asyncio

from conftest import PROMPTS
from decoding_clients import generate, local_client
from policy_setup import CyclingPolicy


def lookup_state(policy=None, cache_tokens: int = 65536, **kw):
    from ssd.algorithm.scheduler import Scheduler
    from ssd.algorithm.suffix_cache import SuffixCache
    from ssd.decoding.generator import SharedState

    return SharedState(policy=policy or Scheduler(forced_mode="lookup"), free_drafts=True,
                       suffix_cache=SuffixCache(cache_tokens) if cache_tokens else None, **kw)


def lookup_rounds(stats) -> list[int]:
    return [t for t, src in zip(stats.tokens_per_round, stats.source_per_round) if src == "lookup"]


def test_lookup_rounds_are_exact_and_a_repeated_request_drafts_from_the_cache(engines, codec, ar_outputs):
    from ssd.decoding.generator import DecodeConfig

    client = local_client(engines, "strong")
    shared = lookup_state()
    for prompt, ref in zip(PROMPTS, ar_outputs):
        first, g1 = asyncio.run(generate(client, codec.encode_prompt(prompt), DecodeConfig(), seq="a", shared=shared))
        assert first == ref, f"lookup rounds diverged on {prompt!r}"
        assert set(g1.stats.source_per_round) == {"lookup"}
        # the same request again: the cache holds its whole answer, drafts run long and are accepted
        again, g2 = asyncio.run(generate(client, codec.encode_prompt(prompt), DecodeConfig(), seq="b", shared=shared))
        assert again == ref
        assert g2.stats.rounds < g1.stats.rounds and max(lookup_rounds(g2.stats)) >= 8
    assert shared.suffix_cache.tokens > 0 and not shared.lookup  # every request left its estimate


def test_lookup_without_the_cache_drafts_from_the_sequence_only(engines, codec, ar_outputs):
    from ssd.decoding.generator import DecodeConfig

    client = local_client(engines, "weak")
    shared = lookup_state(cache_tokens=0)
    prompt = PROMPTS[3]
    out, g1 = asyncio.run(generate(client, codec.encode_prompt(prompt), DecodeConfig(), seq="a", shared=shared))
    out2, g2 = asyncio.run(generate(client, codec.encode_prompt(prompt), DecodeConfig(), seq="b", shared=shared))
    assert out == out2 == ar_outputs[3]
    assert g2.stats.tokens_per_round == g1.stats.tokens_per_round  # nothing carried over between requests


def test_a_request_switching_between_lookup_neural_and_ar_rounds_is_exact(engines, codec, ar_outputs):
    from ssd.decoding.generator import DecodeConfig

    client = local_client(engines, "weak")
    order = ["lookup", "ssd+neural", "ssd+neural", "lookup", "sd", "ar", "lookup", "ssd+fast", "ssd+neural"]
    kinds = set()
    for i, (prompt, ref) in enumerate(zip(PROMPTS, ar_outputs)):
        shared = lookup_state(CyclingPolicy(order[i % 3:] + order[:i % 3], [3, 1, 7, 2]))
        shared.suffix_cache.add(codec.encode_prompt(prompt) + ref[:16])  # a cache that knows part of it
        out, g = asyncio.run(generate(client, codec.encode_prompt(prompt), DecodeConfig(k=4), shared=shared))
        assert out == ref, f"switching rounds diverged on {prompt!r}"
        kinds |= set(g.stats.source_per_round)
        # the drafter catches up after lookup and AR rounds: its rounds after them were drafted
        assert g.drafter_len > 0
    assert {"lookup", "cache", "neural", "fast", "draft", "none"} <= kinds


def test_ssd_misses_draft_the_verified_outcomes_lookup_branch(engines, codec, ar_outputs):
    """SSD's fast backup drafts from the free drafter after a miss (the lookup branch of the outcome
    the target verified): with a suffix cache that knows the answer its rounds are accepted far,
    where the same request opted out of free drafts gets the n-gram worker's drafts; both exact."""
    from ssd.decoding.generator import DecodeConfig

    client = local_client(engines, "weak")
    fast = {True: [], False: []}
    for prompt, ref in zip(PROMPTS, ar_outputs):
        ids = codec.encode_prompt(prompt)
        for free in (True, False):
            shared = lookup_state(CyclingPolicy(["ssd+fast"]))
            shared.suffix_cache.add(ids + ref)
            cfg = DecodeConfig(k=4, backup="fast", free_drafts=free)
            out, g = asyncio.run(generate(client, ids, cfg, shared=shared))
            assert out == ref, f"ssd+fast (free drafts {free}) diverged on {prompt!r}"
            fast[free] += [t for t, src in zip(g.stats.tokens_per_round, g.stats.source_per_round) if src == "fast"]
    assert fast[True] and fast[False]
    assert sum(fast[True]) / len(fast[True]) > sum(fast[False]) / len(fast[False])
    assert max(fast[True]) == 5  # a lookup branch accepted whole: K = 4 drafts and the target's token
