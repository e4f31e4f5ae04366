"""A WorkerClient over Triton BLS: each message is an async inference request to an engine model.

`call_many` sends one op's calls of many sequences as a single request (the coalescer's round), so
the engine sees the whole round at once instead of N requests that Triton may hand it in pieces.
The orchestrator awaits verify and speculate together, so the two engine processes work at once.
"""
from __future__ import annotations

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..workers.protocol import (ROUTE, CallError, DraftCall, DraftResult, FetchCall, ReleaseCall, SpeculateCall,
                                SpeculateResult, VerifyCall, VerifyResult, decode_results, encode_calls)


class BLSClient:
    def __init__(self, target: str = "target", drafter: str = "drafter_primary", backup: str = "drafter_backup"):
        self.models = {"target": target, "drafter": drafter, "backup": backup}

    async def _send(self, model: str, op: str, calls: list) -> list:
        payload, probs = encode_calls(op, calls)
        inputs = [pb_utils.Tensor("request", np.array([[payload]], dtype=np.object_))]
        if probs is not None:
            inputs.append(pb_utils.Tensor("probs", probs.numpy().astype(np.float32)[None]))
        req = pb_utils.InferenceRequest(model_name=self.models[model], inputs=inputs,
                                        requested_output_names=["response", "probs"])
        resp = await req.async_exec()
        if resp.has_error():
            raise CallError(f"{self.models[model]}.{op}: {resp.error().message()}")
        out = pb_utils.get_output_tensor_by_name(resp, "response").as_numpy().reshape(-1)[0]
        p = pb_utils.get_output_tensor_by_name(resp, "probs")
        arr = p.as_numpy()[0] if p is not None else None
        return decode_results(op, out, torch.from_numpy(arr.copy()) if arr is not None and arr.size else None)

    async def call_many(self, op: str, calls: list) -> list:
        """Results in call order; a call the engine rejected is a CallError in its place."""
        return await self._send(ROUTE[op], op, calls)

    async def _call(self, op: str, call):
        (r,) = await self.call_many(op, [call])
        if isinstance(r, Exception):
            raise r
        return r

    async def verify(self, call: VerifyCall) -> VerifyResult:
        return await self._call("verify", call)

    async def draft(self, call: DraftCall) -> DraftResult:
        return await self._call("draft", call)

    async def speculate(self, call: SpeculateCall) -> SpeculateResult:
        return await self._call("speculate", call)

    async def fetch(self, call: FetchCall) -> DraftResult:
        return await self._call("fetch", call)

    async def fast_draft(self, call: DraftCall) -> DraftResult:
        return await self._call("fast_draft", call)

    async def release(self, seq_id: str) -> None:
        await self.release_many([seq_id])

    async def ping(self, model: str = "target") -> None:
        """A no-op call (releasing an unknown sequence); raises CallError with Triton's message where
        the call fails, as every BLS call does while the server starts ("Server not ready")."""
        await self._send(model, "release", [ReleaseCall("__ping")])

    async def release_many(self, seq_ids: list[str]) -> None:
        """One message an engine for all of ``seq_ids``."""
        for model in ("target", "drafter", "backup"):
            try:
                await self._send(model, "release", [ReleaseCall(s) for s in seq_ids])
            except CallError:
                pass  # an engine that lost the sequences has nothing to free
