"""The cost model's running estimates: a mean that forgets its prior (Ema) and a draft source's
per-position acceptance (Acceptance)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Ema:
    value: float
    alpha: float = 0.1
    count: float = 0  # total weight seen

    def update(self, x: float, weight: float = 1.0) -> None:
        # a weighted mean over the first 1/alpha of weight, so the prior is forgotten quickly; then
        # each unit of weight moves the value by alpha
        self.count += weight
        a = min(1.0, max(self.alpha * weight, weight / self.count))
        self.value = (1 - a) * self.value + a * x


@dataclass
class Acceptance:
    """How far a draft source's drafts get accepted, as a per-position acceptance rate alpha, so
    the tokens a round yields can be predicted for any K: E(K) = 1 + alpha + ... + alpha^K. (A
    mean of tokens per round would carry K = 4's figure over to a round capped at K = 1, where
    it is nearly twice too high.) Running means of accepted tokens and of positions tried."""

    alpha: float  # the prior
    count: int = 0
    ema: float = 0.05
    _accepted: float = field(init=False)
    _tried: float = field(init=False, default=1.0)

    def __post_init__(self) -> None:
        self._accepted = self.alpha  # the prior, as one round's worth of positions

    def update(self, accepted: int, drafted: int) -> None:
        """A round drafted ``drafted`` tokens and the target accepted the first ``accepted``."""
        if drafted <= 0:
            return
        self.count += 1
        a = max(self.ema, 1.0 / (self.count + 1))  # the prior weighs as one round
        self._accepted += a * (accepted - self._accepted)
        self._tried += a * (accepted + (accepted < drafted) - self._tried)
        self.alpha = min(self._accepted / self._tried, 0.999)

    def tokens(self, k: int) -> float:
        """Expected tokens per round with K = ``k`` (the accepted ones plus the target's own)."""
        return sum(self.alpha ** i for i in range(k + 1))
