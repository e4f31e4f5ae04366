"""Unit tests of the mode policy's decisions: calibration and measured records, probes, the
step-aside ladder and re-measurement (engine-free: the engines' costs are fed in). The rules for
moving the batch from one choice to another (dwell, confirmation) are in test_policy_switching.py.
The predictions it decides from are tested in test_speedup_model.py."""
from __future__ import annotations

from ssd.algorithm.policy import CHOICES, ModePolicy

from policy_setup import alpha_at_k4, measure_rounds, measured_policy, ssd_rounds


def test_policy_steps_aside_as_batch_grows():
    pol = measured_policy()
    choices = {b: pol.choose(b, 4, 8).choice for b in (1, 2, 4, 8, 16, 32, 64)}
    assert choices[1] == "ssd+neural"  # free drafting on its own core, most outcomes pre-drafted
    assert choices[64] in ("sd", "ar")  # the b*B-row speculation tree no longer fits inside a verify
    rates = pol.rates(64, 4, 8)
    assert rates[choices[64]] == max(rates.values())
    d = pol.choose(1, 4, 8)
    assert d.reason == "policy" and set(d.rates) == set(CHOICES)
    # poor drafts: at a large batch, draft rows are pure cost and AR wins
    assert measured_policy(e_draft=1.1, e_hit=1.2, p_hit=0.3).choose(64, 4, 8).choice == "ar"


def test_policy_keeps_its_choice_within_hysteresis():
    pol = measured_policy()
    pol.current = "sd"
    rates = pol.rates(1, 4, 8)
    best = max(rates, key=rates.get)
    pol.hysteresis = rates[best] / rates["sd"] - 1 + 0.01  # best is not enough better
    assert pol.choose(1, 4, 8).choice == "sd"
    pol.hysteresis = 0.0
    assert pol.choose(1, 4, 8).choice == best


def test_policy_calibrates_each_choice_and_batch_size_from_measured_rounds():
    pol = measured_policy()
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
    pol = measured_policy()
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
        pol = measured_policy()
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

    pol = measured_policy()
    for c, rate in (("ssd+neural", 2.0), ("ssd+fast", 2.1), ("sd", 3.0), ("ar", 2.5)):
        measure_rounds(pol, c, rate, 4)  # at batch 4 SD beat both SSD choices by far
    pol.current = "ssd+neural"
    seen = run(pol)
    assert not any(d.choice.startswith("ssd") for d in seen)  # left at once, never probed
    assert {d.choice for d in seen} == {"sd", "ar"}  # the others are still measured and compared
    close = measured_policy()  # within the hysteresis at batch 4: not beaten, still probed at batch 8
    for c, rate in (("ssd+neural", 2.9), ("ssd+fast", 2.8), ("sd", 3.0), ("ar", 2.5)):
        measure_rounds(close, c, rate, 4)
    assert {"ssd+neural", "ssd+fast"} <= {d.choice for d in run(close) if d.reason == "explore"}
    mine = measured_policy()  # and a record of its own at this batch size outranks the smaller one's verdict
    for c, rate in (("ssd+neural", 2.0), ("sd", 3.0)):
        measure_rounds(mine, c, rate, 4)
    measure_rounds(mine, "ssd+neural", 9.0, 8)
    assert mine.choose(8, 4, 8, allowed=("ssd+neural", "sd")).choice == "ssd+neural"


def test_policy_explores_choices_it_has_not_measured():
    pol = measured_policy()
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
    pol = measured_policy()
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
    pol = measured_policy()
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
    fresh, measured = measured_policy(), measured_policy()
    fresh.model.e_hit.count, fresh.model.e_hit.alpha = 0, 0.1  # SSD never ran: E_hit is taken as E_sd
    measured.model.e_hit.alpha = measured.model.e_miss["neural"].alpha
    assert fresh.model.rates(1, 4, 8) == measured.model.rates(1, 4, 8)
    assert pol.choose(8, 4, 8, ("sd",)).choice == "sd"  # a request pinned to sd
    assert ModePolicy(forced_mode="ar").choose(1, 4, 8).choice == "ar"


def test_requests_first_rounds_alone_do_not_make_a_record():
    """A choice that only ever ran requests' first rounds (no cached draft, the drafter's prefill:
    slow whatever the choice) is not measured by them: its prediction stands, and the batch moves
    to it if it runs best. (Counted as its record, 0.8 tok/s here kept it off behind the explore
    margin until ``explore_every``.)"""
    pol = measured_policy()
    pol.explore_new, pol.explore_every, pol.hysteresis = 8, 10**6, 0.1
    measure_rounds(pol, "ssd+fast", 3.0, 1)
    for c in ("sd", "ar"):
        measure_rounds(pol, c, 1.0, 1)
    for _ in range(3):  # three requests began on it, each with a slow first round
        pol.observe_round("ssd+neural", 2, 2 / 0.8, 1, 4, 8, clean=False, first=True)
    assert pol.measured[("ssd+neural", 0)].rate < 3.0 / pol.explore_margin  # what the margin saw
    pol.current = "ssd+fast"
    seen = []
    for _ in range(300):
        d = pol.choose(1, 4, 8)
        seen.append(d)
        pol.observe_round(d.choice, 2, 2 / {"ssd+neural": 4.0, "ssd+fast": 3.0}.get(d.choice, 1.0), 1, 4, 8)
    assert any(d.choice == "ssd+neural" for d in seen[:100])
    assert pol.current == "ssd+neural"


def test_a_record_far_below_the_best_is_measured_again_in_time():
    """A choice measured once at a fraction of the best (its rounds ran while the machine stalled)
    is not locked out by the explore margin for good: after ``explore_every`` rounds it is probed
    again, and if it now runs best the batch moves to it."""
    pol = measured_policy()
    pol.explore_new, pol.explore_every, pol.hysteresis = 8, 64, 0.1
    measure_rounds(pol, "ssd+fast", 3.0, 1)
    measure_rounds(pol, "ssd+neural", 0.8, 1)  # a stalled start: far below 3.0 / explore_margin
    for c in ("sd", "ar"):
        measure_rounds(pol, c, 1.0, 1)
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


def test_the_ssd_backups_are_judged_by_their_misses_not_by_luck():
    """The two SSD choices run the same rounds on a hit and differ only on a miss (one round in
    five here). Two lucky rounds of the fast backup, both hits, out-ran the neural backup's record,
    which holds its misses: compared record to record the batch moved to the n-gram backup (traced
    on the served bench: every later miss then yielded 1 token). Put together by draft source,
    the fast backup's misses are priced from what its drafts yield (1.5 tokens here), and the
    neural backup stays; when the fast backup's misses do yield more, it takes over."""
    pol = measured_policy()
    pol.hysteresis, pol.current = 0.1, "ssd+neural"
    ssd_rounds(pol, "ssd+neural", "hhhhm" * 4, miss=(3, 1.6))
    ssd_rounds(pol, "ssd+fast", "hh")
    plain = {c: pol.measured[(c, 0)].rate for c in ("ssd+neural", "ssd+fast")}
    assert plain["ssd+fast"] > plain["ssd+neural"] * (1 + pol.hysteresis)  # the trap
    rates = pol.rates(1, 4, 8)
    assert rates["ssd+neural"] > rates["ssd+fast"]
    assert pol.choose(1, 4, 8, ("ssd+neural", "ssd+fast")).choice == "ssd+neural"
    # repetitive text: the n-gram draft's misses yield as much as a hit, at no drafting cost (the
    # lookup is scored on every round: e_miss["fast"])
    pol.model.e_miss["fast"].alpha = alpha_at_k4(4)
    ssd_rounds(pol, "ssd+fast", "mhmhm", miss=(4, 1.0))
    assert pol.choose(1, 4, 8, ("ssd+neural", "ssd+fast")).choice == "ssd+fast"


def test_a_backup_s_misses_are_priced_on_the_text_decoding_now():
    """Traced on the served bench: the warm-up haiku, which the drafter drafts badly, left the
    neural backup's misses at 1.5 tokens; the batch moved to the fast backup, and since the neural
    one never ran again, that record kept the batch on n-gram drafts (1 token a miss) through the
    next requests. A neural backup's miss yields what a hit on the same text does (it drafts what
    the speculation would have cached), so the fresh hit rounds price it, and the batch goes back."""
    pol = measured_policy(p_hit=0.7)
    pol.hysteresis, pol.current = 0.1, "ssd+fast"
    ssd_rounds(pol, "ssd+neural", "hmhm", hit=(2, 1.7), miss=(1.5, 1.9))  # the haiku
    pol.model.e_miss["neural"].alpha = alpha_at_k4(1.5)  # what its SD and backup drafts taught
    ssd_rounds(pol, "ssd+fast", "hhhm" * 2, miss=(1, 1.0))  # a text the drafter drafts well
    hit, stale = pol.parts[("ssd+fast", 0, "hit")], pol.parts[("ssd+neural", 0, "miss")]
    fast = pol.rates(1, 4, 8)["ssd+fast"]
    p = pol.model.hit_share("neural")
    by_record = (p * hit.tokens.value + (1 - p) * stale.tokens.value) / (p * hit.seconds.value + (1 - p) * stale.seconds.value)
    assert by_record < fast  # the trap: priced by the haiku's misses, the neural backup stays out
    assert pol.rates(1, 4, 8)["ssd+neural"] > fast * (1 + pol.hysteresis)
    assert pol.choose(1, 4, 8, ("ssd+neural", "ssd+fast")).choice == "ssd+neural"


def test_at_a_larger_batch_hit_rounds_keep_their_backup_s_waits():
    """At batch 1 a hit round waits for no backup, so either SSD choice's latest hit rounds time it;
    at 8 sequences a hit row waits for the rows that missed (the neural backup's drafting), so the
    fast backup's hit rounds keep their own, shorter, seconds; the tokens are the latest either way."""
    pol = measured_policy(p_hit=0.8)
    ssd_rounds(pol, "ssd+fast", "hhhmmm", hit=(3.0, 2.0), miss=(1.0, 2.0), batch=8)
    # the latest hit rounds, with the neural backup's waits
    ssd_rounds(pol, "ssd+neural", "hhhmmm", hit=(4.0, 2.5), miss=(4.0, 2.6), batch=8)
    p = pol.model.hit_share("fast")
    m_tokens = pol.model.e_miss["fast"].tokens(4)
    expected = (p * 4.0 + (1 - p) * m_tokens) / 2.0  # its own seconds (no drafting after a miss)
    assert abs(pol.rates(8, 4, 8)["ssd+fast"] - expected) < 1e-9


def test_an_uncalibrated_ssd_backup_borrows_the_other_s_calibration():
    """A warm-up prompt the drafter drafts badly takes SSD's calibration factor down; the SSD
    choice that never ran shares every term of the formula but the miss term, so it shares that
    factor too instead of keeping 1.0 and taking the batch on no evidence."""
    pol = measured_policy()
    pol.hysteresis, pol.current = 0.1, "ssd+neural"
    for _ in range(2):  # two rounds at 0.6x the prediction
        pol.observe_round("ssd+neural", 1, 1 / (0.6 * pol.model.rates(1, 4, 8)["ssd+neural"]), 1, 4, 8)
    assert abs(pol.factor("ssd+fast", 1) - pol.factor("ssd+neural", 1)) < 1e-9 < 1 - pol.factor("ssd+neural", 1)
    model = pol.model.rates(1, 4, 8)
    rates = pol.rates(1, 4, 8)
    assert abs(rates["ssd+fast"] / rates["ssd+neural"] - model["ssd+fast"] / model["ssd+neural"]) < 1e-9
    assert pol.choose(1, 4, 8, ("ssd+neural", "ssd+fast")).choice == "ssd+neural"
