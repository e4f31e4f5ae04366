"""How far one request's free drafts get accepted (LookupEstimate), and what a batch's free-draft
round is expected to yield and cost (LookupOutlook), for the cost model's price of a lookup round.

A chat and a code edit differ by far: the edit's answer copies its prompt, the chat's does not,
and one request can turn from one into the other. So the estimate is per request, and it is
scored on every round whatever the round ran: the free draft the request would have had is
compared with the tokens the round produced (an AR round's block too), so a request decoding in
AR rounds learns that its lookup would now pay. Positions past the round's block are unknown and
are counted as neither accepted nor rejected.

A new request has shown no draft yet, so its estimate starts at no drafts (``p_draft`` 0): lookup is
priced as a plain target step, never above AR, until a round shows what the request's free drafts
would yield. One scored round is enough evidence to move it (the means replace their prior at the
first observation), so an edit's first AR round already prices its lookup from the copied tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .estimators import Acceptance, Ema

ADAPT = 0.2  # weight of the newest round: about five rounds follow a change of the request's text


@dataclass
class LookupEstimate:
    accept: Acceptance = field(default_factory=lambda: Acceptance(0.5, ema=ADAPT))  # per drafted position
    p_draft: Ema = field(default_factory=lambda: Ema(0.0, alpha=ADAPT))  # share of rounds with a draft
    length: Ema = field(default_factory=lambda: Ema(4.0, alpha=ADAPT))  # tokens a draft offers

    def score(self, guess: list[int], block: list[int]) -> int:
        """One round: the free draft ``guess`` against the ``block`` the target produced; returns
        how many of the guess's tokens the target would have accepted."""
        self.p_draft.update(1.0 if guess else 0.0)
        if not guess or not block:
            return 0
        self.length.update(len(guess))
        n = min(len(guess), len(block))
        agree = next((i for i in range(n) if guess[i] != block[i]), n)
        self.accept.update(agree, agree + 1 if agree < n else agree)  # no mismatch seen: censored
        return agree

    def outlook(self) -> "LookupOutlook":
        return LookupOutlook(self.accept.alpha, self.p_draft.value, self.length.value)


@dataclass(frozen=True)
class LookupOutlook:
    """A round of free drafts capped at K: its expected tokens (the accepted drafts plus the
    target's own) and verify rows per sequence. A round with a draft offers min(K, length) tokens."""

    alpha: float = 0.0
    p_draft: float = 0.0
    length: float = 0.0
    k_max: int = 31  # the longest draft a round may verify (ServerConfig.lookup_max_k, the verify's rows)

    def drafted(self, k: int) -> float:
        return min(float(k), self.length)

    def tokens(self, k: int) -> float:
        d = self.drafted(k)
        whole = int(d)
        accepted = sum(self.alpha ** i for i in range(1, whole + 1)) + (d - whole) * self.alpha ** (whole + 1)
        return 1.0 + self.p_draft * accepted

    def rows(self, k: int) -> float:
        return 1.0 + self.p_draft * self.drafted(k)

    @staticmethod
    def mean(outlooks: list["LookupOutlook"], k_max: int) -> "LookupOutlook":
        """The batch's: each figure averaged over its sequences (a batch verifies all their rows)."""
        if not outlooks:
            return LookupOutlook(k_max=k_max)
        n = len(outlooks)
        return LookupOutlook(sum(o.alpha for o in outlooks) / n, sum(o.p_draft for o in outlooks) / n,
                             sum(o.length for o in outlooks) / n, k_max)
