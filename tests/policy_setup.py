"""The policy tests' shared setup: a policy that has measured engines of a known shape, and
rounds fed to it at chosen rates (test_policy.py, test_policy_switching.py, test_speedup_model.py)."""
from __future__ import annotations

from ssd.algorithm.policy import ModePolicy


def alpha_at_k4(tokens_at_k4: float) -> float:
    """The per-position acceptance whose rounds of K = 4 yield ``tokens_at_k4`` tokens."""
    lo, hi = 0.0, 0.999
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** i for i in range(5)) < tokens_at_k4 else (lo, mid)
    return lo


def measured_policy(e_draft: float = 3.6, e_hit: float = 3.9, p_hit: float = 0.8, drafter_scale: float = 1.0):
    """A policy that has measured a bandwidth-bound-then-compute-bound target and drafter."""
    pol = ModePolicy()
    for rows, s in ((1, 0.30), (8, 0.30), (32, 0.33), (128, 1.2), (512, 4.8)):
        pol.model.target.observe(rows, s)
    for rows, s in ((1, 0.08), (8, 0.08), (32, 0.10), (128, 0.40), (512, 1.6)):
        pol.model.drafter.observe(rows, s * drafter_scale)
    pol.model.p_hit["model"].value = pol.model.p_hit["fast"].value = p_hit
    pol.model.e_hit.alpha = alpha_at_k4(e_hit)
    pol.model.e_miss["neural"].alpha, pol.model.e_miss["fast"].alpha, pol.model.t_fast.value = alpha_at_k4(e_draft), alpha_at_k4(1.5), 0.003
    pol.model.e_hit.count = 1
    pol.explore_new = pol.explore_every = 10**9  # these tests check the prediction, not exploration
    pol.min_dwell = 0
    return pol


def measure_rounds(pol: ModePolicy, choice: str, rate: float, batch: int, rounds: int = 3) -> None:
    """``rounds`` rounds of ``choice`` at ``batch`` sequences, each at ``rate`` tokens/s per sequence."""
    for _ in range(rounds * batch):
        pol.observe_round(choice, 2, 2 / rate, batch, 4, 8)


def verify_bound_policy(drafter_row_cost: float) -> ModePolicy:
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


def ssd_rounds(pol, choice: str, pattern: str, hit=(4, 1.0), miss=(3, 1.3), batch: int = 1) -> None:
    """SSD rounds in ``pattern`` order, each reported by every one of ``batch`` sequences:
    h = from a cache hit, m = from the backup."""
    backup = choice.partition("+")[2]
    for x in pattern:
        tokens, seconds = hit if x == "h" else miss
        pol.rounds += 1  # as choose() counts them
        for _ in range(batch):
            pol.observe_round(choice, tokens, seconds, batch, 4, 8, source="cache" if x == "h" else backup)
