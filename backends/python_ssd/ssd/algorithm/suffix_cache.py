"""The suffix cache: earlier requests' prompts and outputs, indexed for free drafts.

What an agent loop, a repeated task or a second edit of the same file will write has often been
written before: the cache keeps each finished request's tokens (prompt and output, one document)
in a ``TokenIndex`` and offers the places whose preceding tokens match the end of a sequence;
``free_draft.propose`` scores their continuations by how often each followed. It is bounded in
tokens: a request that would pass ``max_tokens`` evicts the oldest documents first (a longer one
keeps its last ``max_tokens`` tokens). ``max_tokens = 0`` turns it off.

A shared cache never puts another request's text into an output: a draft is only a guess that the
target verifies token by token, so the output is the target's own whatever the cache holds. What
it can show is timing: a continuation that was seen before decodes faster (docs/design.md).
"""
from __future__ import annotations

from .token_index import DEFAULT_KEY_LENS, TokenIndex


class SuffixCache:
    def __init__(self, max_tokens: int, key_lens: tuple[int, ...] = DEFAULT_KEY_LENS):
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.index = TokenIndex(key_lens)
        self._next_doc = 0
        self.evicted = 0  # documents dropped to keep the bound

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    @property
    def tokens(self) -> int:
        return self.index.tokens

    def add(self, tokens: list[int]) -> None:
        """Keeps a finished request's tokens, evicting the oldest documents past the bound."""
        if not self.enabled or not tokens:
            return
        tokens = list(tokens[-self.max_tokens:])
        while self.index.tokens + len(tokens) > self.max_tokens:
            self.index.remove_oldest()
            self.evicted += 1
        self.index.extend(self._next_doc, tokens)
        self._next_doc += 1
