"""The running estimates the mode policy learns from: a mean that forgets its prior (Ema), a
choice's own record of tokens and seconds per round (Measured) and a draft source's per-position
acceptance (Acceptance)."""
from __future__ import annotations

from dataclasses import dataclass, field

MEASURED = 2  # rounds after which a record counts as a measurement (of a choice at a batch size)


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
class Measured:
    """A choice's own record at one batch-size bucket: running means of tokens and of seconds per
    round (their ratio, not a mean of ratios, so a slow round weighs by its length), how many
    rounds it has seen and the policy round it last saw one at. A request's first round goes into
    the means but not into ``count``: it has no cached draft and pays for the drafter's prefill
    whatever the choice, so a record made of first rounds alone says little about the choice and
    gives way to its first counted round; later first rounds stay in the means, at their share
    of a choice's rounds (traced, batch 1: SSD with the neural backup had run just two requests'
    first rounds, at 1.45 tok/s; over whole requests it ran 2.7, yet that record kept it off for
    256 rounds)."""

    tokens: Ema = field(default_factory=lambda: Ema(0.0, alpha=0.05))
    seconds: Ema = field(default_factory=lambda: Ema(1.0, alpha=0.05))
    count: float = 0  # rounds seen (weights), kept when the means forget
    last: int = 0  # the policy round of the latest one

    def update(self, tokens: float, seconds: float, weight: float, now: int = 0, counts: bool = True) -> None:
        if counts and self.count == 0:
            self.forget(keep=0.0)  # the choice's own first round replaces a record of requests' starts
        self.tokens.update(tokens, weight)
        self.seconds.update(seconds, weight)
        self.count += weight if counts else 0.0
        self.last = now

    def forget(self, keep: float = 0.5) -> None:
        """Let the next rounds outweigh the old ones: the means keep ``keep`` rounds of weight.
        (A record left alone while the machine drifted is stale; one new round at the usual
        5% would barely move it.)"""
        for e in (self.tokens, self.seconds):
            e.count = min(e.count, keep)

    @property
    def rate(self) -> float:
        return self.tokens.value / max(self.seconds.value, 1e-9)


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
