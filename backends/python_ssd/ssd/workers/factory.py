"""Builds the worker an engine model serves, from its config parameters (no Triton imports here).

`engine_backend` picks the runtime: `torch` (the CPU/GPU torch engine, every role), `openvino`
(the CPU OpenVINO engine, every role) or `tensorrt_llm` (the target only: TensorRT-LLM verifies
drafts natively with draft_tokens_external; speculation needs tree rows over a shared prefix, which
the torch and OpenVINO engines run). Unset, the engine folder's own `runtime` (engine.json, from
engines/*.yaml) decides, else torch.
"""
from __future__ import annotations

BACKENDS = ("torch", "openvino", "tensorrt_llm")


def build_worker(role: str, params: dict[str, str], engine_dir: str | None):
    if role == "fast_backup":
        from .fast_backup import NgramWorker
        return NgramWorker(int(params.get("ngram_max", "4") or 4), int(params.get("ngram_min", "1") or 1))
    backend = params.get("engine_backend") or _folder_runtime(engine_dir) or "torch"
    if backend not in BACKENDS:
        raise ValueError(f"parameter 'engine_backend' must be one of {BACKENDS}, got {backend!r}")
    if backend == "tensorrt_llm":
        if role != "target":
            raise ValueError(f"parameter 'engine_backend': tensorrt_llm serves the target only; the {role} "
                             "speculates with tree rows, which needs engine_backend 'torch'")
        from ..engine.trtllm_engine import TrtllmEngine
        from .trtllm_target import TrtllmTargetWorker
        return TrtllmTargetWorker(TrtllmEngine(engine_dir))
    if backend == "openvino":
        from ..engine.ov_engine import OpenVinoEngine
        weights = params.get("ov_weights") or _folder_meta(engine_dir).get("ov_weights") or "f32"
        engine = OpenVinoEngine(engine_dir, weights=weights,
                                threads=int(params.get("threads") or 0) or None,
                                exact=params.get("batch_invariant", "true").lower() == "true",
                                max_sequences=int(params.get("max_sequences") or 64))
        return _worker(role, engine)
    from ..engine.engine import TorchEngine
    engine = TorchEngine(engine_dir, dtype=params.get("dtype") or None,
                         threads=int(params.get("threads") or 0) or None,
                         exact=params.get("batch_invariant", "true").lower() == "true",
                         max_sequences=int(params.get("max_sequences") or 64),
                         head_vocab=int(params.get("head_vocab") or 0),
                         device=params.get("device") or "cpu", weight_quant=params.get("weight_quant") or "")
    return _worker(role, engine)


def _folder_meta(engine_dir: str | None) -> dict:
    from ..engine.meta import engine_meta
    return engine_meta(engine_dir) if engine_dir else {}


def _folder_runtime(engine_dir: str | None) -> str:
    return _folder_meta(engine_dir).get("runtime", "")


def _worker(role: str, engine):
    if role == "target":
        from .target import TargetWorker
        return TargetWorker(engine)
    from .drafter import DrafterWorker
    return DrafterWorker(engine)
