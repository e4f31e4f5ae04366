"""The target's process: one batched forward over every sequence's draft, then verification.

The contract of TensorRT-LLM's draft_tokens_external verify (its first, streamed answer): in goes a
prefix plus draft tokens (and the drafter's q' rows when sampling), out comes the accepted count and
exactly one target token.
The target's own distribution p never leaves this process.
"""
from __future__ import annotations

from ..algorithm.sampling import round_generator
from ..algorithm.verification import verify
from ..engine.engine import ExtendCall, TorchEngine
from .protocol import VerifyCall, VerifyResult, attach_timing

VERIFY_STREAM = 1


class TargetWorker:
    def __init__(self, engine: TorchEngine):
        self.engine = engine

    def verify(self, calls: list[VerifyCall]) -> list[VerifyResult]:
        ext = [ExtendCall(c.seq_id, c.tokens + c.draft, n_logits=len(c.draft) + 1) for c in calls]
        logits = self.engine.extend(ext)
        out = []
        for c, lg in zip(calls, logits):
            g = None if c.params.greedy else round_generator(c.seed, c.round, VERIFY_STREAM)
            o = verify(lg, c.draft, c.draft_probs, c.params, g)
            out.append(VerifyResult(o.accepted, o.token))
        return attach_timing(out, self.engine.take_timing())

    def release(self, seq_id: str) -> None:
        self.engine.release(seq_id)
