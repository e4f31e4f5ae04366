"""Free drafts: a continuation of the sequence found in text already seen, no model computing.

Two sources feed one proposal: the request's own sequence (prompt lookup: an edit copies its
prompt, an answer quotes it) and the suffix cache of earlier requests (an agent repeats its tool
calls and JSON shapes). Each offers the places whose preceding tokens match the end of the
sequence (``TokenIndex.matches``); the places with the longest match are the candidates, and the
draft follows them a token at a time, taking the continuation most of them agree on (frequency
scoring, as SuffixDecoding scores a suffix tree's children). The draft stops where the share of
candidates that still agree with it falls below ``min_confidence``, and it is at most
``spec_factor`` tokens per matched token: a 2-token match is a weak hint, a 30-token match of a
copied function is a strong one. A draft is deterministic, so the verifier treats its q as
one-hot and sampled decoding stays exact; an empty draft makes the round a plain target step.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from .suffix_cache import SuffixCache
from .token_index import DEFAULT_KEY_LENS, TokenIndex


@dataclass(frozen=True)
class FreeDraftConfig:
    candidates: int = 32  # places read per source and look-up, the most recent first
    max_match: int = 32  # tokens a match is followed back
    spec_factor: float = 1.0  # draft tokens per matched token at most (SuffixDecoding's max_spec_factor)
    min_confidence: float = 0.3  # a draft stops where fewer of its candidates agree


class FreeDrafter:
    """One request's free drafts: an index over its own sequence, kept up with it, and the
    server's suffix cache where its scope allows (None: the request's own text only)."""

    def __init__(self, cache: SuffixCache | None = None, cfg: FreeDraftConfig = FreeDraftConfig(),
                 key_lens: tuple[int, ...] = DEFAULT_KEY_LENS):
        self.cache = cache if cache is not None and cache.enabled else None
        self.cfg = cfg
        self.own = TokenIndex(key_lens)

    def propose(self, sequence: list[int], k: int) -> list[int]:
        """A draft of at most ``k`` tokens continuing ``sequence`` (empty: nothing seen fits)."""
        own = self.own.docs.get(0, [])
        if len(own) > len(sequence) or own != sequence[:len(own)]:
            raise ValueError("a request's sequence only grows between proposals")
        self.own.extend(0, sequence[len(own):])
        if k <= 0:
            return []
        found = self._candidates(self.own, sequence, k)
        if self.cache is not None:
            found += self._candidates(self.cache.index, sequence, k)
        return continuation(found, k, self.cfg)

    def _candidates(self, index: TokenIndex, sequence: list[int], k: int) -> list[tuple[int, list[int]]]:
        out = []
        for doc, end, m in index.matches(sequence, self.cfg.candidates, self.cfg.max_match):
            follow = index.docs[doc][end:end + k]
            if follow:  # the sequence's own end matches itself and has nothing after it
                out.append((m, follow))
        return out


def continuation(candidates: list[tuple[int, list[int]]], k: int, cfg: FreeDraftConfig) -> list[int]:
    """The draft the longest-matching ``candidates`` (match length, following tokens) agree on."""
    if not candidates:
        return []
    best = max(m for m, _ in candidates)
    alive = [follow for m, follow in candidates if m == best]
    draft: list[int] = []
    confidence = 1.0
    for i in range(min(k, max(1, math.floor(cfg.spec_factor * best)))):
        counts = Counter(f[i] for f in alive if len(f) > i)
        if not counts:
            break
        token, n = counts.most_common(1)[0]  # ties: the most recent place (candidates come in that order)
        confidence *= n / sum(counts.values())
        if confidence < cfg.min_confidence:
            break
        draft.append(token)
        alive = [f for f in alive if len(f) > i and f[i] == token]
    return draft
