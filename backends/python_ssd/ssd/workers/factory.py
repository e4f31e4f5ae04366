"""Builds the worker an engine model serves, from its EngineConfig (ssd/config.py; no Triton imports here).

`engine_backend` picks the runtime: `torch` (the CPU/GPU torch engine, every role), `openvino`
(the CPU OpenVINO engine, every role), `llamacpp` (the CPU target on llama.cpp, from the GGUF file)
or `tensorrt_llm` (the target only: TensorRT-LLM verifies drafts natively with
draft_tokens_external). Speculation needs tree rows over a shared prefix, which the torch and
OpenVINO engines run, so drafters take one of those here. A drafter's TensorRT-LLM engine (built
where the deployment spec serves a `tensorrtllm` drafter model) is served by Triton's own
TensorRT-LLM backend and drafts SD through it (serving/trtllm_backend_client.py), not built here.
Unset, the engine folder's own `runtime` (engine.json, from engines/*.yaml) decides, else torch.
`static_kv_len` > 0 gives the torch engine a static KV pool of that many tokens per sequence and
fixed-shape decode / tree steps, captured as CUDA graphs on a GPU (`cuda_graphs`, default true
there): the GPU drafter (engine/static_engine.py).
"""
from __future__ import annotations

from dataclasses import replace

from ..config import EngineConfig


def build_worker(cfg: EngineConfig, engine_dir: str | None):
    if cfg.role == "fast_backup":
        from .fast_backup import NgramWorker
        return NgramWorker(cfg.ngram_max, cfg.ngram_min)
    # the folder's runtime is checked as a configured one is (the drafter takes no target-only runtime)
    backend = cfg.engine_backend or _folder_runtime(engine_dir) or "torch"
    replace(cfg, engine_backend=backend).validate()
    if backend == "tensorrt_llm":
        from ..engine.meta import trtllm_engine_dir
        from ..engine.trtllm_engine import TrtllmEngine
        from .trtllm_target import TrtllmTargetWorker
        ids = [int(x) for x in cfg.gpu_device_ids.split(",") if x.strip()]
        return TrtllmTargetWorker(TrtllmEngine(trtllm_engine_dir(engine_dir), device_ids=ids or None))
    threads = cfg.threads or None
    if backend == "llamacpp":
        from ..engine.llamacpp_engine import LlamaCppEngine
        return _worker(cfg.role, LlamaCppEngine(engine_dir, threads=threads, exact=cfg.batch_invariant,
                                                max_sequences=cfg.max_sequences, max_len=cfg.max_len,
                                                cache_ram_mb=cfg.cache_ram_mb))
    if backend == "openvino":
        from ..engine.ov_engine import OpenVinoEngine
        weights = cfg.ov_weights or _folder_meta(engine_dir).get("ov_weights") or "bf16"
        return _worker(cfg.role, OpenVinoEngine(engine_dir, weights=weights, threads=threads,
                                                exact=cfg.batch_invariant, max_sequences=cfg.max_sequences))
    from ..engine.engine import TorchEngine
    kw = dict(dtype=cfg.dtype or None, threads=threads, exact=cfg.batch_invariant, max_sequences=cfg.max_sequences,
              head_vocab=cfg.head_vocab, device=cfg.device or "cpu", weight_quant=cfg.weight_quant)
    if cfg.static_kv_len > 0:
        from ..engine.static_engine import StaticEngine
        graphs = None if not cfg.cuda_graphs else cfg.cuda_graphs == "true"
        engine = StaticEngine(engine_dir, static_len=cfg.static_kv_len, cuda_graphs=graphs, **kw)
    else:
        engine = TorchEngine(engine_dir, **kw)
    return _worker(cfg.role, engine)


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
