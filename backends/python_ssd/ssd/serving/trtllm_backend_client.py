"""The orchestrator's client when the target is Triton's own TensorRT-LLM backend (`tensorrtllm`).

Verification goes to the target model with the backend's tensors (serving/trtllm_contract.py): one
decoupled streaming request per sequence, all of a round's sent at once so in-flight batching runs
them in the same GPU steps. The first answer is the accepted drafts plus one token; the request
would then decode up to K more tokens nobody reads, so a stop request with the same Triton request
id follows at once (`handleStopRequest` in the backend: the executor's cancel). The Python
backend's BLS has no call that cancels a decoupled stream it started, which is why the stop travels
as a request. The stream's remaining responses are drained off the event loop. Drafting, speculation
and the backup stay on their engine models (BLSClient); the backend keeps no per-sequence state
to release: its KV blocks are reused by content.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils

from ..workers.protocol import CallError, ReleaseCall, VerifyCall, VerifyResult, attach_timing
from . import trtllm_contract as contract
from .bls_client import BLSClient

_ids = itertools.count()


class TrtllmBackendClient(BLSClient):
    def __init__(self, vocab_size: int = 0, **models: str):
        """``vocab_size``: the engine's padded vocabulary, the width of draft logits (0: the
        drafter's rows as they are)."""
        super().__init__(**models)
        self.vocab_size = vocab_size
        self._drains: set[asyncio.Future] = set()
        # the stub's response iterators block: reading first answers and draining stopped streams
        # runs on threads of its own, enough for every active request's verify and drain at once
        self._threads = ThreadPoolExecutor(max_workers=256, thread_name_prefix="trtllm-bls")

    def _tensors(self, tensors: dict) -> list:
        return [pb_utils.Tensor(name, value) for name, value in tensors.items()]

    async def _verify(self, call: VerifyCall) -> VerifyResult:
        req = contract.verify_request(call.tokens, call.draft, call.params, call.seed,
                                      None if call.draft_probs is None else call.draft_probs.numpy(), self.vocab_size)
        request_id = f"ssd-{os.getpid()}-{next(_ids)}"
        infer = pb_utils.InferenceRequest(model_name=self.models["target"], inputs=self._tensors(req.tensors),
                                          requested_output_names=["output_ids", "sequence_length"],
                                          request_id=request_id)
        responses = await infer.async_exec(decoupled=True)
        stream = iter(responses)
        loop = asyncio.get_running_loop()
        first = await loop.run_in_executor(self._threads, next, stream)  # may block until the first response
        if first.has_error():
            raise CallError(f"{self.models['target']}.verify: {first.error().message()}")
        ids = pb_utils.get_output_tensor_by_name(first, "output_ids").as_numpy()
        length = pb_utils.get_output_tensor_by_name(first, "sequence_length")
        n = int(length.as_numpy().reshape(-1)[0]) if length is not None else None
        if req.tensors["streaming"].reshape(-1)[0]:
            await self._stop(request_id)
            drain = loop.run_in_executor(self._threads, lambda: sum(1 for _ in stream))
            self._drains.add(drain)
            drain.add_done_callback(self._drains.discard)
        accepted, token = contract.first_answer(ids, call.draft, n)
        return VerifyResult(accepted, token)

    async def _stop(self, request_id: str) -> None:
        stop = pb_utils.InferenceRequest(model_name=self.models["target"], inputs=self._tensors(contract.stop_request()),
                                         requested_output_names=["output_ids"], request_id=request_id)
        for r in await stop.async_exec(decoupled=True):  # one empty final response
            if r.has_error():
                raise CallError(f"{self.models['target']}.stop: {r.error().message()}")

    async def call_many(self, op: str, calls: list) -> list:
        if op != "verify":
            return await super().call_many(op, calls)
        t0 = time.perf_counter()
        out = await asyncio.gather(*(self._verify(c) for c in calls), return_exceptions=True)
        out = [CallError(f"{self.models['target']}.verify: {r}") if isinstance(r, Exception)
               and not isinstance(r, CallError) else r for r in out]
        good = [r for r in out if isinstance(r, VerifyResult)]
        # in-flight batching runs these as one step: report it as one forward of all their rows
        rows = sum(len(c.draft) + 1 for c, r in zip(calls, out) if isinstance(r, VerifyResult))
        attach_timing(good, [(rows, time.perf_counter() - t0)])
        return out

    async def release_many(self, seq_ids: list[str]) -> None:
        for model in ("drafter", "backup"):  # the backend's blocks are reused by content: nothing to free
            try:
                await self._send(model, "release", [ReleaseCall(s) for s in seq_ids])
            except CallError:
                pass
