"""Where short runs of tokens occur in a set of token documents: the index behind free drafts.

A document is a token list (one request's sequence, or an earlier request's prompt and output);
every run of ``key_len`` tokens in it is indexed by where it ends, for each of the index's key
lengths. A long key finds long matches anywhere in a large index in one look-up, where the short
key's list of a common pair (two spaces, ``):``) holds thousands of places and only its most recent
ones are read; the short keys still find a continuation where no long run repeats. The 1-token key
serves the token right after a new one: in structured output (``"title": "<new text>", "``) the
separator that follows a value has never occurred after that value, yet what follows the separator
is the structure's own next token.
Documents leave in the order they came (``remove_oldest``): each key's list is in insertion
order, so a leaving document's entries are at the front of every list that holds them.
"""
from __future__ import annotations

from collections import deque

DEFAULT_KEY_LENS = (8, 2, 1)


class TokenIndex:
    def __init__(self, key_lens: tuple[int, ...] = DEFAULT_KEY_LENS):
        if not key_lens or min(key_lens) < 1:
            raise ValueError(f"key_lens must be positive lengths, got {key_lens}")
        self.key_lens = tuple(sorted(set(key_lens), reverse=True))
        self.docs: dict[int, list[int]] = {}  # insertion order: the oldest first
        self._where: dict[tuple, deque] = {}  # key -> deque of (doc, end): doc[end - len(key):end] == key
        self.tokens = 0  # indexed tokens over every document

    def extend(self, doc: int, tokens: list[int]) -> None:
        """Appends ``tokens`` to document ``doc`` (a new one when unseen) and indexes the runs they end."""
        seq = self.docs.setdefault(doc, [])
        start = len(seq)
        seq.extend(tokens)
        self.tokens += len(tokens)
        for end in range(start + 1, len(seq) + 1):
            for n in self.key_lens:
                if end >= n:
                    self._where.setdefault(tuple(seq[end - n:end]), deque()).append((doc, end))

    def remove_oldest(self) -> int:
        """Drops the oldest document and its entries; returns its length."""
        doc, seq = next(iter(self.docs.items()))
        for end in range(1, len(seq) + 1):
            for n in self.key_lens:
                if end >= n:
                    key = tuple(seq[end - n:end])
                    where = self._where.get(key)
                    while where and where[0][0] == doc:
                        where.popleft()
                    if where is not None and not where:
                        del self._where[key]
        del self.docs[doc]
        self.tokens -= len(seq)
        return len(seq)

    def matches(self, context: list[int], limit: int, max_match: int) -> list[tuple[int, int, int]]:
        """Up to ``limit`` places whose tokens before them equal the end of ``context``, the most
        recent first, under the longest key that matches a place with tokens after it: (doc, end, match length), the
        match length counted back from ``end`` up to ``max_match`` tokens."""
        for n in self.key_lens:
            if len(context) < n:
                continue
            where = self._where.get(tuple(context[-n:]))
            if not where:
                continue
            out = []
            for i in range(len(where) - 1, max(len(where) - 1 - limit, -1), -1):
                doc, end = where[i]
                seq = self.docs[doc]
                if end >= len(seq):  # nothing follows it (the sequence's own end)
                    continue
                m = n
                while m < max_match and m < end and m < len(context) and seq[end - m - 1] == context[-m - 1]:
                    m += 1
                out.append((doc, end, m))
            if out:
                return out
        return []
