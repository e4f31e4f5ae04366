"""The orchestrator's client when the target, the drafter or both are models of Triton's own
TensorRT-LLM backend (`tensorrtllm`), with the backend's tensors (serving/trtllm_contract.py).

Verification goes to the target model with the backend's tensors (serving/trtllm_contract.py): one
decoupled streaming request per sequence, all of a round's sent at once so in-flight batching runs
them in the same GPU steps. The first answer is the accepted drafts plus one token; the request
would then decode up to K more tokens nobody reads, so a stop request with the same Triton request
id follows at once (`handleStopRequest` in the backend: the executor's cancel). The Python
backend's BLS has no call that cancels a decoupled stream it started, which is why the stop travels
as a request. The stream's remaining responses are drained off the event loop.

With a drafter model on the backend (``drafter_model``), plain drafting is a generation request of
K tokens to it, all of a round's sent at once; sampled drafts come back with the drafter's
generation logits, from which the q rows the verifier needs are computed under the request's own
temperature / top-k / top-p (the distribution the backend's sampler drew from). Speculation trees
and fetches stay on the torch drafter (`drafter_primary`), the backup on its engine model
(BLSClient): the backend serves no tree rows (docs/tensorrt_llm.md). The backend keeps no
per-sequence state to release: its KV blocks are reused by content.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils

import torch

from ..algorithm.sampling import probs_from_logits
from ..engine.trtllm_engine import VERIFY_STREAM, round_seed
from ..workers.drafter import DRAFT_STREAM
from ..workers.protocol import (CallError, DraftCall, DraftResult, ReleaseCall, VerifyCall, VerifyResult,
                                attach_timing)
from . import trtllm_contract as contract
from .bls_client import BLSClient

_ids = itertools.count()


class TrtllmBackendClient(BLSClient):
    def __init__(self, vocab_size: int = 0, target_on_backend: bool = True, drafter_model: str = "", **models: str):
        """``vocab_size``: the target engine's padded vocabulary, the width of draft logits (0: the
        drafter's rows as they are). ``target_on_backend``: the target model is the backend's
        (verify over its tensors), else this backend's engine model. ``drafter_model``: the
        backend model that drafts ("": drafting stays on the torch drafter)."""
        super().__init__(**models)
        self.vocab_size = vocab_size
        self.target_on_backend = target_on_backend
        self.drafter_model = drafter_model
        self._drains: set[asyncio.Future] = set()
        # the stub's response iterators block: reading first answers and draining stopped streams
        # runs on threads of its own, enough for every active request's verify and drain at once
        self._threads = ThreadPoolExecutor(max_workers=256, thread_name_prefix="trtllm-bls")

    def _tensors(self, tensors: dict) -> list:
        return [pb_utils.Tensor(name, value) for name, value in tensors.items()]

    async def _verify(self, call: VerifyCall) -> VerifyResult:
        # a seed per round and purpose, as the torch path's round_generator: the same seed every round
        # would draw the same uniforms for every round's acceptance tests
        seed = round_seed(call.seed, call.round, VERIFY_STREAM)
        req = contract.verify_request(call.tokens, call.draft, call.params, seed,
                                      None if call.draft_probs is None else call.draft_probs.numpy(), self.vocab_size)
        request_id = f"ssd-{os.getpid()}-{next(_ids)}"
        infer = pb_utils.InferenceRequest(model_name=self.models["target"], inputs=self._tensors(req.tensors),
                                          requested_output_names=["output_ids", "sequence_length"],
                                          request_id=request_id)
        first, stream = await self._first(infer, f"{self.models['target']}.verify")
        ids = pb_utils.get_output_tensor_by_name(first, "output_ids").as_numpy()
        length = pb_utils.get_output_tensor_by_name(first, "sequence_length")
        n = int(length.as_numpy().reshape(-1)[0]) if length is not None else None
        if req.tensors["streaming"].reshape(-1)[0]:
            await self._stop(request_id)
            self._drain(stream)
        accepted, token = contract.first_answer(ids, call.draft, n)
        return VerifyResult(accepted, token)

    async def _stop(self, request_id: str) -> None:
        stop = pb_utils.InferenceRequest(model_name=self.models["target"], inputs=self._tensors(contract.stop_request()),
                                         requested_output_names=["output_ids"], request_id=request_id)
        for r in await stop.async_exec(decoupled=True):  # one empty final response
            if r.has_error():
                raise CallError(f"{self.models['target']}.stop: {r.error().message()}")

    async def _first(self, infer, name: str):
        """A request's first response (blocking reads on the pool), raising the backend's error."""
        stream = iter(await infer.async_exec(decoupled=True))
        first = await asyncio.get_running_loop().run_in_executor(self._threads, next, stream)
        if first.has_error():
            raise CallError(f"{name}: {first.error().message()}")
        return first, stream

    def _drain(self, stream) -> None:
        """Reads a stream's remaining responses (a stopped verify's, a final flag sent apart) off the loop."""
        drain = asyncio.get_running_loop().run_in_executor(self._threads, lambda: sum(1 for _ in stream))
        self._drains.add(drain)
        drain.add_done_callback(self._drains.discard)

    async def _draft(self, call: DraftCall) -> DraftResult:
        name = f"{self.drafter_model}.draft"
        infer = pb_utils.InferenceRequest(
            model_name=self.drafter_model,
            inputs=self._tensors(contract.draft_request(call.tokens, call.k, call.params,
                                                                round_seed(call.seed, call.round, DRAFT_STREAM))),
            requested_output_names=["output_ids", "sequence_length"]
            + ([] if call.params.greedy else ["generation_logits"]),
            request_id=f"ssd-draft-{os.getpid()}-{next(_ids)}")
        first, stream = await self._first(infer, name)
        self._drain(stream)
        length = pb_utils.get_output_tensor_by_name(first, "sequence_length")
        logits = None if call.params.greedy else pb_utils.get_output_tensor_by_name(first, "generation_logits")
        if not call.params.greedy and logits is None:
            raise CallError(f"{name}: a sampled draft came back without generation_logits "
                            "(the drafter engine needs --gather_generation_logits)")
        toks, rows = contract.draft_answer(
            pb_utils.get_output_tensor_by_name(first, "output_ids").as_numpy(),
            int(length.as_numpy().reshape(-1)[0]) if length is not None else None, call.k,
            None if logits is None else logits.as_numpy())
        if rows is None:
            return DraftResult(toks)
        if self.vocab_size:  # the engine's padded columns are no tokens: q lives on the target's vocabulary
            rows = rows[:, :self.vocab_size]
        return DraftResult(toks, probs_from_logits(torch.from_numpy(rows.copy()), call.params))

    async def _draft_many(self, calls: list) -> list:
        """A call with k = 0 warms a new sequence's cache: the torch drafter's, which SSD's speculation
        extends (the backend reuses the prompt's KV blocks by content when it drafts)."""
        warm = [c for c in calls if c.k == 0]
        warmed = iter(await super().call_many("draft", warm) if warm else [])
        t0 = time.perf_counter()
        drafted = iter(await asyncio.gather(*(self._draft(c) for c in calls if c.k > 0), return_exceptions=True))
        out = [next(warmed) if c.k == 0 else next(drafted) for c in calls]
        out = [CallError(f"{self.drafter_model}.draft: {r}") if isinstance(r, Exception)
               and not isinstance(r, CallError) else r for r in out]
        good = [r for r in out if isinstance(r, DraftResult) and r.tokens]
        # in-flight batching runs the round's drafts together: K steps of all their rows
        steps = max((len(r.tokens) for r in good), default=0)
        if steps:
            attach_timing(good, [(len(good), (time.perf_counter() - t0) / steps)] * steps)
        return out

    async def call_many(self, op: str, calls: list) -> list:
        if op == "draft" and self.drafter_model:
            return await self._draft_many(calls)
        if op != "verify" or not self.target_on_backend:
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
        # the backend's blocks are reused by content: nothing to free there
        for model in ("drafter", "backup") if self.target_on_backend else ("target", "drafter", "backup"):
            try:
                await self._send(model, "release", [ReleaseCall(s) for s in seq_ids])
            except CallError:
                pass
