"""The target's process on TensorRT-LLM: TargetWorker's interface over TrtllmEngine.

TargetWorker runs one batched forward and verifies on the host; here verification happens inside
TRT-LLM (draft_tokens_external), so the adapter only maps calls to executor requests. Every call of
the batch is enqueued before any response is awaited, so in-flight batching puts them into the same
GPU steps. Rejected draft tokens need no rollback: block reuse is keyed by token content.
"""
from __future__ import annotations

import time

from ..engine.trtllm_engine import TrtllmEngine, VerifyItem
from .protocol import CallError, VerifyCall, VerifyResult, attach_timing


class TrtllmTargetWorker:
    def __init__(self, engine: TrtllmEngine):
        if engine.role != "target":
            raise ValueError(f"TrtllmTargetWorker needs a target engine (draft_tokens_external), got {engine.role!r}")
        self.engine = engine

    def verify(self, calls: list[VerifyCall]) -> list[VerifyResult | CallError]:
        """A call that does not fit the engine's limits fails alone; the others are verified."""
        out: list[VerifyResult | CallError | None] = [None] * len(calls)
        good = []
        for i, c in enumerate(calls):
            try:
                self.engine.check_verify(len(c.tokens), len(c.draft))
                good.append(i)
            except ValueError as e:
                out[i] = CallError(f"target.verify: {e}")
        if not good:
            return out
        items = [VerifyItem(calls[i].seq_id, calls[i].tokens, calls[i].draft, calls[i].params, calls[i].draft_probs,
                            calls[i].seed, calls[i].round) for i in good]
        t0 = time.perf_counter()
        results = [VerifyResult(accepted, token) for accepted, token in self.engine.verify_batch(items)]
        # in-flight batching runs these as one step: report it as one forward of all their rows
        rows = sum(len(calls[i].draft) + 1 for i in good)
        for i, r in zip(good, attach_timing(results, [(rows, time.perf_counter() - t0)])):
            out[i] = r
        return out

    def release(self, seq_id: str) -> None:
        self.engine.release(seq_id)
