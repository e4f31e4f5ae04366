"""An engine server: the `target`, `drafter_primary` and `drafter_backup` models.

Non-decoupled; Triton's dynamic batcher hands `execute` every call queued while the previous batch
ran, so concurrent sequences share one forward (continuous batching between rounds). Calls are
grouped by op and each group goes to the worker in one batched call. A bad call fails alone.
"""
from __future__ import annotations

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..workers.factory import build_worker
from ..workers.protocol import decode_call, encode_result
from .roles import resolve_engine_dir


class EngineModel:
    def __init__(self, config: dict, params: dict[str, str], role: str):
        self.role = role
        engine = params.get("engine")
        self.worker = build_worker(role, params, resolve_engine_dir(engine) if engine else None)

    def execute(self, requests):
        responses = [None] * len(requests)
        groups: dict[str, list[tuple[int, object]]] = {}
        for i, req in enumerate(requests):
            try:
                payload = pb_utils.get_input_tensor_by_name(req, "request").as_numpy().reshape(-1)[0]
                probs_t = pb_utils.get_input_tensor_by_name(req, "probs")
                probs = torch.from_numpy(probs_t.as_numpy()[0].copy()) if probs_t is not None else None
                op, call = decode_call(payload, probs)
                if op == "release":  # end of a sequence: drop its KV and speculation cache
                    self.worker.release(call.seq_id)
                    responses[i] = self._ok(None)
                    continue
                groups.setdefault(op, []).append((i, call))
            except Exception as e:  # noqa: BLE001 - one bad call must not fail the batch
                responses[i] = self._error(f"{self.role}: bad call: {e}")
        for op, items in groups.items():
            try:
                method = getattr(self.worker, "draft" if op == "fast_draft" else op)
                results = method([c for _, c in items])
                for (i, _), r in zip(items, results):
                    responses[i] = self._ok(r)
            except Exception as e:  # noqa: BLE001
                for i, _ in items:
                    responses[i] = self._error(f"{self.role}.{op} failed: {type(e).__name__}: {e}")
        return responses

    @staticmethod
    def _ok(result):
        payload, probs = encode_result(result)
        outs = [pb_utils.Tensor("response", np.array([[payload]], dtype=np.object_))]
        arr = probs.numpy().astype(np.float32)[None] if probs is not None else np.zeros((1, 0, 0), np.float32)
        outs.append(pb_utils.Tensor("probs", arr))
        return pb_utils.InferenceResponse(output_tensors=outs)

    @staticmethod
    def _error(msg: str):
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(msg))

    def finalize(self):
        self.worker = None
