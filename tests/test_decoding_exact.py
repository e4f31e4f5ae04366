"""Greedy SD and SSD produce the target's own greedy tokens, for every configuration (fp32).

Also: the speculation cache hits exactly when the verified outcome (k, t*) was among the branches
the drafter pre-drafted, and EOS / max_tokens inside an accepted block end the output where AR does.
"""
from __future__ import annotations

import asyncio
import itertools

import pytest

from conftest import PROMPTS
from decoding_clients import VerifyLog, generate, local_client

CONFIGS = [  # (drafter, decode config): K, fan-out shape and budget, backup kind, C
    ("weak", dict(mode="sd", k=1)), ("strong", dict(mode="sd", k=4)), ("weak", dict(mode="sd", k=7)),
    ("strong", dict(mode="ssd", k=2, fanout_shape="uniform", fanout_budget=3, step_aside=False)),
    ("weak", dict(mode="ssd", k=4, fanout_shape="geometric", fanout_budget=8, step_aside=False)),
    ("weak", dict(mode="ssd", k=3, backup="fast", step_aside=False)),
    ("strong", dict(mode="ssd", k=3, backup="neural", step_aside=False)),
    ("weak", dict(mode="ssd", k=5, saguaro_c=0.0, fanout_budget=12, step_aside=False)),
    ("strong", dict(mode="ssd", k=4)),  # the policy picks SSD / SD / AR per round from what it measures
    ("int8", dict(mode="sd", k=3)), ("int8_full", dict(mode="ssd", k=4, step_aside=False)),  # int8 drafter weights
]


@pytest.mark.parametrize("drafter,cfg", CONFIGS,
                         ids=lambda c: c if isinstance(c, str) else "-".join(f"{k}={v}" for k, v in c.items()))
def test_greedy_equals_target(engines, codec, ar_outputs, drafter, cfg):
    from ssd.decoding.generator import DecodeConfig

    client = local_client(engines, drafter)
    rounds_with_drafts = 0
    for prompt, ref in zip(PROMPTS, ar_outputs):
        out, g = asyncio.run(generate(client, codec.encode_prompt(prompt), DecodeConfig(**cfg)))
        assert out == ref, f"{cfg} with {drafter} drafter diverged on {prompt!r}"
        rounds_with_drafts += g.stats.rounds
    assert rounds_with_drafts > 0


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_capped_round_k_is_exact(engines, codec, ar_outputs, mode):
    """With max_verify_rows = 3 a lone sequence drafts at most 2 tokens a round (K = 4 asked):
    shorter rounds, same tokens."""
    from ssd.decoding.generator import DecodeConfig, SharedState

    client = local_client(engines, "strong")
    for prompt, ref in zip(PROMPTS, ar_outputs):
        shared = SharedState(max_verify_rows=3)
        out, g = asyncio.run(generate(client, codec.encode_prompt(prompt),
                                       DecodeConfig(mode=mode, k=4, step_aside=False, adaptive_k=False), shared=shared))
        assert out == ref
        assert max(g.stats.tokens_per_round) == 3 and g.k == 2


def test_every_round_reaches_the_learner_as_one_record(engines, codec):
    """Each round hands one RoundRecord to the server's learner: the request's statistics, the
    cost model's estimates (hit rate per verified draft, acceptance per draft source) and the
    scheduler's record of the choice at this batch size all count the same rounds."""
    from ssd.algorithm.rounds import Choice
    from ssd.decoding.generator import DecodeConfig, SharedState

    client = local_client(engines, "strong")
    shared = SharedState()
    _, g = asyncio.run(generate(client, codec.encode_prompt(PROMPTS[1]),
                                 DecodeConfig(mode="ssd", k=3, backup="neural", step_aside=False), n=24, shared=shared))
    model, sources = shared.policy.model, g.stats.source_per_round
    assert g.stats.rounds == len(sources) > 0
    assert model.p_hit["model"].count == g.stats.hits + g.stats.misses == g.stats.rounds
    # a round's hit gives the next round its draft (the last round's hit has no next round)
    assert model.accept["cache"].count == sources.count("cache") > 0
    assert sources[1:].count("cache") <= g.stats.hits <= sources.count("cache") + 1
    assert model.accept["neural"].count == sources.count("neural")
    record = shared.policy.records[(Choice.SSD_NEURAL, 0)]
    assert record.tokens > 0 and record.seconds > 0 and 0 < record.weight <= g.stats.rounds


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_drafter_prefills_the_prompt_beside_the_target(engines, codec, mode):
    """A request that may draft has its prompt in the drafter's cache when the first token comes
    back (prefilled at the same time as the target's), not at its first draft; AR leaves the
    drafter alone."""
    from ssd.algorithm.sampling import SamplingParams
    from ssd.decoding.generator import DecodeConfig, Generation

    client = local_client(engines, "strong")
    prompt = codec.encode_prompt(PROMPTS[1])

    async def first_block():
        g = Generation(client, f"warm-{mode}", list(prompt), SamplingParams(), 0, DecodeConfig(mode=mode))
        agen = g.run()
        block = await agen.__anext__()
        cached = engines["strong"].cached_tokens(f"warm-{mode}")
        await agen.aclose()
        await client.release(f"warm-{mode}")
        return block, cached

    block, cached = asyncio.run(first_block())
    assert len(block) == 1
    assert cached == ([] if mode == "ar" else prompt)


def test_both_hits_and_misses_happen(engines, codec):
    """The exactness runs above exercise both paths: SSD with each drafter sees hits and misses."""
    from ssd.decoding.generator import DecodeConfig

    totals = {}
    for drafter in ("strong", "weak"):
        client = local_client(engines, drafter)
        hits = misses = 0
        for prompt in PROMPTS[:3]:
            _, g = asyncio.run(generate(client, codec.encode_prompt(prompt), DecodeConfig(mode="ssd", k=3, step_aside=False)))
            hits, misses = hits + g.stats.hits, misses + g.stats.misses
        totals[drafter] = (hits, misses)
    assert sum(h for h, _ in totals.values()) > 0 and sum(m for _, m in totals.values()) > 0, totals


def cycling_shared(order, ks=()):
    """Server state whose policy switches the choice every round, through ``order`` (and K through
    ``ks``, when given)."""
    from ssd.decoding.generator import SharedState

    from policy_setup import CyclingPolicy

    return SharedState(policy=CyclingPolicy(order, ks))


# every transition: ssd->ssd (a cached draft), ssd->sd (the cached draft serves SD), sd->ssd+fast,
# ssd->ar (the cached draft is dropped), ar->ssd, ssd+fast->sd, sd->ar, ar->ar
SWITCHES = ["ssd+neural", "ssd+neural", "sd", "ssd+fast", "ar", "ssd+neural", "ar", "ar", "ssd+fast", "sd", "ar"]


@pytest.mark.parametrize("drafter", ["strong", "weak"])
def test_switching_modes_between_rounds_is_exact(engines, codec, ar_outputs, drafter):
    from ssd.decoding.generator import DecodeConfig

    client = local_client(engines, drafter)
    seen = set()
    for i, (prompt, ref) in enumerate(zip(PROMPTS, ar_outputs)):
        shared = cycling_shared(SWITCHES[i % 3:] + SWITCHES[:i % 3])
        out, g = asyncio.run(generate(client, codec.encode_prompt(prompt), DecodeConfig(mode="ssd", k=3),
                                       shared=shared))
        assert out == ref, f"switching modes diverged on {prompt!r}"
        seen |= set(g.stats.to_dict()["rounds_by_choice"])
        assert set(g.stats.source_per_round) <= {"cache", "neural", "fast", "draft", "none"}
    assert seen == {"ssd+neural", "ssd+fast", "sd", "ar"}


def test_changing_k_between_ssd_rounds_is_exact(engines, codec, ar_outputs):
    """The scheduler's K per round (CostModel.best_k) moves up and down between SSD rounds: a cached
    draft from a longer K is cut, one from a shorter K is verified as it is; same tokens."""
    from ssd.decoding.generator import DecodeConfig

    client = local_client(engines, "strong")
    for prompt, ref in zip(PROMPTS, ar_outputs):
        shared = cycling_shared(["ssd+neural", "ssd+neural", "ssd+fast", "ssd+neural"], ks=[4, 1, 3, 2, 4, 4, 1])
        out, g = asyncio.run(generate(client, codec.encode_prompt(prompt), DecodeConfig(mode="ssd", k=4),
                                       shared=shared))
        assert out == ref, f"changing K diverged on {prompt!r}"
        assert set(g.stats.draft_lens) == {1, 2, 3, 4}
        assert g.stats.hits > 0  # cached drafts were used across K changes


@pytest.mark.parametrize("running,threads", [("ssd+neural", 0), ("ar@wide", 2), ("sd@wide", 2)])
def test_prefill_takes_the_layout_the_batch_runs(engines, codec, running, threads):
    """A new request's prompt is prefilled in the batch's current layout: split, beside the
    drafter's prefill on its own core; wide, on every core with the drafter left to prefill at its
    first draft (its threads would contend for the cores)."""
    from ssd.algorithm.sampling import SamplingParams
    from ssd.algorithm.scheduler import Scheduler
    from ssd.decoding.generator import DecodeConfig, Generation, SharedState

    client = VerifyLog(local_client(engines, "strong"))
    prompt = codec.encode_prompt(PROMPTS[2])
    seq = f"layout-{running}"
    shared = SharedState(policy=Scheduler(forced_mode=running), wide_threads=2)

    async def first_block():
        g = Generation(client, seq, list(prompt), SamplingParams(), 0, DecodeConfig(mode="ssd"), shared)
        agen = g.run()
        block = await agen.__anext__()
        cached = engines["strong"].cached_tokens(seq)
        await agen.aclose()
        await client.release(seq)
        return block, cached, g

    block, cached, g = asyncio.run(first_block())
    assert [c.threads for c, _ in client.calls] == [threads] and g.stats.to_dict()["prefill_threads"] == threads
    assert cached == ([] if threads else prompt)


class RecordingClient:
    """Wraps a client and records what speculate returned, per round."""

    def __init__(self, inner):
        self.inner, self.log = inner, []

    async def verify(self, call):
        return await self.inner.verify(call)

    async def speculate(self, call):
        r = await self.inner.speculate(call)
        self.log.append(("spec", call.draft, r.branches))
        return r

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_cache_hit_exactly_when_outcome_cached(engines, codec):
    from ssd.decoding.generator import DecodeConfig, Generation
    from ssd.algorithm.sampling import SamplingParams

    client = RecordingClient(local_client(engines, "strong"))
    prompt = codec.encode_prompt(PROMPTS[0])
    g = Generation(client, "hitcheck", prompt, SamplingParams(), 0, DecodeConfig(mode="ssd", k=3, fanout_budget=4, adaptive_k=False,
                                                                                step_aside=False))
    blocks = []

    async def run():
        async for block in g.run():
            blocks.append(block)
            if sum(map(len, blocks)) > 50:
                break
        await client.release("hitcheck")

    asyncio.run(run())
    specs = [e for e in client.log if e[0] == "spec"]
    # round i (i >= 1 of the SSD loop) verified specs[i].draft; its outcome is blocks[i+1]
    expected_hits = 0
    for i, (_, draft, branches) in enumerate(specs[: len(blocks) - 1]):
        block = blocks[i + 1]
        k, t = len(block) - 1, block[-1]
        assert block[:-1] == draft[:k]
        cached = (k, t) in branches
        expected_hits += cached
        if i + 1 < len(specs) and cached:  # a hit: the next draft is exactly the cached branch
            assert specs[i + 1][1] == branches[(k, t)]
    assert g.stats.hits == expected_hits


def _run_until_stop(client, codec, cfg, checker, seq: str) -> None:
    from ssd.algorithm.sampling import SamplingParams
    from ssd.decoding.generator import Generation

    async def run():
        g = Generation(client, seq, codec.encode_prompt(PROMPTS[0]), SamplingParams(), 0, cfg)
        async for block in g.run():
            if checker.push(block):
                break
        await client.release(seq)

    asyncio.run(run())


@pytest.mark.parametrize("mode,k", [("ar", 0), ("sd", 4), ("ssd", 4)])
def test_stops_inside_accepted_block(engines, codec, ar_outputs, mode, k):
    """EOS, max_tokens and stop strings cut the output exactly where AR would."""
    from ssd.decoding.generator import DecodeConfig
    from ssd.decoding.stopping import StopChecker

    client = local_client(engines, "strong")
    ref = ar_outputs[0]
    cfg = DecodeConfig(mode=mode, k=max(k, 1))
    for max_tokens, eos in itertools.product([1, 2, 5, 13], [None, ref[7]]):
        checker = StopChecker(codec.decode, max_tokens, {eos} if eos is not None else set())
        _run_until_stop(client, codec, cfg, checker, "stop")
        cut = ref.index(eos) if eos is not None and eos in ref[:max_tokens] else max_tokens
        assert checker.tokens == ref[:min(cut, max_tokens)]
    stop_text = codec.decode(ref[:10])[-3:]
    checker = StopChecker(codec.decode, 40, set(), [stop_text])
    _run_until_stop(client, codec, cfg, checker, "stop2")
    full = codec.decode(ref)
    assert checker.text == full[: full.index(stop_text)]


def test_ngram_backup_beats_random_tokens(ar_outputs, codec):
    """The fast backup must accept more than random drafts would, on real model output."""
    import random

    from ssd.algorithm.ngram import propose

    rng = random.Random(0)
    k, ngram_acc, random_acc, rounds = 4, 0, 0, 0
    for prompt, out in zip(PROMPTS, ar_outputs):
        seq = codec.encode_prompt(prompt) + out
        start = len(seq) - len(out)
        for pos in range(start, len(seq) - k):
            truth = seq[pos:pos + k]

            def accepted(draft):
                return next((i for i, (a, b) in enumerate(zip(draft, truth)) if a != b), k)

            ngram_acc += accepted(propose(seq[:pos], k))
            random_acc += accepted([rng.randrange(len(codec.tokenizer.get_vocab())) for _ in range(k)])
            rounds += 1
    assert rounds > 50
    assert ngram_acc / rounds > random_acc / rounds + 0.05, (ngram_acc / rounds, random_acc / rounds)


class DyingDrafter:
    """A drafter whose process 'dies' after a few calls: every later call raises."""

    def __init__(self, inner, calls_before_death: int):
        self.inner, self.left = inner, calls_before_death

    def _maybe_die(self):
        self.left -= 1
        if self.left < 0:
            raise ConnectionError("drafter_primary is not available")

    def draft(self, calls):
        self._maybe_die()
        return self.inner.draft(calls)

    def speculate(self, calls):
        self._maybe_die()
        return self.inner.speculate(calls)

    def fetch(self, calls):
        self._maybe_die()
        return self.inner.fetch(calls)

    def release(self, seq_id):
        self.inner.release(seq_id)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_dead_drafter_degrades_without_corrupting(engines, codec, ar_outputs, mode):
    from ssd.decoding.generator import DecodeConfig
    from ssd.decoding.local_client import LocalClient
    from ssd.workers.drafter import DrafterWorker
    from ssd.workers.fast_backup import NgramWorker
    from ssd.workers.target import TargetWorker

    client = LocalClient(TargetWorker(engines["target"]), DyingDrafter(DrafterWorker(engines["strong"]), 3),
                         NgramWorker())
    # step_aside off: the policy must not answer the ssd request with AR rounds alone, which
    # would never call the drafter and so never see it die.
    cfg = DecodeConfig(mode=mode, k=3, step_aside=False)
    out, g = asyncio.run(generate(client, codec.encode_prompt(PROMPTS[0]), cfg))
    assert out == ar_outputs[0]
    assert "failed" in g.stats.degraded
