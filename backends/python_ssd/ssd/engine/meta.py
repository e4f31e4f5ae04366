"""Where a built engine folder is and what it says about itself, readable without torch (the
orchestrator's text codec needs its eos ids; the Python backend stub keeps heavy imports out)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def resolve_engine_dir(name: str) -> str:
    """Engine folders are named relative to SSD_ENGINE_ROOT (set by the launcher) or <repo>/engines."""
    if os.path.isabs(name):
        return name
    root = os.environ.get("SSD_ENGINE_ROOT") or os.path.join(
        os.path.dirname(os.path.realpath(__file__)), "..", "..", "..", "..", "engines")
    return os.path.normpath(os.path.join(root, name))


def engine_meta(folder: str | os.PathLike) -> dict:
    """A built engine folder's engine.json (dtype, eos ids, source); {} for a plain HF folder."""
    path = Path(folder) / "engine.json"
    return json.loads(path.read_text()) if path.exists() else {}


def gguf_tensor_types(folder: str | os.PathLike, gguf_name: str = "model.gguf") -> list[str]:
    """The weight types of a llamacpp engine's GGUF file: recorded in engine.json by build_engines.sh
    (the gguf library reads a large vocabulary's metadata in about 10 s), read from the file where
    the folder was made another way."""
    types = engine_meta(folder).get("gguf_tensor_types")
    if types is None:
        from gguf import GGUFReader

        types = sorted({t.tensor_type.name for t in GGUFReader(str(Path(folder) / gguf_name)).tensors})
    return list(types)


TRTLLM_SUBDIR = "trtllm"


def trtllm_engine_dir(engine_dir: str | os.PathLike) -> Path:
    """Where the TensorRT-LLM engine of the model in ``engine_dir`` (<root>/<name>, the torch
    engine's folder) lives: <root>/trtllm/<name>. tools/trtllm_build.py writes there and the
    runtime reads there."""
    p = Path(engine_dir)
    return p.parent / TRTLLM_SUBDIR / p.name
