"""Which decoding to run for the next round: SSD (neural or fast backup), SD or AR.

Every round each request asks the policy, with b = the number of sequences decoding now. The
policy predicts each choice's tokens per second per sequence from what it has measured: the
engines' forward time as a function of rows (cost_model.StepCost, reported by the engines), the
acceptance per round, the cache hit rate p and the fast backup's latency. With K draft tokens and
B speculation branches per sequence:

    AR        1 / T_t(b)
    SD        E_sd / (K T_d(b) + T_t(b(K+1)))
    SSD(kind) [p E_hit + (1-p) E_miss(kind)] / (max(T_v, T_s) + (1 - p^b) T_backup(kind))
              T_v = T_t(b(K+1)),  T_s = T_d(b(K+1)) + K T_d(bB)   (verify and speculation overlap)
              T_backup(neural) = K T_d(m), m = expected missing rows; T_backup(fast) = measured

The whole batch waits for any row that misses (probability 1 - p^b), and the speculation tree puts
b B rows through the drafter per step, so SSD's edge shrinks as b grows: a fast backup first, then
plain SD (no tree), then AR (no draft rows at all) take over once they predict more tokens/s.
E_miss(fast) is measured for free: after each round we score what the n-gram lookup would have
proposed; until SSD has run, E_hit is taken as E_sd (a cached branch is what SD would have drafted).
The formulas count forward time only; what they miss (Python, BLS, sampling, two engines sharing
memory bandwidth) is learned as a calibration factor per choice and batch-size bucket (1, 2-3,
4-7, ...): measured tokens/s over predicted, from the rounds that choice ran at that batch size
(the choice's factor over all sizes until a bucket has 3 rounds). So the formulas extrapolate and
the measurements decide. Statistics only come from running a choice, so one that has not run at
this batch size for a while gets a probe (``explore``): every sequence runs it for the next ~2
rounds, so it is measured the way it would run (a lone SSD round among SD rounds would stall the
drafter for the whole batch); 1 probe per 8 rounds while the choice has fewer than 3 measurements
there, 1 per 256 after, and never while even ``explore_margin`` times its prediction stays below
the best one. A new choice must predict ``hysteresis`` more than the current one, and a choice
stays at least ``min_dwell`` rounds: every switch into SSD costs a round
without a cached draft, so flapping on noise would cost more than it gains.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .cost_model import StepCost

CHOICES = ("ssd+neural", "ssd+fast", "sd", "ar")


@dataclass
class Ema:
    value: float
    alpha: float = 0.1
    count: int = 0

    def update(self, x: float) -> None:
        # a plain mean over the first 1/alpha samples, so the prior is forgotten quickly
        self.count += 1
        a = max(self.alpha, 1.0 / self.count)
        self.value = (1 - a) * self.value + a * x


@dataclass
class Decision:
    mode: str  # ssd | sd | ar
    backup: str  # neural | fast (what drafts after a miss; meaningful for ssd)
    reason: str  # policy | forced | request | warmup | drafter down
    rates: dict[str, float] = field(default_factory=dict)  # predicted tokens/s per sequence

    @property
    def choice(self) -> str:
        return f"ssd+{self.backup}" if self.mode == "ssd" else self.mode


@dataclass
class ModePolicy:
    forced_backup: str | None = None  # "neural" | "fast" | None (auto)
    forced_mode: str | None = None  # one of CHOICES, or None (auto)
    hysteresis: float = 0.1
    min_dwell: int = 16
    p_hit: Ema = field(default_factory=lambda: Ema(0.6))
    e_hit: Ema = field(default_factory=lambda: Ema(2.5))
    e_miss: dict = field(default_factory=lambda: {"neural": Ema(2.5), "fast": Ema(1.3)})
    t_fast: Ema = field(default_factory=lambda: Ema(0.002))  # seconds per n-gram backup call
    target: StepCost = field(default_factory=StepCost)
    drafter: StepCost = field(default_factory=StepCost)
    calib: dict = field(default_factory=dict)  # (choice, bucket or None for all sizes) -> Ema
    current: str = "ssd+neural"
    explore_new: int = 8  # rounds between tries of a choice with < 3 calibration samples
    explore_every: int = 256  # ... and of one measured before
    # (intervals and min_dwell are in rounds: ``decisions`` counts one per sequence per round)
    explore_margin: float = 1.5
    decisions: int = 0
    switched_at: int = 0
    probe: str = ""  # the choice being explored, and the decision index its probe ends at
    probe_until: int = 0
    last_run: dict = field(default_factory=dict)  # (choice, bucket) -> decision index it last ran at

    # -- predictions ------------------------------------------------------------------------------
    def model_rates(self, batch: int, k: int, budget: int) -> dict[str, float]:
        """The formulas above, forward time only (all 0 until both engines reported a forward)."""
        if not (self.target.known and self.drafter.known):
            return {c: 0.0 for c in CHOICES}
        b, T_t, T_d = max(batch, 1), self.target, self.drafter
        p = self.p_hit.value
        t_v = T_t(b * (k + 1))
        t_s = T_d(b * (k + 1)) + k * T_d(b * budget)
        missing = max(1.0, (1 - p) * b)
        t_backup = {"neural": k * T_d(missing), "fast": self.t_fast.value}
        e_sd = self.e_miss["neural"].value
        e_hit = self.e_hit.value if self.e_hit.count else e_sd
        out = {"ar": 1 / T_t(b), "sd": e_sd / (k * T_d(b) + t_v)}
        for kind in ("neural", "fast"):
            num = p * e_hit + (1 - p) * self.e_miss[kind].value
            out[f"ssd+{kind}"] = num / (max(t_v, t_s) + (1 - p ** b) * t_backup[kind])
        return out

    def _calib(self, choice: str, bucket: int | None) -> Ema:
        return self.calib.setdefault((choice, bucket), Ema(1.0, alpha=0.05))

    def factor(self, choice: str, batch: int) -> float:
        here = self._calib(choice, _bucket(batch))
        return here.value if here.count >= 3 else self._calib(choice, None).value

    def rates(self, batch: int, k: int, budget: int) -> dict[str, float]:
        """Predicted tokens/s per sequence for each choice, calibrated by what each one measured."""
        return {c: r * self.factor(c, batch) for c, r in self.model_rates(batch, k, budget).items()}

    def observe_round(self, choice: str, tokens: int, seconds: float, batch: int, k: int, budget: int) -> None:
        """A round that ran ``choice`` produced ``tokens`` in ``seconds``: calibrate its prediction."""
        if seconds <= 0 or not (self.target.known and self.drafter.known):
            return
        predicted = self.model_rates(batch, k, budget)[choice]
        if predicted > 0:
            ratio = min(max(tokens / seconds / predicted, 0.1), 10.0)
            self._calib(choice, _bucket(batch)).update(ratio)
            self._calib(choice, None).update(ratio)

    def choose(self, batch: int, k: int, budget: int, allowed: tuple[str, ...] = CHOICES) -> Decision:
        """The choice for the next round, among ``allowed`` (a request may pin its mode)."""
        if self.forced_mode and self.forced_mode in allowed:
            return _decision(self.forced_mode, "forced")
        if self.forced_backup:
            other = "ssd+neural" if self.forced_backup == "fast" else "ssd+fast"
            allowed = tuple(c for c in allowed if c != other) or allowed
        if len(allowed) == 1:
            return _decision(allowed[0], "request" if not self.forced_backup else "forced")
        if not (self.target.known and self.drafter.known):
            first = self.current if self.current in allowed else allowed[0]
            return self._ran(_decision(first, "warmup"))
        self.decisions += 1
        bk = _bucket(batch)
        rates = self.rates(batch, k, budget)
        if self.probe in allowed and self.decisions < self.probe_until:
            return self._ran(_decision(self.probe, "explore", rates), bk)
        top = max(rates[c] for c in allowed)
        per_round = max(batch, 1)  # every decoding sequence asks once per round
        stale = [c for c in allowed if self.decisions - self.last_run.get((c, bk), 0) >= per_round *
                 (self.explore_new if self._calib(c, bk).count < 3 else self.explore_every)
                 and rates[c] * self.explore_margin >= top]
        if stale:
            self.probe = min(stale, key=lambda c: self.last_run.get((c, bk), 0))
            self.probe_until = self.decisions + 2 * max(batch, 2)
            return self._ran(_decision(self.probe, "explore", rates), bk)
        best = max(allowed, key=lambda c: rates[c])
        cur = self.current if self.current in allowed else best
        settled = self.decisions - self.switched_at >= self.min_dwell * per_round
        if cur != best and (cur not in allowed or settled and rates[best] > rates[cur] * (1 + self.hysteresis)):
            cur, self.switched_at = best, self.decisions
        self.current = cur
        return self._ran(_decision(cur, "policy", rates), bk)

    def _ran(self, d: "Decision", bucket: int = 0) -> "Decision":
        self.last_run[(d.choice, bucket)] = self.decisions
        return d

    def b_star(self, k: int, budget: int, max_batch: int = 256) -> int | None:
        """Smallest batch at which SSD with the fast backup beats SSD with the neural one."""
        if not (self.target.known and self.drafter.known):
            return None
        for b in range(1, max_batch + 1):
            r = self.rates(b, k, budget)
            if r["ssd+fast"] > r["ssd+neural"]:
                return b
        return None

    # -- learning -----------------------------------------------------------------------------------
    def observe_timing(self, engine: str, timing: list) -> None:
        curve = self.target if engine == "target" else self.drafter
        for rows, seconds in timing:
            curve.observe(rows, seconds)


def _bucket(batch: int) -> int:
    return int(math.log2(max(batch, 1)))


def _decision(choice: str, reason: str, rates: dict | None = None) -> Decision:
    mode, _, backup = choice.partition("+")
    return Decision(mode, backup or "neural", reason, rates or {})
