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
proposed. A choice only replaces the current one when it predicts at least ``hysteresis`` more, so
the batch does not flap between modes on noise.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .cost_model import StepCost

CHOICES = ("ssd+neural", "ssd+fast", "sd", "ar")


@dataclass
class Ema:
    value: float
    alpha: float = 0.1
    count: int = 0

    def update(self, x: float) -> None:
        self.value = x if self.count == 0 else (1 - self.alpha) * self.value + self.alpha * x
        self.count += 1


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
    hysteresis: float = 0.05
    p_hit: Ema = field(default_factory=lambda: Ema(0.6))
    e_hit: Ema = field(default_factory=lambda: Ema(2.5))
    e_miss: dict = field(default_factory=lambda: {"neural": Ema(2.5), "fast": Ema(1.3)})
    t_fast: Ema = field(default_factory=lambda: Ema(0.002))  # seconds per n-gram backup call
    target: StepCost = field(default_factory=StepCost)
    drafter: StepCost = field(default_factory=StepCost)
    current: str = "ssd+neural"

    # -- predictions ------------------------------------------------------------------------------
    def rates(self, batch: int, k: int, budget: int) -> dict[str, float]:
        b, T_t, T_d = max(batch, 1), self.target, self.drafter
        p = self.p_hit.value
        t_v = T_t(b * (k + 1))
        t_s = T_d(b * (k + 1)) + k * T_d(b * budget)
        missing = max(1.0, (1 - p) * b)
        t_backup = {"neural": k * T_d(missing), "fast": self.t_fast.value}
        out = {"ar": 1 / T_t(b), "sd": self.e_miss["neural"].value / (k * T_d(b) + t_v)}
        for kind in ("neural", "fast"):
            num = p * self.e_hit.value + (1 - p) * self.e_miss[kind].value
            out[f"ssd+{kind}"] = num / (max(t_v, t_s) + (1 - p ** b) * t_backup[kind])
        return out

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
            return _decision(first, "warmup")
        rates = self.rates(batch, k, budget)
        best = max(allowed, key=lambda c: rates[c])
        cur = self.current if self.current in allowed else best
        if rates[best] > rates[cur] * (1 + self.hysteresis):
            cur = best
        self.current = cur
        return _decision(cur, "policy", rates)

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

    def snapshot(self) -> dict:
        return {"p_hit": round(self.p_hit.value, 3), "e_hit": round(self.e_hit.value, 3),
                "e_miss_neural": round(self.e_miss["neural"].value, 3),
                "e_miss_fast": round(self.e_miss["fast"].value, 3), "t_fast_ms": round(1000 * self.t_fast.value, 2),
                "target_s_by_rows": self.target.snapshot(), "drafter_s_by_rows": self.drafter.snapshot(),
                "current": self.current}


def _decision(choice: str, reason: str, rates: dict | None = None) -> Decision:
    mode, _, backup = choice.partition("+")
    return Decision(mode, backup or "neural", reason, rates or {})
