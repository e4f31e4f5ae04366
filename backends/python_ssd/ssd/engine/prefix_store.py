"""Host-RAM copies of finished sequences' KV, kept past the engine's KV streams (llama-server's
prompt cache, `--cache-ram`; vLLM's CPU offload of its prefix cache).

A released sequence's KV stays in its stream until another sequence takes the stream
(llamacpp_engine.py). With 16 streams and 4 live sequences, new prompts that share only a chat
template's system prefix keep taking the same few streams, so a prompt seen a few dozen requests
ago has been overwritten, and a repeated prompt, a conversation's next turn after other traffic or a
shared few-shot header is computed again. Before a stream's kept tokens are overwritten the engine
saves them here (llama.cpp's per-sequence state: positions and K/V rows, about 28 KB a token on the
1.5B target); a new sequence whose prompt shares a longer prefix with a saved entry than with any
free stream gets the entry written back into its stream and computes only the rest. Exact: the
saved rows are the bits a prefill gives them, and a restore into an emptied stream puts them in
the cells a prefill would (llama.cpp fills an empty stream from cell 0), which the tests check.
Least recently used entries go first once their bytes pass the budget.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sized

from .engine import common_prefix


class PrefixStore:
    def __init__(self, budget_bytes: int):
        self.budget = max(0, int(budget_bytes))
        # tokens -> their llama.cpp state (a byte buffer: len() is its size), oldest first
        self.entries: OrderedDict[tuple[int, ...], Sized] = OrderedDict()
        self.bytes = 0

    def put(self, tokens: list[int], data: Sized) -> None:
        key = tuple(tokens)
        if not key or len(data) > self.budget:
            return
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= len(old)
        self.entries[key] = data
        self.bytes += len(data)
        while self.bytes > self.budget:
            _, dropped = self.entries.popitem(last=False)
            self.bytes -= len(dropped)

    def longest(self, tokens: list[int]) -> tuple[int, tuple[int, ...] | None]:
        """(shared length, key) of the entry sharing the longest prefix with ``tokens``; marks it
        used. (0, None) when none shares a token."""
        best, key = 0, None
        for k in self.entries:
            n = common_prefix(k, tokens)
            if n > best:
                best, key = n, k
        if key is not None:
            self.entries.move_to_end(key)
        return best, key

    def covers(self, tokens: list[int]) -> bool:
        """Whether an entry already holds these tokens (or more of the same sequence)."""
        return any(len(k) >= len(tokens) and common_prefix(k, tokens) == len(tokens) for k in self.entries)
