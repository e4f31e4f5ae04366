"""Acceptance scenarios of the scheduler (engine-free: the cost model's engines are fed in, and
each choice's rounds run at a chosen true rate): the prior decides until rounds are measured,
measured rates follow drift, discounted UCB explores only what could win, hysteresis stops
flapping, and one decision covers the whole batch's round."""
from __future__ import annotations

from ssd.algorithm.rounds import Choice
from ssd.algorithm.scheduler import PolicyConfig, Scheduler, bucket

from policy_setup import measured_scheduler, record, run_batch

AR, SD, SSD_N, SSD_F = Choice.AR, Choice.SD, Choice.SSD_NEURAL, Choice.SSD_FAST


def test_the_prior_picks_ssd_alone_and_steps_aside_as_the_batch_grows():
    s = measured_scheduler()
    assert s.choose(1, 4, 8).choice.mode == "ssd"
    d = measured_scheduler().choose(64, 4, 8)
    assert d.choice in (SD, AR) and d.reason == "policy" and set(d.rates) == set(Choice)
    assert measured_scheduler(e_draft=1.1, e_hit=1.2, p_hit=0.3).choose(64, 4, 8).choice == AR


def test_warm_up_pins_and_forced_modes():
    s = Scheduler()
    d = s.choose(8, 4, 8)
    assert (d.choice, d.reason) == (SSD_N, "warmup")  # no engine has reported a forward yet
    assert measured_scheduler().choose(8, 4, 8, ("sd",)).choice == SD  # a request pinned to sd
    assert measured_scheduler().choose(8, 4, 8, ("sd",)).reason == "request"
    assert Scheduler(forced_mode="ar").choose(1, 4, 8).choice == AR


def test_measured_rates_overrule_the_prior_and_rescale_the_others():
    """SD at batch 4 runs at half its prediction: its estimate goes to what it measured, and the
    other choices' priors are scaled by the same shortfall while no round of their mode is measured."""
    s = measured_scheduler(half_life_s=float("inf"))
    prior = s.model.rates(4, 4, 8)
    for _ in range(4 * 40):
        s.observe(record(SD, 3, 3 / (0.5 * prior[SD]), batch=4))
    est, n = s.estimates(4, 4, 8)
    assert abs(est[SD] / prior[SD] - 0.5) < 1e-6
    assert abs(est[AR] / prior[AR] - 0.5) < 1e-6 and n[AR] == s.cfg.prior_rounds
    assert abs(n[SD] - s.cfg.prior_rounds - 40) < 1e-6  # 4 sequences reporting one round weigh one round
    assert s.estimates(16, 4, 8)[0] == s.model.rates(16, 4, 8)  # another bucket: the prior alone


def test_each_mode_borrows_the_shortfall_of_its_own_measured_rounds():
    """AR rounds run as predicted and SD rounds at half: the wide layouts' priors take their own
    mode's shortfall (an SD round's hand-offs do not slow an AR round down)."""
    s = measured_scheduler(half_life_s=float("inf"))
    prior = s.model.rates(4, 4, 8)
    for _ in range(4 * 20):
        s.observe(record(SD, 3, 3 / (0.5 * prior[SD]), batch=4))
        s.observe(record(AR, 1, 1 / prior[AR], batch=4))
    est, _ = s.estimates(4, 4, 8)
    assert abs(est[Choice.AR_WIDE] / prior[Choice.AR_WIDE] - 1.0) < 1e-6
    assert abs(est[Choice.SD_WIDE] / prior[Choice.SD_WIDE] - 0.5) < 1e-6
    assert 0.5 < est[SSD_N] / prior[SSD_N] < 1.0  # no SSD round yet: every measured round's shortfall


def test_a_round_right_after_a_costly_switch_is_left_out():
    s = measured_scheduler()
    s.observe(record(SD, 3, 9.0, after_switch=True))
    assert not s.records
    s.observe(record(SD, 3, 1.0))
    assert s.records[(SD, bucket(1))].weight == 1.0


def test_a_round_is_charged_its_own_seconds_not_the_prompts_it_waited_for():
    """A new request's prefill batched with a round's verify delays the round whatever its choice:
    the record keeps the round's tokens over its wall time less the prompt's seconds."""
    from dataclasses import replace

    s = measured_scheduler(half_life_s=float("inf"))
    s.observe(replace(record(AR, 1, 2.5), prompt_seconds=2.0))
    r = s.records[(AR, bucket(1))]
    assert abs(r.tokens / r.seconds - 2.0) < 1e-9


def test_explores_what_could_win_and_settles_on_the_fastest():
    """True rates unlike the prior's ranking: SD runs fastest. The batch tries the close choices,
    settles on SD, and spends few rounds on AR (far below it)."""
    s = measured_scheduler()
    true = {SSD_N: 2.0, SSD_F: 1.9, SD: 3.0, AR: 0.8}
    seen = run_batch(s, true, batch=1, rounds=300)
    assert s.current == SD
    assert s.current == SD and sum(d.choice == SD for d in seen[-100:]) >= 70
    assert sum(d.choice.wide for d in seen[-100:]) <= 10
    assert sum(d.choice == AR for d in seen) <= 6
    assert any(d.reason == "explore" for d in seen)


def test_a_slowdown_of_the_running_choice_moves_the_batch():
    """AR runs best at batch 8 until the machine slows it to a third; the discount lets the
    measurement follow, and the batch moves to SD, which was slower before and is now faster."""
    s = measured_scheduler()
    true = {SSD_N: 0.3, SSD_F: 0.3, SD: 1.6, AR: lambda i: 2.0 if i < 150 else 0.7}
    seen = run_batch(s, true, batch=8, rounds=400, allowed=(SD, AR))
    assert sum(d.choice == AR for d in seen[100:150]) >= 45
    assert s.current == SD and sum(d.choice == SD for d in seen[-100:]) >= 70
    assert sum(d.choice.wide for d in seen[-100:]) <= 10


def test_hysteresis_keeps_the_batch_between_close_choices():
    """SD and AR run within 3% of each other: the batch does not flap between them."""
    s = measured_scheduler()
    seen = run_batch(s, {SSD_N: 0.3, SSD_F: 0.3, SD: 2.0, AR: 2.05}, batch=8, rounds=300, allowed=(SD, AR))
    switches = sum(a.choice != b.choice for a, b in zip(seen, seen[1:]))
    assert switches <= 10


def test_the_ssd_backups_change_without_hysteresis():
    s = measured_scheduler(hysteresis=10.0)  # no costly switch could ever pass
    s.current = SSD_N
    est = s.estimates(1, 4, 8)[0]
    first = s.choose(1, 4, 8, (SSD_N, SSD_F)).choice
    assert first == max((SSD_N, SSD_F), key=est.get)  # the free change happens when it scores more
    s.current = SD
    assert s.choose(1, 4, 8, (SSD_N, SD)).choice == SD


def test_one_decision_per_round_of_the_batch():
    """Every sequence asking within a round gets the round's choice; rounds are counted per batch."""
    s = measured_scheduler()
    for r in range(50):
        picks = {s.choose(16, 4, 8, seq=f"s{i}").choice for i in range(16)}
        assert len(picks) == 1
    assert s.rounds == 50
    # a request whose options exclude the round's choice gets its best allowed one, same round
    d = s.choose(16, 4, 8, seq="s0")
    other = next(c for c in Choice if c != d.choice)
    assert s.choose(16, 4, 8, (other,), seq="s1").choice == other
    assert s.rounds == 51


def test_a_choice_far_below_the_best_is_never_tried():
    """At 24 users SSD's tree costs several verifies: its prior is far below AR's and SD's, so the
    batch rarely pays for an SSD round (each costs about half a round)."""
    s = measured_scheduler()
    prior = s.model.rates(24, 4, 8)
    true = {c: prior[c] for c in Choice}
    assert max(prior[SSD_N], prior[SSD_F]) < 0.6 * max(prior[SD], prior[AR])
    seen = run_batch(s, true, batch=24, rounds=300)
    assert sum(d.choice.mode == "ssd" for d in seen) <= 0.03 * len(seen)


def test_the_config_has_few_tunables():
    assert len(PolicyConfig.__dataclass_fields__) <= 8


def test_wide_sd_wins_where_a_second_thread_pays():
    """With the wide choices allowed and SD on every core measuring fastest, the batch settles
    there; where it measures slower than SD on its own core, it is left alone."""
    allowed = tuple(Choice)
    s = measured_scheduler()
    seen = run_batch(s, {SSD_N: 2.0, SSD_F: 1.9, SD: 2.6, AR: 0.8, Choice.SD_WIDE: 3.2, Choice.AR_WIDE: 1.0},
                     batch=1, rounds=300, allowed=allowed)
    assert s.current == Choice.SD_WIDE and sum(d.choice == Choice.SD_WIDE for d in seen[-100:]) >= 70
    s = measured_scheduler()
    seen = run_batch(s, {SSD_N: 2.0, SSD_F: 1.9, SD: 2.6, AR: 0.8, Choice.SD_WIDE: 1.6, Choice.AR_WIDE: 0.6},
                     batch=1, rounds=300, allowed=allowed)
    assert s.current == SD and sum(d.choice == SD for d in seen[-100:]) >= 70
    assert sum(d.choice.wide for d in seen[-100:]) <= 10


def test_a_drafter_that_must_catch_up_is_chosen_only_where_the_tokens_left_pay_for_it():
    """After AR rounds on a wide layout the drafter lacks the batch's prompts and tokens: a drafting
    choice first runs those rows. Alone, SSD wins by far; owing 512 rows (1.6 s on this drafter)
    it still wins with 1000 tokens left, and loses to AR with 8 left, whatever UCB would try."""
    fresh = measured_scheduler().choose(1, 4, 8)
    assert fresh.choice.mode == "ssd"
    owed = 512
    assert measured_scheduler().model.catch_up_seconds(owed, wide=False) == 1.6

    def after_ar(owed_rows, tokens_left):
        s = measured_scheduler()
        s.current = AR  # the batch has been running AR, which is how the drafter fell behind
        return s.choose(1, 4, 8, owed_rows=owed_rows, tokens_left=tokens_left)

    assert after_ar(owed, 1000).choice.mode == "ssd"
    d = after_ar(owed, 8)
    assert d.choice == AR and d.rates[AR] == fresh.rates[AR]
    assert d.rates[SSD_N] < fresh.rates[SSD_N] / 2
    assert after_ar(0, 8).choice.mode == "ssd"


def test_an_optimistic_rate_must_still_earn_back_the_catch_up():
    """UCB's bound is on a choice's steady rate; the drafter's catch-up is measured, so it is priced
    after the bound. A batch on AR whose untried SD (steady estimate 0.77 of AR's) gets tried with
    a current drafter is not tried owing 256 rows with 32 tokens left: even the optimistic rate
    does not earn the catch-up back. Bounding the estimate after the catch-up would try it."""
    import math

    def after_ar_rounds():
        s = measured_scheduler(e_draft=1.6, e_hit=1.6, p_hit=0.3)
        prior = s.model.rates(1, 4, 8)
        for _ in range(60):
            s.choose(1, 4, 8, (AR, SD))
            s.current = AR
            s.observe(record(AR, 3, 3 / prior[AR]))
        return s

    assert after_ar_rounds().choose(1, 4, 8, (AR, SD)).choice == SD
    s = after_ar_rounds()
    assert s.choose(1, 4, 8, (AR, SD), owed_rows=256, tokens_left=32).choice == AR
    # the rule the old bound broke: the estimate after the catch-up, times the bonus, beats AR's score
    steady, n = s.estimates(1, 4, 8)
    w = s.cfg.explore * math.sqrt(math.log(n[AR] + n[SD]))
    scaled_after = s.after_catch_up(steady, 256, 32)[SD] * (1 + w / math.sqrt(n[SD]))
    assert scaled_after > steady[AR] * (1 + w / math.sqrt(n[AR])) * (1 + s.cfg.hysteresis)


def test_records_fade_with_the_seconds_decoded_not_the_rounds():
    """Drift happens in time: a choice's record weighs half after half_life_s seconds of the batch's
    rounds, whether those were 10 long rounds or 1000 short ones (at 30-200 ms a round, forgetting per
    round re-tried losing choices every half minute)."""
    for rounds in (10, 1000):
        s = measured_scheduler(half_life_s=60.0)
        s.observe(record(SD, 3, 1.0))
        w0 = s.records[(SD, bucket(1))].weight
        for _ in range(rounds):
            s.observe(record(AR, 3, 60.0 / rounds))
        _, n = s.estimates(1, 4, 8)
        assert abs((n[SD] - s.cfg.prior_rounds) - w0 / 2) < 1e-9
