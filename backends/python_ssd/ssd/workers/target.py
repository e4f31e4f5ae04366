"""The target's process: one batched forward over every sequence's draft, then verification.

The contract of TensorRT-LLM's draft_tokens_external verify (its first, streamed answer): in goes a
prefix plus draft tokens (and the drafter's q' rows when sampling), out comes the accepted count and
exactly one target token.
An AR call (no draft) may ask for several steps (VerifyCall.steps): the target then decodes up to
that many tokens itself, one one-row forward each, as the same number of one-step calls would (step
s samples with round + s's stream), and stops after an end-of-sequence token, or after the step in
progress when another call waits for the target (workers/waiting.py). One message then carries
several tokens: the per-token cost of the orchestrator's round trip is divided by them.
The target's own distribution p never leaves this process.
"""
from __future__ import annotations

from ..algorithm.sampling import round_generator
from ..algorithm.verification import verify
from ..engine.engine import ExtendCall, TorchEngine
from .protocol import VerifyCall, VerifyResult, attach_timing
from .waiting import WaitingFlag

VERIFY_STREAM = 1


class TargetWorker:
    def __init__(self, engine: TorchEngine, waiting: WaitingFlag | None = None):
        self.engine = engine
        self.waiting = waiting or WaitingFlag()  # raised by the orchestrator while a call waits

    def verify(self, calls: list[VerifyCall]) -> list[VerifyResult]:
        out = [VerifyResult(0, -1) for _ in calls]
        decoded: list[list[int]] = [[] for _ in calls]  # tokens an AR call's earlier steps produced
        live = list(range(len(calls)))
        eos = getattr(self.engine, "eos_ids", set())
        for step in range(max((1 if c.draft else c.steps for c in calls), default=0)):
            for i in live if step else ():
                decoded[i].append(out[i].token)
            ext = [ExtendCall(calls[i].seq_id, calls[i].tokens + decoded[i] + calls[i].draft,
                              n_logits=len(calls[i].draft) + 1) for i in live]
            for i, lg in zip(live, self.engine.extend(ext)):
                c = calls[i]
                g = None if c.params.greedy else round_generator(c.seed, c.round + step, VERIFY_STREAM)
                o = verify(lg, c.draft, c.draft_probs, c.params, g)
                out[i] = VerifyResult(o.accepted, o.token, list(decoded[i]))
            live = [i for i in live if not calls[i].draft and step + 1 < calls[i].steps and out[i].token not in eos]
            if not live or self.waiting.is_raised():
                break
        timing = self.engine.take_timing()
        # engines that run prompts in forwards of their own report them as 0 rows (llamacpp_engine.py)
        prompts = sum(s for rows, s in timing if rows == 0)
        reused = self.engine.take_reused()
        for c, r in zip(calls, out):
            r.prompt_seconds = prompts
            r.cached_tokens = reused.get(c.seq_id, 0)
        return attach_timing(out, timing)

    def release(self, seq_id: str) -> None:
        self.engine.release(seq_id)
