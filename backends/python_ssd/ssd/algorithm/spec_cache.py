"""The speculation cache: pre-drafted next rounds, keyed by the outcome (k, t*) they assume.

Candidates for t* at depth k < K are the drafter's top-F_k tokens at that position *excluding* the
drafted token s_{k+1} (a rejected token can never be the target's correction); at k = K (all
accepted) the top-F_K with no exclusion.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def candidates(depth_probs: torch.Tensor, draft: list[int], fanout: list[int]) -> list[tuple[int, int]]:
    """depth_probs: [K+1, V], row k = the drafter's distribution after accepting k tokens.
    Returns the outcome keys (k, t*) to pre-draft, F_k of them per depth."""
    keys = []
    for k, f in enumerate(fanout[: depth_probs.shape[0]]):  # a short draft has fewer depths
        if f <= 0:
            continue
        excluded = draft[k] if k < len(draft) else None
        top = torch.topk(depth_probs[k], min(f + 1, depth_probs.shape[-1])).indices.tolist()
        picked = [t for t in top if t != excluded][:f]
        keys.extend((k, t) for t in picked)
    return keys


@dataclass
class Branch:
    tokens: list[int]  # the pre-drafted next speculation s_1..s_K
    probs: torch.Tensor | None  # [K, V] q' rows it was sampled from (None when greedy)


@dataclass
class SpeculationCache:
    branches: dict[tuple[int, int], Branch] = field(default_factory=dict)

    def put(self, key: tuple[int, int], branch: Branch) -> None:
        self.branches[key] = branch

    def lookup(self, key: tuple[int, int]) -> Branch | None:
        return self.branches.get(key)

    def keys(self) -> list[tuple[int, int]]:
        return list(self.branches)

    def __len__(self) -> int:
        return len(self.branches)
