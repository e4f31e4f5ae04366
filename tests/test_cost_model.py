"""Unit tests of the cost model, the scheduler's prior: the cost curves, the hit rate per draft
source, the tree budget, acceptance at any K and each choice's K (engine-free)."""
from __future__ import annotations

import pytest
import torch

from ssd.algorithm.cost_model import CostModel, StepCost
from ssd.algorithm.rounds import Choice, RoundRecord
from ssd.algorithm.scheduler import Scheduler

from policy_setup import measured_scheduler, verify_bound_scheduler


def test_step_cost_is_flat_then_linear():
    cost = StepCost()
    assert cost(8) == 0.0 and not cost.known
    cost.observe(8, 0.1)
    assert cost(2) == cost(32) == 0.1 and abs(cost(64) - 0.2) < 1e-9  # one bucket: flat to flat_rows
    cost.observe(128, 1.0)
    assert cost(2) == 0.1  # below every measurement: weight-bound, flat
    assert abs(cost(68) - 0.55) < 1e-9  # between: linear interpolation
    assert abs(cost(256) - (1.0 + 0.9 / 120 * 128)) < 1e-9  # beyond: the last segment's cost per row
    cost.observe(8, 0.3)  # the same rows: a running mean, not a new point
    assert len(cost.buckets) == 2 and abs(cost(8) - 0.2) < 1e-9
    flat = StepCost()  # a bf16 engine: small forwards cost about one row
    flat.observe(1, 0.089)
    flat.observe(2, 0.089)
    assert flat(5) == flat(64) == 0.089
    rowwise = StepCost()  # an exact 4-bit target: every row computes (1 row 27 ms, 5 rows 107 ms)
    rowwise.observe(1, 0.027)
    rowwise.observe(5, 0.107)
    assert abs(rowwise(80) - (0.107 + 0.02 * 75)) < 1e-9  # 16 sequences x 5 verify rows: linear


def test_a_rounds_forwards_replace_the_calibrations_prior_at_once():
    """A calibration sample taken while the machine was busy prices one row at 87 ms; the rounds
    measure 28 ms. The first round's sample replaces the prior (an average with it would keep
    the price twice too high for rounds on end), then the rounds' samples are averaged."""
    cost = StepCost()
    cost.observe(1, 0.087, prior=True)
    cost.observe(5, 0.110, prior=True)
    assert abs(cost(1) - 0.087) < 1e-9
    cost.observe(1, 0.028)
    assert abs(cost(1) - 0.028) < 1e-9
    cost.observe(1, 0.032)
    assert abs(cost(1) - 0.030) < 1e-9  # two round samples: their mean
    assert abs(cost(5) - 0.110) < 1e-9  # a bucket no round measured keeps its prior


def test_a_forward_of_fewer_rows_costs_no_more_than_a_measured_larger_one():
    """A stale one-row price (a prior from a busy start) is capped by what a larger forward
    measured since: SD@wide rounds verifying 5 rows in 35 ms price an AR@wide step at 35 ms at
    most, not at the prior's 87 ms, before any AR@wide round ran."""
    model = CostModel()
    model.target.observe(1, 0.045, prior=True)
    model.drafter.observe(1, 0.010, prior=True)
    model.target_wide.observe(1, 0.087, prior=True)
    assert abs(model.rates(1, 4, 8)[Choice.AR_WIDE] - 1 / 0.087) < 1e-6
    model.target_wide.observe(5, 0.035)
    assert abs(model.rates(1, 4, 8)[Choice.AR_WIDE] - 1 / 0.035) < 1e-6
    assert abs(model.target_wide(3) - 0.035) < 1e-9  # between them: no dearer than the larger either


def test_sixteen_and_seventeen_rows_are_two_points_of_the_curve():
    """llama.cpp runs a call's rows in forwards of up to 16: 17 rows cost a forward more, a step
    the curve keeps (a bucket is an eighth of an octave)."""
    cost = StepCost()
    for rows, sec in ((1, 0.04), (16, 0.19), (17, 0.23)):
        cost.observe(rows, sec)
    assert len(cost.buckets) == 3
    assert abs(cost(16) - 0.19) < 1e-9 and abs(cost(17) - 0.23) < 1e-9


def test_ssd_steps_aside_as_the_batch_grows():
    model = measured_scheduler().model
    r1, r64 = model.rates(1, 4, 8), model.rates(64, 4, 8)
    assert max(r1, key=r1.get).mode == "ssd"  # free drafting on its own core, most outcomes pre-drafted
    assert max(r64, key=r64.get) in (Choice.SD, Choice.AR)  # the b*B-row tree no longer fits inside a verify
    poor = measured_scheduler(e_draft=1.1, e_hit=1.2, p_hit=0.3).model.rates(64, 4, 8)
    assert max(poor, key=poor.get) == Choice.AR  # poor drafts: draft rows are pure cost


def test_fast_backup_wins_from_b_star():
    model = measured_scheduler(drafter_scale=0.5).model  # speculation fits inside a verify
    b = model.b_star(4, 8)
    r1 = model.rates(1, 4, 8)
    assert r1[Choice.SSD_NEURAL] > r1[Choice.SSD_FAST]
    assert b is not None and b > 1  # the whole batch waits on any miss: the free backup wins at b*
    rb, rprev = model.rates(b, 4, 8), model.rates(b - 1, 4, 8)
    assert rb[Choice.SSD_FAST] > rb[Choice.SSD_NEURAL] and rprev[Choice.SSD_FAST] <= rprev[Choice.SSD_NEURAL]
    forced = Scheduler(forced_backup="fast")
    assert forced.choose(1, 4, 8, ("ssd+neural", "ssd+fast")).choice == Choice.SSD_FAST


def test_hit_rate_is_learned_per_verified_draft():
    """An n-gram draft is mostly rejected at once, an outcome the speculation covers: its rounds hit
    far more often than those verifying a model-quality draft. With the fast backup a miss leads to
    an n-gram round, a hit to a model-quality one, so its share of hit rounds is p_f / (1 - p_m + p_f)."""
    model = measured_scheduler(e_draft=3.6, e_hit=3.6, p_hit=0.5, drafter_scale=1.1).model
    r = model.rates(1, 4, 8)
    assert r[Choice.SSD_NEURAL] > r[Choice.SSD_FAST]  # one hit rate for both: the neural backup looks best
    for i in range(200):
        for source, hit in (("cache", i % 2 == 0), ("neural", i % 2 == 0), ("fast", i % 5 != 0)):
            model.learn(RoundRecord(Choice.SSD_FAST, "policy", 4, 8, 1, 2, 0.1, source, 4, hit))
    p_m, p_f = model.p_hit["model"].value, model.p_hit["fast"].value
    assert abs(p_m - 0.5) < 0.08 and abs(p_f - 0.8) < 0.08
    assert model.hit_share("neural") == p_m and abs(model.hit_share("fast") - p_f / (1 - p_m + p_f)) < 1e-12
    r = model.rates(1, 4, 8)
    assert r[Choice.SSD_FAST] > r[Choice.SSD_NEURAL]


def test_one_round_record_teaches_every_estimate():
    """Engine costs, acceptance per draft source (and the n-gram lookup's free score), the hit
    rate and the fast backup's time all come from the round's one record."""
    model = CostModel()
    rec = RoundRecord(Choice.SSD_FAST, "policy", 4, 8, 1, tokens=1, seconds=0.5, source="fast", drafted=4, hit=True,
                      target_timing=((5, 0.2),), drafter_timing=((40, 0.1),), draft_seconds=0.004,
                      ngram_accepted=0, ngram_drafted=4)
    model.learn(rec)
    assert model.target(5) == 0.2 and model.drafter(40) == 0.1
    assert model.accept["fast"].count == 1 and model.accept["fast"].alpha < 0.25  # the draft was rejected
    assert model.accept["neural"].count == model.accept["cache"].count == 0
    assert model.p_hit["fast"].count == 1 and model.p_hit["model"].count == 0
    assert model.t_fast.value == 0.004
    model.learn(RoundRecord(Choice.SD, "request", 4, 0, 1, 5, 0.5, "draft", 4, None, ngram_accepted=2, ngram_drafted=4))
    assert model.accept["neural"].count == 1 and model.accept["fast"].count == 2
    assert model.p_hit["model"].count == 0  # nothing was speculated


def test_tree_budget_shrinks_when_branches_stop_being_free():
    model = measured_scheduler().model
    assert model.tree_budget(1, 4, 8) == 8 and model.tree_budget(1, 4, 16) == 16  # weight-bound: branches ride free
    # batch 16, K = 1: 16 x 8 = 128 tree rows cost the drafter 0.3 s over the 32-row minimum, far
    # more than a quarter of the verify (0.33 s); 16 x 3 = 48 rows cost 0.05 s more
    assert model.tree_budget(16, 1, 8) == 3
    assert model.tree_budget(64, 4, 8) == 5  # never below one branch per depth (K + 1)
    assert model.rates(16, 1, 3)[Choice.SSD_FAST] > model.rates(16, 1, 8)[Choice.SSD_FAST]
    assert CostModel().tree_budget(16, 1, 8) == 8  # nothing measured yet: the request's budget


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
    s = verify_bound_scheduler(0.002)
    model = s.model
    ks = model.best_k(1, 4, 12)
    assert ks[Choice.SSD_NEURAL] < 4
    at_4 = model.rates(1, 4, model.tree_budget(1, 4, 12))[Choice.SSD_NEURAL]
    k = ks[Choice.SSD_NEURAL]
    assert model.rates(1, k, model.tree_budget(1, k, 12))[Choice.SSD_NEURAL] > at_4 * (1 + model.k_margin)
    d = s.choose(1, 4, 12, adaptive_k=True)
    assert d.ks == ks and d.rates[Choice.SSD_NEURAL] > s.estimates(1, 4, 12)[0][Choice.SSD_NEURAL]
    assert s.choose(1, 4, 12).ks == {}  # a round opened without adaptive_k: every choice at the request's K
    # free drafter rows: the speculation fits inside the verify at every K, so the longest K wins
    free = verify_bound_scheduler(0.0)
    free.model.drafter = StepCost()
    free.model.drafter.observe(1, 0.001)
    assert free.model.best_k(1, 4, 12)[Choice.SSD_NEURAL] == 4 and free.model.best_k(1, 4, 12)[Choice.SD] == 4


def test_wide_rounds_are_priced_from_their_own_curves():
    """Until a wide round is measured, SD and AR on every core are priced as on their own core (no
    gain assumed, so the bandit tries them); a wide round teaches the wide curves only."""
    model = measured_scheduler().model
    split_target, split_drafter = model.target(5), model.drafter(1)
    r = model.rates(1, 4, 8)
    assert r[Choice.SD_WIDE] == r[Choice.SD] and r[Choice.AR_WIDE] == r[Choice.AR]
    rec = RoundRecord(Choice.SD_WIDE, "policy", 4, 0, 1, tokens=4, seconds=0.5, source="draft", drafted=4, hit=None,
                      target_timing=((5, 0.6 * split_target),), drafter_timing=((1, 0.6 * split_drafter),) * 4)
    model.learn(rec)
    assert model.target(5) == split_target and model.drafter(1) == split_drafter
    wide = model.rates(1, 4, 8)
    assert abs(wide[Choice.SD_WIDE] / wide[Choice.SD] - 1 / 0.6) < 1e-6
    assert wide[Choice.AR_WIDE] > wide[Choice.AR]
    assert Choice.SD_WIDE.mode == "sd" and Choice.SD_WIDE.wide and not Choice.SD.wide
    assert Choice.SD.switch_is_free(Choice.SD_WIDE) and not Choice.SD.switch_is_free(Choice.SSD_NEURAL)
    # into AR is free (no draft, no drafter); out of it a drafting choice pays (after_catch_up prices it)
    assert Choice.SSD_NEURAL.switch_is_free(Choice.AR_WIDE) and not Choice.AR_WIDE.switch_is_free(Choice.SD_WIDE)


def test_a_wide_curve_keeps_the_split_curves_shape_where_unmeasured():
    """AR rounds on every core measure one-row wide forwards only; a verify on every core is then
    priced from the split curve's verify scaled by the measured wide/split ratio, not at one row's
    cost (an exact 4-bit target's 5-row verify costs about 4x its row on any number of cores)."""
    model = measured_scheduler().model
    model.target = StepCost()
    model.target.observe(1, 0.040)
    model.target.observe(5, 0.190)  # row-wise: every row computes
    model.target_wide.observe(1, 0.028)
    model.drafter = StepCost()
    model.drafter.observe(1, 0.005)  # cheap drafts: only the verify's price decides SD on every core
    assert abs(model.target_wide.along(model.target)(5) - 0.190 * 0.028 / 0.040) < 1e-9
    assert abs(model.target_wide.along(model.target)(1) - 0.028) < 1e-12 and model.target_wide(1) == 0.028
    r = model.rates(1, 4, 8)
    assert r[Choice.AR_WIDE] > r[Choice.SD_WIDE]  # the flat guess would have priced SD's verify at 28 ms
    unmeasured = StepCost()
    assert unmeasured.along(model.target) is model.target


def test_a_wide_curve_keeps_the_split_curves_step_between_its_measured_rows():
    """Calibrated at a few batch sizes only, the wide curve prices a lookup's 17-row verify from
    the split curve's shape between them: a forward dearer than 16 rows, as on one core."""
    split, wide = StepCost(), StepCost()
    for rows, sec in ((1, 0.040), (16, 0.220), (17, 0.260), (32, 0.440)):
        split.observe(rows, sec, prior=True)
    for rows, sec in ((1, 0.026), (32, 0.264)):
        wide.observe(rows, sec, prior=True)
    priced = wide.along(split)
    assert abs(priced(32) - 0.264) < 1e-12
    ratio17 = 0.65 + (0.6 - 0.65) * 16 / 31  # the wide/split ratio, 0.65 at 1 row and 0.6 at 32
    assert abs(priced(17) - 0.260 * ratio17) < 1e-12
    assert priced(17) - priced(16) > 0.5 * (0.260 - 0.220)  # the step, not a straight line


def test_ssd_glue_pass_prices_only_rows_the_drafter_has_not_run():
    """The drafter ran every draft token's row but the last while drafting it (a cached branch, the
    neural backup's draft), so SSD's glue pass is one row a sequence; after an n-gram draft (the
    fast backup's misses) it is K + 1."""
    model = CostModel()
    for rows, s in ((1, 0.010), (16, 0.160)):  # the drafter computes: 10 ms a row
        model.drafter.observe(rows, s)
        model.target.observe(rows, 0.1)  # a flat verify: 100 ms
    k, budget, e = 4, 8, model.accept["neural"].tokens(4)
    tree = k * model.drafter(budget)  # 4 steps of 8 rows: 320 ms
    r = model.rates(1, k, budget)
    p = model.hit_share("neural")
    assert r[Choice.SSD_NEURAL] == pytest.approx(e / (0.010 + tree + (1 - p) * k * 0.010))
    p = model.hit_share("fast")
    glue = model.drafter(1 + (1 - p) * k)
    tokens = p * e + (1 - p) * model.accept["fast"].tokens(k)
    assert r[Choice.SSD_FAST] == pytest.approx(tokens / (glue + tree + (1 - p) * model.t_fast.value))
