"""What a request's rounds draft, or could have drafted, for free: no drafter computes.

- Lookup rounds (SD whose drafts are free, algorithm/free_draft.py: the sequence's own text and the
  suffix cache of earlier requests): the draft a round verifies and the K it runs, its own, up to
  what the verify keeps exact.
- Scoring on every round, whatever the round ran: the free draft the request could have had
  against the round's tokens keeps its lookup estimate (algorithm/lookup_estimate.py), and so the
  price of its lookup rounds, on its text; the fast backup's guess (that draft cut to K, or the
  n-gram lookup's where it has none) is scored the same way for the cost model's fast acceptance.
"""
from __future__ import annotations

import time

from ..algorithm.free_draft import FreeDrafter
from ..algorithm.lookup_estimate import LookupEstimate, LookupOutlook
from ..algorithm.suffix_cache import SuffixCache
from ..workers.protocol import DraftResult


class LookupRounds:
    """One request's free drafts and its lookup estimate (the batch's outlook averages these)."""

    def __init__(self, suffix_cache: SuffixCache | None, max_k: int):
        self.free = FreeDrafter(suffix_cache)
        self.estimate = LookupEstimate()
        self.max_k = max_k
        self._longest: tuple[int, list[int]] = (-1, [])  # (sequence length, its longest draft)

    def longest(self, prefix: list[int]) -> list[int]:
        """The longest free draft continuing ``prefix``, proposed once per sequence length (the
        sequence only grows); a shorter K's draft is its start, so a round's draft, its scoring and
        the fast backup share one proposal."""
        if self._longest[0] != len(prefix):
            self._longest = (len(prefix), self.free.propose(prefix, self.max_k))
        return self._longest[1]

    def up_to(self, prefix: list[int], k: int) -> list[int]:
        """A free draft of at most ``k`` tokens: the start of the longest one where it reaches ``k``."""
        return self.longest(prefix)[:max(k, 0)] if k <= self.max_k else self.free.propose(prefix, k)

    def score(self, prefix: list[int], block: list[int]) -> list[int]:
        """Scores the free draft this round could have had (its longest) against the round's tokens;
        returns it (the fast backup's guess is its start)."""
        longest = self.longest(prefix)
        self.estimate.score(longest, block)
        return longest

    @staticmethod
    def k(decision, model, batch: int, outlook: LookupOutlook) -> int:
        """A lookup round's K: the scheduler's for its choice, else the cost model's best for the
        batch's outlook, never past what the verify keeps exact (``outlook.k_max``)."""
        return min(decision.ks.get(decision.choice) or model.lookup_k(batch, outlook, decision.choice.wide),
                   outlook.k_max)

    def draft(self, prefix: list[int], k: int) -> tuple[DraftResult, float]:
        """The round's draft (deterministic: the verifier's q is one-hot) and its seconds."""
        t0 = time.perf_counter()
        draft = DraftResult(self.up_to(prefix, k), None)
        return draft, time.perf_counter() - t0


def agreeing(guess: list[int], block: list[int]) -> int:
    """How many of ``guess``'s tokens the target would have accepted, given the round's ``block``."""
    return next((i for i, (a, b) in enumerate(zip(guess, block)) if a != b), min(len(guess), len(block) - 1))
