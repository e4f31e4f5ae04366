"""Verification of a draft against the target: the outcome (k, t*) of one round.

Greedy: accept while the target's argmax equals the draft token; t* is the target's argmax at the
first mismatch (or after the last draft token). Sampled: accept d_j with probability
min(1, p(d_j) / q'(d_j)); after a rejection draw t* from max(0, p - q') / Z; after full acceptance
draw the bonus token from p. This is the standard lossless rule (Leviathan et al., Chen et al.).
A draft with no q rows is deterministic (n-gram backup): q' is one-hot, the rule still applies.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import SamplingParams, probs_from_logits, sample


@dataclass(frozen=True)
class Outcome:
    accepted: int  # k: draft tokens accepted
    token: int  # t*: the target's token after them

    @property
    def key(self) -> tuple[int, int]:
        return (self.accepted, self.token)


def verify(target_logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
           params: SamplingParams, generator: torch.Generator | None) -> Outcome:
    """``target_logits``: [len(draft)+1, V], row j = the target's logits for position j of the draft."""
    if params.greedy:
        best = target_logits.argmax(dim=-1).tolist()
        for j, d in enumerate(draft):
            if best[j] != d:
                return Outcome(j, best[j])
        return Outcome(len(draft), best[len(draft)])
    p = probs_from_logits(target_logits, params)
    for j, d in enumerate(draft):
        if draft_probs is None:  # deterministic draft: q'(d) = 1
            q_d = 1.0
        else:
            q_d = float(draft_probs[j, d])
        p_d = float(p[j, d])
        u = float(torch.rand((), generator=generator))
        if q_d > 0 and u < min(1.0, p_d / q_d):
            continue
        if draft_probs is None:
            residual = p[j].clone()
            residual[d] = 0.0
        else:
            residual = torch.clamp(p[j] - draft_probs[j], min=0.0)
        if float(residual.sum()) <= 0.0:  # only reachable through rounding; p itself is exact then
            residual = p[j]
        return Outcome(j, sample(residual / residual.sum(), generator))
    return Outcome(len(draft), sample(p[len(draft)], generator))
