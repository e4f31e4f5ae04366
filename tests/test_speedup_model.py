"""Unit tests of the speedup model the policy decides from: the cost curves, the hit rate per
draft source, the tree budget, acceptance at any K and each choice's K (engine-free)."""
from __future__ import annotations

import torch

from ssd.algorithm.cost_model import StepCost
from ssd.algorithm.policy import CHOICES, ModePolicy

from policy_setup import measured_policy, verify_bound_policy


def test_cost_model_is_flat_then_linear():
    cost = StepCost()
    assert cost(8) == 0.0 and not cost.known
    cost.observe(8, 0.1)
    cost.observe(128, 1.0)
    assert cost(2) == 0.1  # below every measurement: weight-bound, flat
    assert abs(cost(68) - 0.55) < 1e-9  # between: linear interpolation
    assert abs(cost(256) - 2.0) < 1e-9  # beyond: linear in rows
    cost.observe(9, 0.3)  # same bucket as 8: a running mean, not a new point
    assert len(cost.buckets) == 2 and 0.1 < cost(8.2) < 0.3
    small = StepCost()
    small.observe(1, 0.08)
    small.observe(2, 0.1)
    # beyond only small forwards: weight-bound up to flat_rows, then linear from there
    assert small(5) == small(32) == 0.1 and abs(small(64) - 0.2) < 1e-9


def test_policy_fast_backup_and_b_star():
    pol = measured_policy(drafter_scale=0.5)  # speculation fits inside a verify
    b = pol.b_star(4, 8)
    r1 = pol.rates(1, 4, 8)
    assert r1["ssd+neural"] > r1["ssd+fast"]
    assert b is not None and b > 1  # the whole batch waits on any miss: the free backup wins at b*
    rb, rprev = pol.rates(b, 4, 8), pol.rates(b - 1, 4, 8)
    assert rb["ssd+fast"] > rb["ssd+neural"] and rprev["ssd+fast"] <= rprev["ssd+neural"]
    forced = ModePolicy(forced_backup="fast")
    assert forced.choose(1, 4, 8, ("ssd+neural", "ssd+fast")).choice == "ssd+fast"


def test_hit_rate_is_learned_per_draft_source():
    """An n-gram draft is mostly rejected at once, an outcome the speculation covers: its rounds hit
    far more often than those verifying a model-quality draft. With the fast backup a miss leads to
    an n-gram round, a hit to a model-quality one, so its share of hit rounds is p_f / (1 - p_m + p_f).
    Learning one rate from whichever backup ran under-rates the other (the neural backup's 0.5 kept
    the fast backup looking no better, and the policy stayed with the slower one)."""
    pol = measured_policy(e_draft=3.6, e_hit=3.6, p_hit=0.5, drafter_scale=1.1)
    pol.hysteresis = 0.0
    both = ("ssd+neural", "ssd+fast")
    assert pol.choose(1, 4, 8, both).choice == "ssd+neural"  # one rate for both: neural looks best
    for i in range(200):
        pol.model.observe_lookup("cache", i % 2 == 0)  # model-quality drafts: half hit
        pol.model.observe_lookup("neural", i % 2 == 0)
        pol.model.observe_lookup("fast", i % 5 != 0)  # n-gram drafts: 4 in 5 hit
    p_m, p_f = pol.model.p_hit["model"].value, pol.model.p_hit["fast"].value  # running means: near 0.5 and 0.8
    assert abs(p_m - 0.5) < 0.08 and abs(p_f - 0.8) < 0.08
    assert pol.model.hit_share("neural") == p_m and abs(pol.model.hit_share("fast") - p_f / (1 - p_m + p_f)) < 1e-12
    assert pol.choose(1, 4, 8, both).choice == "ssd+fast"


def test_tree_budget_shrinks_when_branches_stop_being_free():
    pol = measured_policy()
    assert pol.model.tree_budget(1, 4, 8) == 8 and pol.model.tree_budget(1, 4, 16) == 16  # weight-bound: branches ride free
    # batch 16, K = 1: 16 x 8 = 128 tree rows cost the drafter 0.3 s over the 32-row minimum, far
    # more than a quarter of the verify (0.33 s); 16 x 3 = 48 rows cost 0.05 s more, 16 x 4 0.1 s
    assert pol.model.tree_budget(16, 1, 8) == 3
    assert pol.model.tree_budget(64, 4, 8) == 5  # never below one branch per depth (K + 1)
    assert pol.model.rates(16, 1, 3)["ssd+fast"] > pol.model.rates(16, 1, 8)["ssd+fast"]
    assert ModePolicy().model.tree_budget(16, 1, 8) == 8  # nothing measured yet: the request's budget


def test_acceptance_predicts_tokens_per_round_at_any_k():
    """Learned from rounds of K = 4, the acceptance predicts rounds of K = 1 too (a round capped to
    K = 1 yields at most 2 tokens, not the 3.4 of K = 4)."""
    from ssd.algorithm.estimators import Acceptance

    g = torch.Generator().manual_seed(0)
    acc, alpha, seen = Acceptance(0.3), 0.8, []
    for i in range(3000):
        accepted = 0
        while accepted < 4 and torch.rand(1, generator=g).item() < alpha:
            accepted += 1
        acc.update(accepted, 4)
        if i >= 500:  # past the prior: a running estimate (~40 rounds), so average its readings
            seen.append((acc.alpha, acc.tokens(4), acc.tokens(1)))
    mean = [sum(x) / len(seen) for x in zip(*seen)]
    assert abs(mean[0] - alpha) < 0.03
    assert abs(mean[1] - sum(alpha ** i for i in range(5))) < 0.15
    assert abs(mean[2] - 1.8) < 0.03


def test_each_choice_drafts_the_k_that_predicts_the_most():
    # tree rows cost 2 ms each: a speculation of K steps over 12 branches outlasts the verify from
    # K = 2 on, so SSD drafts less than the request's K = 4, and gains over SSD at K = 4
    pol = verify_bound_policy(0.002)
    ks = pol.model.best_k(1, 4, 12)
    assert ks["ssd+neural"] < 4
    at_4 = pol.model.rates(1, 4, pol.model.tree_budget(1, 4, 12))["ssd+neural"]
    k = ks["ssd+neural"]
    assert pol.model.rates(1, k, pol.model.tree_budget(1, k, 12))["ssd+neural"] > at_4 * (1 + pol.model.k_margin)
    adaptive = pol.rates(1, 4, 12, ks)
    assert adaptive["ssd+neural"] > pol.rates(1, 4, pol.model.tree_budget(1, 4, 12))["ssd+neural"]
    d = pol.choose(1, 4, 12, adaptive_k=True)
    assert d.ks == ks and d.rates == adaptive
    assert pol.choose(1, 4, 12).ks == {}  # a round opened without adaptive_k: every choice at the request's K
    # free drafter rows: the speculation fits inside the verify at every K, so the longest K wins
    free = verify_bound_policy(0.0)
    free.model.drafter = StepCost()
    free.model.drafter.observe(1, 0.001)
    assert free.model.best_k(1, 4, 12)["ssd+neural"] == 4 and free.model.best_k(1, 4, 12)["sd"] == 4
    assert ModePolicy().model.best_k(1, 4, 12) == {c: 4 for c in CHOICES}  # nothing measured: the request's K
