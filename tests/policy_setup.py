"""The scheduler tests' shared setup: a scheduler whose cost model has measured engines of a known
shape, and rounds fed to it at chosen rates (test_scheduler.py, test_cost_model.py); a policy that
switches the choice every round (the exactness tests)."""
from __future__ import annotations

from ssd.algorithm.rounds import SPLIT_CHOICES, Choice, RoundRecord
from ssd.algorithm.scheduler import Scheduler


def alpha_at_k4(tokens_at_k4: float) -> float:
    """The per-position acceptance whose rounds of K = 4 yield ``tokens_at_k4`` tokens."""
    lo, hi = 0.0, 0.999
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(5)) < tokens_at_k4 else (lo, mid)
    return lo


def measured_scheduler(e_draft: float = 3.6, e_hit: float = 3.9, p_hit: float = 0.8, drafter_scale: float = 1.0,
                       **config) -> Scheduler:
    """A scheduler whose cost model has measured a bandwidth-bound-then-compute-bound target and drafter."""
    from ssd.algorithm.scheduler import PolicyConfig

    s = Scheduler(PolicyConfig(**config))
    for rows, sec in ((1, 0.30), (8, 0.30), (32, 0.33), (128, 1.2), (512, 4.8)):
        s.model.target.observe(rows, sec)
    for rows, sec in ((1, 0.08), (8, 0.08), (32, 0.10), (128, 0.40), (512, 1.6)):
        s.model.drafter.observe(rows, sec * drafter_scale)
    s.model.p_hit["model"].value = s.model.p_hit["fast"].value = p_hit
    s.model.accept["cache"].alpha = alpha_at_k4(e_hit)
    s.model.accept["cache"].count = 1
    s.model.accept["neural"].alpha, s.model.accept["fast"].alpha = alpha_at_k4(e_draft), alpha_at_k4(1.5)
    s.model.t_fast.value = 0.003
    return s


def verify_bound_scheduler(drafter_row_cost: float) -> Scheduler:
    """A target whose verify of 1-5 rows costs what one row does (0.10 s); each drafter forward
    costs 0.022 s plus ``drafter_row_cost`` per row."""
    s = Scheduler()
    for rows, sec in ((1, 0.100), (2, 0.100), (4, 0.105), (8, 0.115), (32, 0.20)):
        s.model.target.observe(rows, sec)
    for rows in (1, 2, 4, 8, 16, 32):
        s.model.drafter.observe(rows, 0.022 + drafter_row_cost * rows)
    s.model.p_hit["model"].value = s.model.p_hit["fast"].value = 0.65
    s.model.accept["cache"].alpha = s.model.accept["neural"].alpha = 0.8
    s.model.accept["cache"].count = 1
    return s


def record(choice, tokens: float, seconds: float, batch: int = 1, after_switch: bool = False) -> RoundRecord:
    return RoundRecord(choice=Choice(choice), reason="policy", k=4, budget=8, batch=batch, tokens=tokens,
                       seconds=seconds, source="none", drafted=0, hit=None, after_switch=after_switch)


def run_batch(s: Scheduler, rates: dict, batch: int, rounds: int, allowed=SPLIT_CHOICES) -> list:
    """``rounds`` rounds of a batch of ``batch`` sequences, each choice running at ``rates[choice]``
    tokens/s per sequence (a callable of the round number, or a number); the decisions, one a round."""
    seen = []
    for i in range(rounds):
        d = None
        for j in range(batch):
            d = s.choose(batch, 4, 8, allowed, seq=f"s{j}")
        seen.append(d)
        rate = rates[d.choice](i) if callable(rates[d.choice]) else rates[d.choice]
        switched = len(seen) > 1 and seen[-2].choice != d.choice and not seen[-2].choice.switch_is_free(d.choice)
        for _ in range(batch):
            s.observe(record(d.choice, 3, 3 / rate, batch, after_switch=switched))
    return seen


class CyclingPolicy(Scheduler):
    """Switches the choice every round through ``order`` (and K through ``ks``, when given, as an
    adaptive policy may pick it): every transition between modes, round after round."""

    def __init__(self, order: list[str], ks: list[int] = ()):
        super().__init__()
        self.order, self.ks, self.rounds = order, ks, 0

    def choose(self, batch, k, budget, allowed, seq=None, adaptive_k=False, **backlog):
        self.forced_mode = self.order[self.rounds % len(self.order)]
        d = super().choose(batch, k, budget, allowed, seq, adaptive_k, **backlog)
        if self.ks:
            d.ks = {d.choice: self.ks[self.rounds % len(self.ks)]}
        self.rounds += 1
        return d
