"""Unit tests of the mode policy and its estimates: its cost curves, rate formulas, calibration and measured records,
probes, dwell, the step-aside ladder and confirmation (engine-free: the engines' costs are fed in)."""
from __future__ import annotations

import torch

from ssd.algorithm.cost_model import StepCost
from ssd.algorithm.policy import CHOICES, ModePolicy


def _alpha(tokens_at_k4: float) -> float:
    """The per-position acceptance whose rounds of K = 4 yield ``tokens_at_k4`` tokens."""
    lo, hi = 0.0, 0.999
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(5)) < tokens_at_k4 else (lo, mid)
    return lo


def _policy(e_draft: float = 3.6, e_hit: float = 3.9, p_hit: float = 0.8, drafter_scale: float = 1.0):
    """A policy that has measured a bandwidth-bound-then-compute-bound target and drafter."""
    pol = ModePolicy()
    for rows, s in ((1, 0.30), (8, 0.30), (32, 0.33), (128, 1.2), (512, 4.8)):
        pol.model.target.observe(rows, s)
    for rows, s in ((1, 0.08), (8, 0.08), (32, 0.10), (128, 0.40), (512, 1.6)):
        pol.model.drafter.observe(rows, s * drafter_scale)
    pol.model.p_hit["model"].value = pol.model.p_hit["fast"].value = p_hit
    pol.model.e_hit.alpha = _alpha(e_hit)
    pol.model.e_miss["neural"].alpha, pol.model.e_miss["fast"].alpha, pol.model.t_fast.value = _alpha(e_draft), _alpha(1.5), 0.003
    pol.model.e_hit.count = 1
    pol.explore_new = pol.explore_every = 10**9  # these tests check the prediction, not exploration
    pol.min_dwell = 0
    return pol


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


def test_policy_steps_aside_as_batch_grows():
    pol = _policy()
    choices = {b: pol.choose(b, 4, 8).choice for b in (1, 2, 4, 8, 16, 32, 64)}
    assert choices[1] == "ssd+neural"  # free drafting on its own core, most outcomes pre-drafted
    assert choices[64] in ("sd", "ar")  # the b*B-row speculation tree no longer fits inside a verify
    rates = pol.rates(64, 4, 8)
    assert rates[choices[64]] == max(rates.values())
    d = pol.choose(1, 4, 8)
    assert d.reason == "policy" and set(d.rates) == set(CHOICES)
    # poor drafts: at a large batch, draft rows are pure cost and AR wins
    assert _policy(e_draft=1.1, e_hit=1.2, p_hit=0.3).choose(64, 4, 8).choice == "ar"


def test_policy_fast_backup_and_b_star():
    pol = _policy(drafter_scale=0.5)  # speculation fits inside a verify
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
    pol = _policy(e_draft=3.6, e_hit=3.6, p_hit=0.5, drafter_scale=1.1)
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
    pol = _policy()
    assert pol.model.tree_budget(1, 4, 8) == 8 and pol.model.tree_budget(1, 4, 16) == 16  # weight-bound: branches ride free
    # batch 16, K = 1: 16 x 8 = 128 tree rows cost the drafter 0.3 s over the 32-row minimum, far
    # more than a quarter of the verify (0.33 s); 16 x 3 = 48 rows cost 0.05 s more, 16 x 4 0.1 s
    assert pol.model.tree_budget(16, 1, 8) == 3
    assert pol.model.tree_budget(64, 4, 8) == 5  # never below one branch per depth (K + 1)
    assert pol.model.rates(16, 1, 3)["ssd+fast"] > pol.model.rates(16, 1, 8)["ssd+fast"]
    assert ModePolicy().model.tree_budget(16, 1, 8) == 8  # nothing measured yet: the request's budget


def test_policy_keeps_its_choice_within_hysteresis():
    pol = _policy()
    pol.current = "sd"
    rates = pol.rates(1, 4, 8)
    best = max(rates, key=rates.get)
    pol.hysteresis = rates[best] / rates["sd"] - 1 + 0.01  # best is not enough better
    assert pol.choose(1, 4, 8).choice == "sd"
    pol.hysteresis = 0.0
    assert pol.choose(1, 4, 8).choice == best


def test_policy_calibrates_each_choice_and_batch_size_from_measured_rounds():
    pol = _policy()
    model = pol.model.rates(4, 4, 8)
    for _ in range(30):  # SD rounds at batch 4 run at half the predicted speed
        pol.observe_round("sd", 3, 3 / (0.5 * model["sd"]), 4, 4, 8)
    assert abs(pol.rates(4, 4, 8)["sd"] / model["sd"] - 0.5) < 1e-6
    assert pol.rates(4, 4, 8)["ar"] == model["ar"]  # other choices keep their own factor
    # batch 5 shares the 3-5 bucket; batch 16 has no rounds of its own yet: the choice's overall factor
    assert abs(pol.factor("sd", 5) - 0.5) < 1e-6 and abs(pol.factor("sd", 16) - 0.5) < 1e-6
    model16 = pol.model.rates(16, 4, 8)
    for _ in range(16):  # one round at batch 16 (16 sequences report it): not measured there yet
        pol.observe_round("sd", 3, 3 / model16["sd"], 16, 4, 8)
    assert abs(pol.factor("sd", 16) - 0.5) < 1e-6
    for _ in range(16 * 30):  # 30 rounds at batch 16 where SD runs as predicted
        pol.observe_round("sd", 3, 3 / model16["sd"], 16, 4, 8)
    assert abs(pol.factor("sd", 16) - 1.0) < 1e-6 and abs(pol.factor("sd", 4) - 0.5) < 1e-6
    for _ in range(16):  # one slow round, reported by all 16 sequences, weighs one round
        pol.observe_round("sd", 3, 3 / (0.25 * model16["sd"]), 16, 4, 8)
    assert 0.9 < pol.factor("sd", 16) < 1.0
    for _ in range(30):  # SSD measured at batch 1 only (where it shines) and at batch 8
        pol.observe_round("ssd+fast", 3, 3 / (2.0 * pol.model.rates(1, 4, 8)["ssd+fast"]), 1, 4, 8)
    for _ in range(8 * 3):  # 3 rounds at batch 8
        pol.observe_round("ssd+fast", 3, 3 / (0.6 * pol.model.rates(8, 4, 8)["ssd+fast"]), 8, 4, 8)
    # batch 16 has no SSD rounds: batch 8's factor, not the overall one that batch 1 dominates
    assert abs(pol.factor("ssd+fast", 16) - 0.6) < 1e-6 and pol.factor("ssd+fast", 2) > 1.5


def test_a_measured_choice_keeps_its_rate_when_the_cost_curve_moves():
    """Once AR has rounds of its own at a batch size, its rate there is what it measured: other
    choices' forwards moving the target's cost curve (contention beside the drafter) must not
    move it. Where it has none, the formula still follows the curve."""
    pol = _policy()
    for _ in range(8 * 3):  # 3 rounds at batch 8: one token in 0.3 s
        pol.observe_round("ar", 1, 0.3, 8, 4, 8)
    assert abs(pol.rates(8, 4, 8)["ar"] - 1 / 0.3) < 1e-6
    before = pol.rates(32, 4, 8)["ar"]
    for _ in range(50):  # the target's forwards get slower (SD rounds beside the drafter)
        pol.model.observe_timing("target", [[8, 0.6], [32, 2.0]])
    assert abs(pol.rates(8, 4, 8)["ar"] - 1 / 0.3) < 1e-6
    assert pol.rates(32, 4, 8)["ar"] < 0.8 * before


def test_probes_are_priced_by_how_long_their_rounds_take():
    """A probe gives up time, not rounds: a choice whose rounds take 3x the current one's (SSD
    beside AR at 8 users) waits 3x as many rounds between probes."""
    def rounds_to_probe(probe_seconds: float) -> int:
        pol = _policy()
        pol.explore_new = pol.explore_every = 1  # only the price spaces the probes
        for _ in range(8 * 3):
            pol.observe_round("ar", 1, 0.5, 8, 3, 8)  # 2 tokens/s
            pol.observe_round("sd", 1.4 * probe_seconds, probe_seconds, 8, 3, 8)  # 70% of that
        pol.current, pol.switched_at = "ar", 0
        for n in range(1, 5000):
            if pol.choose(8, 3, 8, allowed=("ar", "sd")).reason == "explore":
                return n
        return 5000

    short, long = rounds_to_probe(0.5), rounds_to_probe(1.5)
    assert 2.5 * short < long < 3.5 * short


def _measure(pol: ModePolicy, choice: str, rate: float, batch: int, rounds: int = 3) -> None:
    """``rounds`` rounds of ``choice`` at ``batch`` sequences, each at ``rate`` tokens/s per sequence."""
    for _ in range(rounds * batch):
        pol.observe_round(choice, 2, 2 / rate, batch, 4, 8)


def test_a_choice_beaten_at_a_smaller_batch_is_neither_probed_nor_chosen_at_a_larger_one():
    """The step-aside ladder: what SD beat at 4 sequences stays beaten at 8, so SSD is not probed
    there (each probe and the dwell after an optimistic one cost a load-test cell 20-35%)."""
    def run(pol: ModePolicy) -> list:
        pol.explore_new, pol.explore_every, pol.explore_margin = 8, 256, 10.0
        seen = []
        for _ in range(200):
            d = pol.choose(8, 4, 8)
            seen.append(d)
            pol.observe_round(d.choice, 2, 2 / pol.rates(8, 4, 8)[d.choice], 8, 4, 8)
        return seen

    pol = _policy()
    for c, rate in (("ssd+neural", 2.0), ("ssd+fast", 2.1), ("sd", 3.0), ("ar", 2.5)):
        _measure(pol, c, rate, 4)  # at batch 4 SD beat both SSD choices by far
    pol.current = "ssd+neural"
    seen = run(pol)
    assert not any(d.choice.startswith("ssd") for d in seen)  # left at once, never probed
    assert {d.choice for d in seen} == {"sd", "ar"}  # the others are still measured and compared
    close = _policy()  # within the hysteresis at batch 4: not beaten, still probed at batch 8
    for c, rate in (("ssd+neural", 2.9), ("ssd+fast", 2.8), ("sd", 3.0), ("ar", 2.5)):
        _measure(close, c, rate, 4)
    assert {"ssd+neural", "ssd+fast"} <= {d.choice for d in run(close) if d.reason == "explore"}
    mine = _policy()  # and a record of its own at this batch size outranks the smaller one's verdict
    for c, rate in (("ssd+neural", 2.0), ("sd", 3.0)):
        _measure(mine, c, rate, 4)
    _measure(mine, "ssd+neural", 9.0, 8)
    assert mine.choose(8, 4, 8, allowed=("ssd+neural", "sd")).choice == "ssd+neural"


def test_a_stale_record_is_measured_again_before_the_batch_moves_to_it():
    """A machine that slows down shows in the running choice's record alone: the batch moves to a
    choice whose record is old only after a probe confirms it, and that probe's rounds outweigh
    the old ones."""
    def setup() -> ModePolicy:
        pol = _policy()
        pol.hysteresis = 0.1
        _measure(pol, "sd", 2.6, 8, rounds=20)
        _measure(pol, "ar", 2.8, 8, rounds=20)
        pol.current = "ar"
        for _ in range(pol.stale_after + 1):  # AR runs on; SD's record ages
            assert pol.choose(8, 4, 8, allowed=("ar", "sd")).choice == "ar"
        _measure(pol, "ar", 2.0, 8, rounds=20)  # everything slows down; only AR sees it
        return pol

    for sd_now, after in ((1.9, "ar"), (3.0, "sd")):
        pol = setup()
        assert pol.rates(8, 4, 8)["sd"] > 1.1 * pol.rates(8, 4, 8)["ar"]
        probe = [pol.choose(8, 4, 8, allowed=("ar", "sd")) for _ in range(pol.probe_rounds)]
        assert [(d.choice, d.reason) for d in probe] == [("sd", "confirm")] * pol.probe_rounds
        _measure(pol, "sd", sd_now, 8, rounds=1)  # the probe's measured round
        assert abs(pol.rates(8, 4, 8)["sd"] - sd_now) < 0.5 * abs(2.6 - sd_now)  # it outweighs the old ones
        assert pol.choose(8, 4, 8, allowed=("ar", "sd")).choice == after


def test_policy_dwells_before_switching_again():
    pol = _policy()
    pol.min_dwell = 16
    pol.current, pol.switched_at, pol.rounds = "ar", 0, 100  # long settled on a poor choice
    assert pol.choose(1, 4, 8).choice != "ar"  # switches at once
    better = pol.current
    pol.model.e_miss["neural"].alpha = pol.model.e_hit.alpha = 0.0  # drafts turn useless: AR is best now
    assert pol.choose(1, 4, 8).choice == better  # but the last switch was just now: it stays
    for _ in range(16):
        d = pol.choose(1, 4, 8)
    assert d.choice == "ar"


def test_policy_explores_choices_it_has_not_measured():
    pol = _policy()
    pol.explore_new, pol.explore_every = 8, 256
    seen = []
    for _ in range(300):
        d = pol.choose(1, 4, 8)
        seen.append(d)
        pol.observe_round(d.choice, 3, 3 / pol.model.rates(1, 4, 8)[d.choice], 1, 4, 8)  # as predicted
    explored = [d.choice for d in seen if d.reason == "explore"]
    # every choice the policy does not run got tried until it had 2 measured rounds, except AR: once
    # it was measured (its one probe as a choice that never ran), even 1.5x its prediction is far off
    assert set(explored) == {"sd", "ssd+fast", "ar"}
    assert pol.rates(1, 4, 8)["ar"] * pol.explore_margin < max(pol.rates(1, 4, 8).values())
    assert explored.count("ar") == pol.probe_rounds  # one probe
    assert all(explored.count(c) >= 3 for c in ("sd", "ssd+fast"))
    assert len(explored) < 0.1 * len(seen)  # and then only now and then
    assert all(d.choice == "ssd+neural" for d in seen if d.reason == "policy")


def test_policy_decides_once_per_round_of_the_batch():
    """At 16 sequences every round makes 16 decisions: they all get the round's choice (a probe or
    a switch moves the whole batch), and probes and dwell count rounds, not sequences."""
    pol = _policy()
    pol.explore_new, pol.explore_every, pol.min_dwell = 8, 256, 16
    rounds = []
    for _ in range(300):
        seen = []
        for i in range(16):
            d = pol.choose(16, 4, 8, seq=f"s{i}")
            seen.append(d)
            pol.observe_round(d.choice, 3, 3 / pol.model.rates(16, 4, 8)[d.choice], 16, 4, 8)
        assert len({(d.choice, d.reason) for d in seen}) == 1  # one choice per round
        rounds.append(seen[0])
    assert pol.rounds == 300
    explored = [d for d in rounds if d.reason == "explore"]
    assert explored  # unmeasured choices still get tried ...
    assert len(explored) < 0.1 * len(rounds)  # ... about as rarely (per round) as at batch 1
    switches = sum(a.choice != b.choice for a, b in zip(rounds, rounds[1:]) if a.reason == b.reason == "policy")
    assert switches <= 300 // pol.min_dwell


def test_policy_prices_probes():
    """A choice predicted well below the best is probed rarely: probes spend at most
    ``explore_budget`` of the rounds, whatever the intervals say."""
    pol = _policy()
    pol.explore_new = pol.explore_every = 2  # intervals alone would probe every other round
    pol.explore_margin = 10.0  # and the margin would let every choice through
    seen = []
    for _ in range(2000):
        d = pol.choose(8, 4, 8)
        seen.append(d)
        pol.observe_round(d.choice, 3, 3 / pol.model.rates(8, 4, 8)[d.choice], 8, 4, 8)
    rates = pol.rates(8, 4, 8)
    top = max(rates.values())
    probes = [d.choice for d in seen if d.reason == "explore"]
    assert set(probes) == set(CHOICES) - {pol.current}  # every other choice was measured
    lost = sum(1 - rates[c] / top for c in probes)  # rounds of the best choice given up to probes
    assert lost <= pol.explore_budget * len(seen) * 1.05


def test_policy_warms_up_and_respects_pins():
    pol = ModePolicy()
    d = pol.choose(8, 4, 8)
    assert (d.choice, d.reason) == ("ssd+neural", "warmup")  # nothing measured yet
    fresh, measured = _policy(), _policy()
    fresh.model.e_hit.count, fresh.model.e_hit.alpha = 0, 0.1  # SSD never ran: E_hit is taken as E_sd
    measured.model.e_hit.alpha = measured.model.e_miss["neural"].alpha
    assert fresh.model.rates(1, 4, 8) == measured.model.rates(1, 4, 8)
    assert pol.choose(8, 4, 8, ("sd",)).choice == "sd"  # a request pinned to sd
    assert ModePolicy(forced_mode="ar").choose(1, 4, 8).choice == "ar"


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


def _verify_bound_policy(drafter_row_cost: float) -> ModePolicy:
    """This machine's shape (AMD EPYC, one thread per engine, measured): a target verify of 1-5 rows
    costs what one row does (0.10 s); each drafter forward costs 0.022 s plus ``drafter_row_cost``
    per row."""
    pol = ModePolicy()
    for rows, s in ((1, 0.100), (2, 0.100), (4, 0.105), (8, 0.115), (32, 0.20)):
        pol.model.target.observe(rows, s)
    for rows in (1, 2, 4, 8, 16, 32):
        pol.model.drafter.observe(rows, 0.022 + drafter_row_cost * rows)
    pol.model.p_hit["model"].value = pol.model.p_hit["fast"].value = 0.65
    pol.model.e_hit.alpha = pol.model.e_miss["neural"].alpha = 0.8
    pol.model.e_hit.count = 1
    return pol


def test_each_choice_drafts_the_k_that_predicts_the_most():
    # tree rows cost 2 ms each: a speculation of K steps over 12 branches outlasts the verify from
    # K = 2 on, so SSD drafts less than the request's K = 4, and gains over SSD at K = 4
    pol = _verify_bound_policy(0.002)
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
    free = _verify_bound_policy(0.0)
    free.model.drafter = StepCost()
    free.model.drafter.observe(1, 0.001)
    assert free.model.best_k(1, 4, 12)["ssd+neural"] == 4 and free.model.best_k(1, 4, 12)["sd"] == 4
    assert ModePolicy().model.best_k(1, 4, 12) == {c: 4 for c in CHOICES}  # nothing measured: the request's K


def test_a_record_far_below_the_best_is_measured_again_in_time():
    """A choice measured once at a fraction of the best (its rounds ran while the machine stalled)
    is not locked out by the explore margin for good: after ``explore_every`` rounds it is probed
    again, and if it now runs best the batch moves to it."""
    pol = _policy()
    pol.explore_new, pol.explore_every, pol.hysteresis = 8, 64, 0.1
    _measure(pol, "ssd+fast", 3.0, 1)
    _measure(pol, "ssd+neural", 0.8, 1)  # a stalled start: far below 3.0 / explore_margin
    for c in ("sd", "ar"):
        _measure(pol, c, 1.0, 1)
    pol.current = "ssd+fast"
    seen = []
    for _ in range(1500):  # its probe is priced: 3 rounds at 3.75x a round's time, within explore_budget
        d = pol.choose(1, 4, 8)
        seen.append(d)
        # what each choice delivers now: the neural backup at 4 tokens/s
        pol.observe_round(d.choice, 2, 2 / {"ssd+neural": 4.0, "ssd+fast": 3.0}.get(d.choice, 1.0), 1, 4, 8)
    first = next(i for i, d in enumerate(seen) if d.choice == "ssd+neural")
    assert seen[first].reason == "explore"
    assert first >= pol.explore_every  # not at once, and not never
    assert pol.current == "ssd+neural"
