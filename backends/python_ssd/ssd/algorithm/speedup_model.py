"""The speedup model: tokens per second per sequence of each choice, predicted from what was measured.

The policy (policy.py) decides; this module only predicts. With K draft tokens, B speculation
branches per sequence and b sequences decoding together:

    AR        1 / T_t(b)
    SD        E_sd / (K T_d(b) + T_t(b(K+1)))
    SSD(kind) [p E_hit + (1-p) E_miss(kind)] / (max(T_v, T_s) + (1 - p^b) T_backup(kind))
              T_v = T_t(b(K+1)),  T_s = T_d(b(K+1)) + K T_d(bB)   (verify and speculation overlap)
              T_backup(neural) = K T_d(m), m = expected missing rows; T_backup(fast) = measured
              p = the share of rounds whose draft is a cache hit (below)

T_t and T_d are the engines' forward time as a function of rows (cost_model.StepCost, reported by
the engines); E is the tokens a round yields from a draft source's per-position acceptance
(estimators.Acceptance), so any K can be priced.

The hit rate depends on what the round verifies. A model-quality draft (a cached branch or the
neural backup's) is accepted far and wide, so its outcome (k, t*) is hard to guess: p_m. An n-gram
draft is mostly rejected at once (k = 0), which the speculation's widest fan-out covers: p_f, much
higher. With the neural backup every draft is model-quality, p = p_m. With the fast backup a hit
leads to a model-quality round and a miss to an n-gram round: a two-state chain whose share of
hit rounds is p = p_f / (1 - p_m + p_f). One hit rate for both (what SSD ran last) under-rated
whichever backup was not running: measured served at batch 1, the policy kept the neural backup
(p 0.52) at 3.6-4.1 tok/s where the fast one ran at 4.8-5.4 (p 0.61).

The whole batch waits for any row that misses (probability 1 - p^b), and the speculation tree puts
b B rows through the drafter per step, so SSD's edge shrinks as b grows. E_miss(fast) is measured
for free: after each round the caller scores what the n-gram lookup would have proposed; until SSD
has run, E_hit is taken as E_sd (a cached branch is what SD would have drafted). The formulas count
forward time only; the policy learns what they miss as a calibration factor.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .cost_model import StepCost
from .estimators import Acceptance, Ema

CHOICES = ("ssd+neural", "ssd+fast", "sd", "ar")


def free_switch(a: str, b: str) -> bool:
    """Whether moving between choices ``a`` and ``b`` costs nothing: the two SSD choices run the
    same speculation and keep its cache, and differ only in what drafts after a miss. Any other
    switch costs a round (the drafter catches up on the rounds it sat out; SSD's first round has
    no cached draft)."""
    return a.startswith("ssd") and b.startswith("ssd")


@dataclass
class SpeedupModel:
    # cache hit rate by the source of the draft being verified: "model" (cached / neural) or "fast"
    p_hit: dict = field(default_factory=lambda: {"model": Ema(0.6), "fast": Ema(0.8)})
    e_hit: Acceptance = field(default_factory=lambda: Acceptance(0.7))  # drafts from the speculation cache
    e_miss: dict = field(default_factory=lambda: {"neural": Acceptance(0.7), "fast": Acceptance(0.25)})
    t_fast: Ema = field(default_factory=lambda: Ema(0.002))  # seconds per n-gram backup call
    target: StepCost = field(default_factory=StepCost)
    drafter: StepCost = field(default_factory=StepCost)
    tree_slack: float = 0.25  # share of a verify the speculation's extra branches may cost (tree_budget)
    k_margin: float = 0.10  # a shorter K must predict this much more (per-round costs the formulas omit)

    @property
    def known(self) -> bool:
        """Both engines reported a forward: until then nothing can be priced."""
        return self.target.known and self.drafter.known

    def rates(self, batch: int, k: int, budget: int) -> dict[str, float]:
        """The formulas above, forward time only (all 0 until both engines reported a forward)."""
        if not self.known:
            return {c: 0.0 for c in CHOICES}
        b, T_t, T_d = max(batch, 1), self.target, self.drafter
        t_v = T_t(b * (k + 1))
        t_s = T_d(b * (k + 1)) + k * T_d(b * budget)
        e_sd = self.e_miss["neural"].tokens(k)
        e_hit = self.e_hit.tokens(k) if self.e_hit.count else e_sd
        out = {"ar": 1 / T_t(b), "sd": e_sd / (k * T_d(b) + t_v)}
        for kind in ("neural", "fast"):
            p = self.hit_share(kind)
            num = p * e_hit + (1 - p) * self.e_miss[kind].tokens(k)
            out[f"ssd+{kind}"] = num / (max(t_v, t_s) + (1 - p ** b) * self.backup_seconds(kind, b, k))
        return out

    def backup_seconds(self, kind: str, batch: int, k: int) -> float:
        """What a round that misses waits for its backup: the drafter's K steps over the expected
        missing rows (neural), or the n-gram lookup's measured time (fast)."""
        if kind == "fast":
            return self.t_fast.value
        return k * self.drafter(max(1.0, (1 - self.hit_share(kind)) * max(batch, 1)))

    def rates_at(self, batch: int, k: int, budget: int, ks: dict[str, int] | None) -> dict[str, float]:
        """``rates`` per choice at its own K (``ks``, each K with its tree budget under ``budget``),
        one evaluation per distinct K; None: every choice at ``k`` and ``budget``."""
        if ks is None:
            return self.rates(batch, k, budget)
        at = {kc: self.rates(batch, kc, self.tree_budget(batch, kc, budget)) for kc in set(ks.values()) | {k}}
        return {c: at[ks.get(c, k)][c] for c in CHOICES}

    def best_k(self, batch: int, k_max: int, budget: int) -> dict[str, int]:
        """Each choice's K for a round at this batch size: the K <= ``k_max`` whose formula predicts
        the most tokens/s, each K with its own fan-out budget (``tree_budget`` under ``budget``).
        The policy's calibration factor multiplies every K of a choice alike, so the formula alone
        ranks them. Why per choice: SSD's round lasts max(verify, speculation), and the speculation
        (glue pass + K tree steps) grows with K while a short verify costs what one row does; at
        batch 1 a K that SD drafts well leaves SSD waiting for its drafter (traced: speculation
        0.86 s against a 0.42-s verify at K = 4). A shorter K must win by ``k_margin``: each round
        also pays costs the formulas leave out (Python, IPC), which favour fewer, longer rounds, and
        where the speculation nearly fits a verify the curves' noise decides: at 3% the served
        bench on the AVX2-only EPYC drafted K < 4 in 9 of 18 rounds (t_p 0.77) and its rounds
        yielded 2.7 tokens against 3.5 in-process at K = 4 (the switch-to-short K it is for won
        by far more: 1.7 verifies per speculation on the AVX-512 EPYC)."""
        if not self.known:
            return {c: k_max for c in CHOICES}
        best: dict[str, tuple[int, float]] = {}
        for k in range(k_max, 0, -1):
            for c, r in self.rates(batch, k, self.tree_budget(batch, k, budget)).items():
                if c not in best or r > best[c][1] * (1 + self.k_margin):
                    best[c] = (k, r)
        return {c: k for c, (k, _) in best.items()}

    def tree_budget(self, batch: int, k: int, budget: int) -> int:
        """This round's fan-out budget: the largest B <= ``budget`` whose speculation tree costs the
        drafter at most ``tree_slack`` of a verify more than the smallest tree (B = K + 1, one
        branch per depth). At batch 1 the drafter is bound by reading its weights and 8 branches
        cost what 5 do, so B stays; at batch 16 a tree of b B = 128 rows is compute-bound and
        takes several verifies, so B shrinks until the speculation fits again (as K does for the
        target's rows, ``SharedState.round_k``). Fewer branches lower the hit rate, never the
        output: every round is verified in full."""
        floor = k + 1
        if budget <= floor or not self.known:
            return budget
        b = max(batch, 1)
        base, allowance = self.drafter(b * floor), self.tree_slack * self.target(b * (k + 1)) / k
        return next((B for B in range(budget, floor, -1) if self.drafter(b * B) - base <= allowance), floor)

    def hit_share(self, backup: str) -> float:
        """The share of SSD rounds that start from a cache hit with this backup (see the top)."""
        p_m, p_f = self.p_hit["model"].value, self.p_hit["fast"].value
        return p_m if backup == "neural" else p_f / max(1.0 - p_m + p_f, 1e-9)

    # -- learning -----------------------------------------------------------------------------------
    def observe_lookup(self, draft_source: str, hit: bool) -> None:
        """A round whose draft came from ``draft_source`` (cache | neural | fast) was verified and
        its outcome was (``hit``) or was not among the pre-drafted branches."""
        self.p_hit["fast" if draft_source == "fast" else "model"].update(float(hit))

    def observe_timing(self, engine: str, timing: list) -> None:
        """An engine's forwards as (rows, seconds): ``engine`` is "target" or "drafter"."""
        curve = self.target if engine == "target" else self.drafter
        for rows, seconds in timing:
            curve.observe(rows, seconds)
