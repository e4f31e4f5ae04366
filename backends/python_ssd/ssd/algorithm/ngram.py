"""The fast backup: prompt lookup (n-gram matching over the sequence's own tokens).

Finds the most recent earlier occurrence of the longest suffix (max_n down to min_n tokens) and
proposes the tokens that followed it. Costs microseconds, so at large batch it beats waiting for a
neural backup; code and math prompts repeat themselves often enough to make it accept well.
Deterministic: the verifier treats its q' as one-hot, which keeps sampled decoding exact.
"""
from __future__ import annotations


def propose(tokens: list[int], k: int, max_n: int = 4, min_n: int = 1) -> list[int]:
    n_tok = len(tokens)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        suffix = tokens[n_tok - n:]
        # scan backwards: the most recent match tends to predict best
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + k]
                if follow:
                    return (follow + _repeat(follow, k))[:k]
    return [tokens[-1]] * k if tokens else [0] * k


def _repeat(seq: list[int], k: int) -> list[int]:
    return (seq * (k // max(len(seq), 1) + 1))[:k]
