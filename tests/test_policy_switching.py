"""Unit tests of the rules that move the batch from one choice to another: the dwell (and what
ends it early), confirmation of a stale or missing record, and the free move between the two SSD
choices (engine-free: the engines' costs are fed in, as in test_policy.py)."""
from __future__ import annotations

from ssd.algorithm.policy import ModePolicy

from policy_setup import alpha_at_k4, measure_rounds, measured_policy, ssd_rounds


def test_a_stale_record_is_measured_again_before_the_batch_moves_to_it():
    """A machine that slows down shows in the running choice's record alone: the batch moves to a
    choice whose record is old only after a probe confirms it, and that probe's rounds outweigh
    the old ones."""
    def setup() -> ModePolicy:
        pol = measured_policy()
        pol.hysteresis = 0.1
        measure_rounds(pol, "sd", 2.6, 8, rounds=20)
        measure_rounds(pol, "ar", 2.8, 8, rounds=20)
        pol.current = "ar"
        for _ in range(pol.stale_after + 1):  # AR runs on; SD's record ages
            assert pol.choose(8, 4, 8, allowed=("ar", "sd")).choice == "ar"
        measure_rounds(pol, "ar", 2.0, 8, rounds=20)  # everything slows down; only AR sees it
        return pol

    for sd_now, after in ((1.9, "ar"), (3.0, "sd")):
        pol = setup()
        assert pol.rates(8, 4, 8)["sd"] > 1.1 * pol.rates(8, 4, 8)["ar"]
        probe = [pol.choose(8, 4, 8, allowed=("ar", "sd")) for _ in range(pol.probe_rounds)]
        assert [(d.choice, d.reason) for d in probe] == [("sd", "confirm")] * pol.probe_rounds
        measure_rounds(pol, "sd", sd_now, 8, rounds=1)  # the probe's measured round
        assert abs(pol.rates(8, 4, 8)["sd"] - sd_now) < 0.5 * abs(2.6 - sd_now)  # it outweighs the old ones
        assert pol.choose(8, 4, 8, allowed=("ar", "sd")).choice == after


def test_policy_dwells_before_switching_again():
    pol = measured_policy()
    pol.min_dwell = 16
    pol.current, pol.switched_at, pol.rounds = "ar", 0, 100  # long settled on a poor choice
    assert pol.choose(1, 4, 8).choice != "ar"  # switches at once
    better = pol.current
    pol.model.e_miss["neural"].alpha = pol.model.e_hit.alpha = 0.0  # drafts turn useless: AR is best now
    assert pol.choose(1, 4, 8).choice == better  # but the last switch was just now: it stays
    for _ in range(16):
        d = pol.choose(1, 4, 8)
    assert d.choice == "ar"


def test_a_choice_with_no_record_is_probed_before_the_batch_moves_to_it():
    """Traced on the served bench: two rounds into the warm-up haiku, a lucky 5-token hit raised
    SSD's calibration; the never-run n-gram backup, priced by the formula times that factor, beat
    the neural backup's record by 17%, the batch moved and the dwell held it there for 16 rounds
    while its misses yielded one token. A choice with no record where the current one has one is
    measured first (a probe, reason "confirm"); its record then decides."""
    pol = measured_policy(p_hit=0.75)
    pol.hysteresis, pol.min_dwell, pol.current = 0.1, 16, "ssd+neural"
    ssd_rounds(pol, "ssd+neural", "hh", hit=(3, 1.0))
    pol.model.e_hit.alpha = alpha_at_k4(4.5)  # acceptance learned since: the formula rises, the record does not
    rates = pol.rates(1, 4, 8)
    assert rates["ssd+fast"] > rates["ssd+neural"] * (1 + pol.hysteresis)  # the trap
    allowed = ("ssd+neural", "ssd+fast")
    for x in "mhm":  # the probe: the n-gram backup's misses yield 1 token
        d = pol.choose(1, 4, 8, allowed)
        assert (d.choice, d.reason) == ("ssd+fast", "confirm")
        pol.observe_round("ssd+fast", 1 if x == "m" else 3, 1.0, 1, 4, 8, source="fast" if x == "m" else "cache")
    assert pol.rates(1, 4, 8)["ssd+fast"] < pol.rates(1, 4, 8)["ssd+neural"]
    assert pol.choose(1, 4, 8, allowed).choice == "ssd+neural"


def test_the_ssd_choices_switch_without_a_dwell_other_choices_dwell():
    """The two SSD choices run the same speculation and keep its cache; only the draft after a miss
    differs, so moving between them costs nothing and the dwell (which keeps switches that cost a
    round from flapping) does not hold the batch on the worse one. A move into or out of SSD does."""
    pol = measured_policy(p_hit=0.5)
    pol.hysteresis, pol.min_dwell = 0.1, 16
    ssd_rounds(pol, "ssd+neural", "hhm", hit=(4, 1.0), miss=(4, 1.3))
    ssd_rounds(pol, "ssd+fast", "hhm", hit=(4, 1.0), miss=(1, 1.0))
    neural = pol.rates(1, 4, 8)["ssd+neural"]
    measure_rounds(pol, "sd", neural / 1.3, 1)  # beaten by more than the hysteresis, less than the margin
    rates = pol.rates(1, 4, 8)
    assert rates["ssd+neural"] > rates["ssd+fast"] * (1 + pol.hysteresis)
    assert rates["sd"] * (1 + pol.hysteresis) < rates["ssd+neural"] < rates["sd"] * pol.explore_margin
    pol.current, pol.switched_at = "ssd+fast", pol.rounds  # just moved there
    assert pol.choose(1, 4, 8, ("ssd+neural", "ssd+fast")).choice == "ssd+neural"
    pol.current, pol.switched_at = "sd", pol.rounds  # just moved to SD: it stays for the dwell
    assert pol.choose(1, 4, 8, ("ssd+neural", "sd")).choice == "sd"


def test_a_measured_gap_over_the_explore_margin_ends_the_dwell():
    """Traced, 4-user load test: the batch moved to SD, a probe 5 rounds later measured SSD at
    3.0-4.0 tokens/s against SD's record of 1.36, and the dwell held SD 11 more rounds. The dwell
    guards against noise; records this far apart (``explore_margin``) are not noise. A gap the
    formula alone predicts does not end it: only one both choices measured here."""
    def after_probe(sd_rate: float, probed: bool = True) -> ModePolicy:
        pol = measured_policy(p_hit=0.8)
        pol.hysteresis, pol.min_dwell = 0.1, 16
        measure_rounds(pol, "sd", sd_rate, 1)
        pol.current, pol.switched_at = "sd", pol.rounds  # just moved to SD
        if probed:
            ssd_rounds(pol, "ssd+neural", "hhm", hit=(4, 1.0), miss=(4, 1.3))  # the probe's rounds
        return pol

    allowed = ("ssd+neural", "sd")
    pol = after_probe(1.0)
    assert pol.rates(1, 4, 8)["ssd+neural"] > pol.explore_margin * pol.rates(1, 4, 8)["sd"]
    d = pol.choose(1, 4, 8, allowed)
    assert (d.choice, d.reason) == ("ssd+neural", "policy")
    assert pol.switched_at == pol.rounds  # a real switch: the new choice dwells in turn

    pol = after_probe(3.5 / 1.3)  # SSD measured faster, but within the margin: the dwell holds
    assert pol.rates(1, 4, 8)["ssd+neural"] > (1 + pol.hysteresis) * pol.rates(1, 4, 8)["sd"]
    assert [pol.choose(1, 4, 8, allowed).choice for _ in range(3)] == ["sd"] * 3

    pol = after_probe(1.0, probed=False)  # the same gap, predicted only: the dwell holds
    assert pol.rates(1, 4, 8)["ssd+neural"] > pol.explore_margin * pol.rates(1, 4, 8)["sd"]
    assert pol.choose(1, 4, 8, allowed).choice == "sd"


def test_the_dwell_ends_when_no_round_was_decided_for_a_while():
    """Requests that pin their mode ask the policy nothing, so its rounds stop while they run. Traced
    on the load test: the dwell on SD left from one SSD cell held the next SSD cell's first 7
    rounds on SD, after a minute of pinned AR and SD cells. A gap of ``dwell_idle_s`` between
    decided rounds ends the dwell; a shorter one does not."""
    def just_moved_to_sd(gap_s: float) -> str:
        now = [0.0]
        pol = measured_policy(p_hit=0.8)
        pol.hysteresis, pol.min_dwell, pol.clock = 0.1, 16, lambda: now[0]
        measure_rounds(pol, "sd", 2.0, 1)
        ssd_rounds(pol, "ssd+neural", "hhh", hit=(2.6, 1.0))
        rates = pol.rates(1, 4, 8)
        assert rates["sd"] * (1 + pol.hysteresis) < rates["ssd+neural"] < rates["sd"] * pol.explore_margin
        pol.current, pol.switched_at = "sd", pol.rounds
        allowed = ("ssd+neural", "sd")
        assert pol.choose(1, 4, 8, allowed).choice == "sd"  # the dwell holds SD ...
        now[0] += gap_s  # ... then pinned requests run, or none
        return pol.choose(1, 4, 8, allowed).choice

    assert just_moved_to_sd(3.0) == "sd"
    assert just_moved_to_sd(60.0) == "ssd+neural"
