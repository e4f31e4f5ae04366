"""Turning logits into the distributions that drafting and verification share.

Lossless speculative sampling needs the target's p and the drafter's q to go through the *same*
transforms (temperature, top-k, top-p); Saguaro then reshapes q into q' by scaling the drafter's own
top tokens by C. Whatever q' the drafter samples from is exactly what it sends to the verifier, so the
accept test min(1, p/q') and the residual max(0, p - q') stay exact for any C.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        return cls(float(d.get("temperature", 0.0)), float(d.get("top_p", 1.0)), int(d.get("top_k", 0)))


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, V] float logits -> [n, V] float32 probabilities after temperature, top-k and top-p."""
    x = logits.float() / max(params.temperature, 1e-6)
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def saguaro(q: torch.Tensor, top_ids: torch.Tensor, c: float) -> torch.Tensor:
    """Cache-aware q': the drafter's top tokens get probability x C, then renormalise.

    A rejection's residual max(0, p - q') then keeps more mass on exactly the tokens the
    speculation cache holds. If scaling would leave no mass (C = 0 and q lives only on the top
    set), q is returned unchanged: any q' is lossless as long as the verifier sees the same one.
    """
    if c >= 1.0 or top_ids.numel() == 0:
        return q
    out = q.clone()
    out[top_ids] = out[top_ids] * c
    total = out.sum()
    if total <= 0:
        return q
    return out / total


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def round_generator(seed: int, round_index: int, stream: int) -> torch.Generator:
    """Independent, reproducible randomness per (request seed, round, purpose)."""
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + round_index * 8191 + stream * 131) % (2**63 - 1))
    return g
