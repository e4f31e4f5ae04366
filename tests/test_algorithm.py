"""Unit tests of the engine-agnostic pieces: fan-out, candidates, n-gram backup, verification,
sampling, stopping, the round's K (the scheduler: test_scheduler.py, test_cost_model.py)."""
from __future__ import annotations

import torch

from ssd.algorithm.fanout import FanoutEstimator, geometric_fanout, uniform_fanout
from ssd.algorithm.ngram import propose
from ssd.algorithm.sampling import SamplingParams, probs_from_logits, saguaro
from ssd.algorithm.spec_cache import candidates
from ssd.algorithm.verification import verify
from ssd.decoding.stopping import StopChecker


def test_fanout_budgets_and_shape():
    assert uniform_fanout(3, 8) == [2, 2, 2, 2]
    assert sum(uniform_fanout(4, 11)) == 11
    g = geometric_fanout(4, 12, a=0.8, r=1.0)
    assert sum(g) == 12 and all(f >= 1 for f in g)
    assert g[0] >= g[1] >= g[2] >= g[3]  # earlier depths are likelier outcomes
    assert g[4] > g[3]  # full acceptance collects the capped tail
    assert geometric_fanout(4, 12, a=0.95, r=1.0)[4] > geometric_fanout(4, 12, a=0.5, r=1.0)[4]


def _round(source: str, accepted: int, drafted: int, hit=None, fanout=0):
    from ssd.algorithm.rounds import Choice, RoundRecord

    return RoundRecord(choice=Choice.SSD_NEURAL, reason="policy", k=drafted, budget=8, batch=1,
                       tokens=accepted + 1, seconds=0.1, source=source, drafted=drafted, hit=hit,
                       fanout_at_outcome=fanout)


def test_fanout_reads_the_cost_models_acceptance_and_fits_its_exponent():
    """One acceptance estimate: the fan-out's a is the cost model's for the drafter's drafts (SD's
    until a cached draft is verified, the cache's after); r is fitted from the lookups."""
    from ssd.decoding.generator import SharedState

    s = SharedState()
    est, accept = s.estimator, s.policy.model.accept
    assert est.a == accept["neural"].alpha  # the prior, before any round
    for _ in range(200):
        s.learner.observe(_round("draft", 3, 4))  # SD: 3 accepted then a rejection
    assert abs(est.a - 0.75) < 1e-3 and est.a == accept["neural"].alpha
    for _ in range(200):
        s.learner.observe(_round("cache", 1, 4))  # cached drafts: 1 accepted then a rejection
    assert abs(est.a - 0.5) < 1e-3 and est.a == accept["cache"].alpha
    for f, miss in ((1, 0.5), (4, 1 / 16)):  # miss ~ F^-r: 0.5 -> 1/16 as F goes 1 -> 4 means r = 1.5
        for i in range(80):
            s.learner.observe(_round("cache", 1, 4, hit=(i % int(round(1 / miss))) != 0, fanout=f))
    assert abs(est.r - 1.5) < 0.1
    assert FanoutEstimator().a == 0.8  # standing alone: its prior


def test_candidates_exclude_the_drafted_token():
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]])
    keys = candidates(probs, draft=[0, 3], fanout=[2, 1, 2])
    assert keys == [(0, 1), (0, 2), (1, 2), (2, 0), (2, 1)]


def test_ngram_finds_the_latest_repeat():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    assert propose(toks, 2) == [5, 7]
    assert propose([4, 4, 4], 3) == [4, 4, 4]
    assert propose([1, 2, 3], 2) == [3, 3]  # no repeat: last token, the cheapest guess


def test_greedy_verify_outcomes():
    logits = torch.full((4, 6), -5.0)
    for row, tok in enumerate([2, 3, 1, 5]):
        logits[row, tok] = 5.0
    g = SamplingParams()
    assert verify(logits, [2, 3, 1], None, g, None).key == (3, 5)
    assert verify(logits, [2, 4, 1], None, g, None).key == (1, 3)
    assert verify(logits[:1], [], None, g, None).key == (0, 2)


def test_sampling_transforms_and_saguaro():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    p = probs_from_logits(logits, SamplingParams(temperature=0.7, top_k=3))
    assert p[0, 3] == 0 and p[0, 4] == 0 and abs(float(p.sum()) - 1) < 1e-6
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert (p[0] > 0).sum() == 1  # the top token alone already has >= 50% of the mass
    q = torch.tensor([0.5, 0.3, 0.2])
    q2 = saguaro(q, torch.tensor([0]), 0.5)
    assert torch.allclose(q2, torch.tensor([0.25, 0.3, 0.2]) / 0.75)
    assert torch.equal(saguaro(q, torch.tensor([0, 1, 2]), 0.0), q)  # nothing left: q unchanged


def test_stop_checker_streams_the_final_text_exactly():
    vocab = {1: "ab", 2: "c", 3: "STO", 4: "P", 5: "z", 9: "<eos>"}

    def dec(ids):
        return "".join(vocab[i] for i in ids if i != 9)

    c = StopChecker(dec, max_tokens=100, eos_ids={9}, stop=["STOP"])
    streamed = ""
    for block in ([1, 2], [3], [4, 5, 5]):
        done = c.push(block)
        streamed += c.delta()
        if done:
            break
    streamed += c.delta()
    assert c.finish_reason == "stop" and c.text == "abc" and streamed == "abc"
    c = StopChecker(dec, max_tokens=3, eos_ids={9})
    assert c.push([1, 2, 5, 5]) and c.tokens == [1, 2, 5] and c.finish_reason == "length"
    c = StopChecker(dec, max_tokens=10, eos_ids={9})
    assert c.push([1, 9, 2]) and c.tokens == [1] and c.finish_reason == "stop"


def test_round_k_keeps_verify_rows_within_max_verify_rows():
    from ssd.decoding.generator import SharedState

    seen = []
    s = SharedState(max_verify_rows=32, on_active=seen.append)
    s.add_active(1)
    s.add_active(1)
    s.add_active(-1)
    assert s.active == 1 and seen == [1, 2, 1]  # the server's gauge hears every change of the one count
    for active, k in ((1, 4), (6, 4), (7, 3), (8, 3), (10, 2), (16, 1), (40, 1)):
        s.active = active
        assert s.round_k(4) == k
        assert active * (k + 1) <= 32 or k == 1
    s.max_verify_rows, s.active = 0, 16  # no limit
    assert s.round_k(4) == 4
