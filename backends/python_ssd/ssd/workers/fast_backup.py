"""The fast backup's process: n-gram prompt lookup, no model. Deterministic drafts (q' one-hot)."""
from __future__ import annotations

from ..algorithm.ngram import propose
from .protocol import DraftCall, DraftResult


class NgramWorker:
    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def draft(self, calls: list[DraftCall]) -> list[DraftResult]:
        return [DraftResult(propose(c.tokens, c.k, self.max_n, self.min_n), None) for c in calls]

    def release(self, seq_id: str) -> None:
        pass
