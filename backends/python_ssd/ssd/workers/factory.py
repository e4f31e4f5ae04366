"""Builds the worker an engine model serves, from its config parameters (no Triton imports here).

`engine_backend` picks the runtime: `torch` (the CPU/GPU torch engine, every role), `openvino`
(the CPU OpenVINO engine, every role), `llamacpp` (the CPU target on llama.cpp, from the GGUF file)
or `tensorrt_llm` (the target only: TensorRT-LLM verifies drafts natively with
draft_tokens_external). Speculation needs tree rows over a shared prefix, which the torch and
OpenVINO engines run, so drafters take one of those. Unset, the engine folder's own `runtime` (engine.json, from
engines/*.yaml) decides, else torch.
`static_kv_len` > 0 gives the torch engine a static KV pool of that many tokens per sequence and
fixed-shape decode / tree steps, captured as CUDA graphs on a GPU (`cuda_graphs`, default true
there): the GPU drafter (engine/static_engine.py).
"""
from __future__ import annotations

BACKENDS = ("torch", "openvino", "llamacpp", "tensorrt_llm")


def build_worker(role: str, params: dict[str, str], engine_dir: str | None):
    if role == "fast_backup":
        from .fast_backup import NgramWorker
        return NgramWorker(int(params.get("ngram_max", "4") or 4), int(params.get("ngram_min", "1") or 1))
    backend = params.get("engine_backend") or _folder_runtime(engine_dir) or "torch"
    if backend not in BACKENDS:
        raise ValueError(f"parameter 'engine_backend' must be one of {BACKENDS}, got {backend!r}")
    if backend in ("tensorrt_llm", "llamacpp") and role != "target":
        raise ValueError(f"parameter 'engine_backend': {backend} serves the target only; the {role} "
                         "speculates with tree rows, which needs engine_backend 'torch' or 'openvino'")
    if backend == "tensorrt_llm":
        from ..engine.meta import trtllm_engine_dir
        from ..engine.trtllm_engine import TrtllmEngine
        from .trtllm_target import TrtllmTargetWorker
        ids = [int(x) for x in (params.get("gpu_device_ids") or "").split(",") if x.strip()]
        return TrtllmTargetWorker(TrtllmEngine(trtllm_engine_dir(engine_dir), device_ids=ids or None))
    threads = int(params.get("threads") or 0) or None
    exact = params.get("batch_invariant", "true").lower() == "true"
    max_sequences = int(params.get("max_sequences") or 64)
    if backend == "llamacpp":
        from ..engine.llamacpp_engine import LlamaCppEngine
        return _worker(role, LlamaCppEngine(engine_dir, threads=threads, exact=exact,
                                            max_sequences=int(params.get("max_sequences") or 16),
                                            max_len=int(params.get("max_len") or 4096),
                                            cache_ram_mb=float(params.get("cache_ram_mb") or 0)))
    if backend == "openvino":
        from ..engine.ov_engine import OpenVinoEngine
        weights = params.get("ov_weights") or _folder_meta(engine_dir).get("ov_weights") or "bf16"
        return _worker(role, OpenVinoEngine(engine_dir, weights=weights, threads=threads, exact=exact,
                                            max_sequences=max_sequences))
    from ..engine.engine import TorchEngine
    kw = dict(dtype=params.get("dtype") or None, threads=threads, exact=exact, max_sequences=max_sequences,
              head_vocab=int(params.get("head_vocab") or 0),
              device=params.get("device") or "cpu", weight_quant=params.get("weight_quant") or "")
    static_len = int(params.get("static_kv_len") or 0)
    if static_len > 0:
        from ..engine.static_engine import StaticEngine
        graphs = (params.get("cuda_graphs") or "").lower()
        engine = StaticEngine(engine_dir, static_len=static_len, cuda_graphs=None if not graphs else graphs == "true",
                              **kw)
    else:
        engine = TorchEngine(engine_dir, **kw)
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
