"""The target's process on TensorRT-LLM: TargetWorker's interface over TrtllmEngine.

TargetWorker runs one batched forward and verifies on the host; here verification happens inside
TRT-LLM (draft_tokens_external), so the adapter only maps calls to executor requests. Every call of
the batch is enqueued before any response is awaited, so in-flight batching puts them into the same
GPU steps. Rejected draft tokens need no rollback: block reuse is keyed by token content.
"""
from __future__ import annotations

import time

from ..engine.trtllm_engine import TrtllmEngine, VerifyItem
from .protocol import VerifyCall, VerifyResult, attach_timing


class TrtllmTargetWorker:
    def __init__(self, engine: TrtllmEngine):
        if engine.role != "target":
            raise ValueError(f"TrtllmTargetWorker needs a target engine (draft_tokens_external), got {engine.role!r}")
        self.engine = engine

    def verify(self, calls: list[VerifyCall]) -> list[VerifyResult]:
        items = [VerifyItem(c.seq_id, c.tokens, c.draft, c.params, c.draft_probs, c.seed, c.round) for c in calls]
        t0 = time.perf_counter()
        out = [VerifyResult(accepted, token) for accepted, token, _ in self.engine.verify_batch(items)]
        # in-flight batching runs these as one step: report it as one forward of all their rows
        rows = sum(len(c.draft) + 1 for c in calls)
        return attach_timing(out, [(rows, time.perf_counter() - t0)])

    def release(self, seq_id: str) -> None:
        self.engine.release(seq_id)
