"""An engine server: the `target`, `drafter_primary` and `drafter_backup` models.

Non-decoupled. Each request carries one op's calls of one or many sequences (the orchestrator's
coalescer sends a round's calls as one request), and Triton's dynamic batcher hands `execute`
every request queued while the previous batch ran. All calls of an op, over all requests, go to
the worker as one batched call: concurrent sequences share one forward (continuous batching
between rounds). A bad call fails alone.
"""
from __future__ import annotations

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..config import EngineConfig
from ..engine.meta import resolve_engine_dir
from ..workers.factory import build_worker
from ..workers.protocol import CallError, decode_calls, encode_results, worker_method
from ..workers.waiting import WaitingFlag
from .placement import Placement


def live_state(worker) -> tuple[int, int]:
    """(sequences, KV slots) the worker's engine holds now; a stateless worker holds none."""
    engine = getattr(worker, "engine", None)
    seqs = getattr(engine, "sequences", None)
    if not isinstance(seqs, dict):
        return 0, 0
    return len(seqs), sum(getattr(getattr(s, "kv", None), "capacity", 0) for s in list(seqs.values()))


class EngineModel:
    def __init__(self, config: dict, cfg: EngineConfig):
        self.role = role = cfg.role
        self.worker = build_worker(cfg, resolve_engine_dir(cfg.engine) if cfg.engine else None)
        if role == "target":  # the orchestrator's coalescer raises it while a call waits for this model
            self.worker.waiting = WaitingFlag.for_target(config.get("name", role))
        self.placement = Placement(getattr(self.worker, "engine", None), cfg.cores, cfg.wide_cores, cfg.threads)
        # what this engine holds, on Triton's /metrics: the soak and the tests read leaks from it
        fam = pb_utils.MetricFamily
        model = config.get("name", role)
        # a family must outlive its metrics: keep both
        self._families = (fam("ssd_engine_live_sequences", "Sequences whose state an engine holds now, by model",
                              fam.GAUGE),
                          fam("ssd_engine_kv_slots", "KV cache slots (tokens) an engine has allocated, by model",
                              fam.GAUGE))
        self._live, self._kv = (f.Metric(labels={"model": model}) for f in self._families)
        self._publish()

    def _publish(self) -> None:
        seqs, slots = live_state(self.worker)
        self._live.set(seqs)
        self._kv.set(slots)

    def execute(self, requests):
        slots: list[list | str] = []  # per request: its results in call order, or why it failed as a whole
        groups: dict[str, list[tuple[list, int, object]]] = {}
        for req in requests:
            try:
                payload = pb_utils.get_input_tensor_by_name(req, "request").as_numpy().reshape(-1)[0]
                probs_t = pb_utils.get_input_tensor_by_name(req, "probs")
                probs = torch.from_numpy(probs_t.as_numpy()[0].copy()) if probs_t is not None else None
                op, calls = decode_calls(payload, probs)
            except Exception as e:  # noqa: BLE001 - one bad request must not fail the batch
                slots.append(f"{self.role}: bad request: {type(e).__name__}: {e}")
                continue
            out = [None] * len(calls)
            slots.append(out)
            for j, call in enumerate(calls):
                if isinstance(call, CallError):
                    out[j] = call
                elif op == "release":  # end of a sequence: drop its KV and speculation cache
                    self.worker.release(call.seq_id)
                else:
                    groups.setdefault(op, []).append((out, j, call))
        for op, items in groups.items():
            try:
                method = getattr(self.worker, worker_method(op))
                self.placement.use(max(getattr(c, "threads", 0) for _, _, c in items))
                for (out, j, _), r in zip(items, method([c for _, _, c in items])):
                    out[j] = r
            except Exception as e:  # noqa: BLE001
                for out, j, _ in items:
                    out[j] = CallError(f"{self.role}.{op} failed: {type(e).__name__}: {e}")
        self._publish()
        return [self._error(s) if isinstance(s, str) else self._ok(s) for s in slots]

    @staticmethod
    def _ok(results: list):
        payload, probs = encode_results(results)
        outs = [pb_utils.Tensor("response", np.array([[payload]], dtype=np.object_))]
        arr = probs.numpy().astype(np.float32)[None] if probs is not None else np.zeros((1, 0, 0), np.float32)
        outs.append(pb_utils.Tensor("probs", arr))
        return pb_utils.InferenceResponse(output_tensors=outs)

    @staticmethod
    def _error(msg: str):
        return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(msg))

    def finalize(self):
        self.worker = None
