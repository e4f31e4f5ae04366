"""Which backup drafts after a cache miss: the neural drafter or the n-gram lookup.

The whole batch waits for any row that misses, and all b rows hit with probability p_hit^b, so a
slow, accurate backup pays at small batch and a free, rough one at large batch. Per round we compare
the speedup model for both kinds at the current batch size b with running estimates:

    rate(kind) = [p E_hit + (1-p) E_miss(kind)] / [h max(1, T_p) + (1-h)(1 + T_b(kind))],  h = p^b

E_miss(fast) is measured for free: after every round we score what the n-gram lookup *would* have
proposed against the tokens the target actually produced. b* is the smallest b where fast wins.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Ema:
    value: float
    alpha: float = 0.1
    count: int = 0

    def update(self, x: float) -> None:
        self.value = x if self.count == 0 else (1 - self.alpha) * self.value + self.alpha * x
        self.count += 1


@dataclass
class BackupPolicy:
    forced: str | None = None  # "neural" | "fast" | None (auto)
    p_hit: Ema = field(default_factory=lambda: Ema(0.6))
    e_hit: Ema = field(default_factory=lambda: Ema(2.5))
    e_miss: dict = field(default_factory=lambda: {"neural": Ema(2.5), "fast": Ema(1.3)})
    t_p: Ema = field(default_factory=lambda: Ema(1.0))
    t_b: dict = field(default_factory=lambda: {"neural": Ema(1.0), "fast": Ema(0.01)})

    def rate(self, kind: str, batch: int) -> float:
        """Tokens per target-verify time for one row. Its tokens depend on its own hit (p), the
        round's length on whether *any* row missed (1 - p^b)."""
        p = self.p_hit.value
        h = p ** max(batch, 1)
        num = p * self.e_hit.value + (1 - p) * self.e_miss[kind].value
        den = h * max(1.0, self.t_p.value) + (1 - h) * (1 + self.t_b[kind].value)
        return num / den

    def choose(self, batch: int) -> tuple[str, str]:
        if self.forced:
            return self.forced, "forced by config"
        neural, fast = self.rate("neural", batch), self.rate("fast", batch)
        kind = "fast" if fast > neural else "neural"
        return kind, f"b={batch} rate neural={neural:.2f} fast={fast:.2f}"

    def b_star(self, max_batch: int = 256) -> int | None:
        for b in range(1, max_batch + 1):
            if self.rate("fast", b) > self.rate("neural", b):
                return b
        return None
