"""Builds every engine an engines/<profile>.yaml names (the CPU torch path).

For each engine: fetch + verify its source checkpoint (tools/fetch_weights.py), then convert it once
into engines/<name>/ (tools/convert_gguf.py). A source with `path:` is the user's own checkpoint, a
local Hugging Face folder or GGUF file (tools/local_checkpoints.py): its architecture is checked
before anything is converted, and the drafter's tokenizer against the target's once both are built.
Idempotent: an engine folder whose engine.json records the same source checksum (a fingerprint for
local sources), dtype and layer count is left alone. An engine's ``runtime`` (torch, openvino or
llamacpp) and ``ov_weights`` (bf16, f32 or int8) are recorded in its engine.json, where the serving
factory reads them; the OpenVINO graph itself is built from model.safetensors when it loads, and a
llamacpp engine reads the source GGUF itself, linked into its folder as model.gguf.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import yaml

from ssd.engine.meta import gguf_tensor_types
from ssd_tools.convert_gguf import convert, describe
from ssd_tools.fetch_weights import ChecksumError, fetch
from ssd_tools.local_checkpoints import CheckpointError, check_same_tokenizer, check_source, convert_hf_dir, fingerprint


def engine_is_current(folder: Path, sha: str, dtype: str, keep_layers: int, gguf_only: bool = False) -> bool:
    """Whether ``folder`` holds this build already: the same source, dtype and layers, and the
    converted weights unless the engine runs the GGUF itself (``gguf_only``, a llama.cpp engine)."""
    meta = folder / "engine.json"
    if not meta.exists():
        return False
    m = json.loads(meta.read_text())
    if not gguf_only and not (folder / "model.safetensors").exists():
        return False
    return m.get("source_sha256") == sha and m.get("dtype") == dtype and m.get("keep_layers", 0) == keep_layers


RUNTIMES = ("torch", "openvino", "llamacpp")


def link_gguf(folder: Path, spec: dict, gguf: Path | None) -> None:
    """A llamacpp engine's weights: the source GGUF itself (a hard link where the file system allows)."""
    if spec.get("runtime") != "llamacpp":
        return
    if gguf is None or gguf.suffix != ".gguf":
        raise ValueError(f"engine {folder.name}: runtime llamacpp needs a GGUF source")
    if spec.get("keep_layers"):
        raise ValueError(f"engine {folder.name}: runtime llamacpp runs the whole GGUF; keep_layers needs torch")
    dst = folder / "model.gguf"
    if dst.exists() and dst.stat().st_size == gguf.stat().st_size:
        return
    dst.unlink(missing_ok=True)
    try:
        os.link(gguf, dst)
    except OSError:
        shutil.copyfile(gguf, dst)


def record_runtime(folder: Path, spec: dict) -> None:
    runtime = spec.get("runtime", "torch")
    if runtime not in RUNTIMES:
        raise ValueError(f"engine {folder.name}: runtime must be one of {RUNTIMES}, got {runtime!r}")
    meta_path = folder / "engine.json"
    meta = json.loads(meta_path.read_text())
    wanted = ({"runtime": runtime, "ov_weights": spec.get("ov_weights", "bf16")} if runtime == "openvino"
              else {"runtime": runtime} if runtime == "llamacpp" else {})
    if runtime == "llamacpp":  # the engine picks llama.cpp's kernels by them (LlamaCppEngine)
        wanted["gguf_tensor_types"] = gguf_tensor_types(folder)  # the recorded list, else read once
    keys = ("runtime", "ov_weights", "gguf_tensor_types")
    if {k: meta.get(k) for k in keys if k in meta} != wanted:
        meta = {k: v for k, v in meta.items() if k not in keys} | wanted
        meta_path.write_text(json.dumps(meta, indent=2))


def build(config: Path, out_root: Path, cache: Path, dtype_override: str | None = None,
          hf_weights: bool = False) -> list[Path]:
    """Builds every engine of ``config`` into ``out_root``. A llama.cpp engine's folder gets no
    converted weights (it runs the GGUF) unless ``hf_weights``: TensorRT-LLM builds from them."""
    cfg = yaml.safe_load(config.read_text())
    engines = cfg["engines"]
    local = {}  # engine name -> (path, kind): checked before anything is fetched or converted
    for name, spec in engines.items():
        src = cfg["sources"][spec["source"]]
        if "path" in src:
            path = (config.parent / Path(src["path"]).expanduser()).resolve()
            local[name] = (path, check_source(path))
    by_role = {spec["role"]: name for name, spec in engines.items()}
    pair = [by_role.get("target"), by_role.get("drafter")]
    if all(n in local and local[n][1] == "hf" for n in pair):  # both HF folders: check before converting
        check_same_tokenizer(local[pair[0]][0], local[pair[1]][0], *pair)
    built = {}
    for i, (name, spec) in enumerate(engines.items(), 1):
        src = cfg["sources"][spec["source"]]
        dtype = dtype_override or spec.get("dtype", "bfloat16")
        keep = int(spec.get("keep_layers", 0))
        folder = out_root / name
        print(f"[build] engine {i}/{len(engines)}: {name} ({spec['role']}, {dtype})", flush=True)
        source_id = fingerprint(local[name][0]) if name in local else src["sha256"]
        is_hf = name in local and local[name][1] == "hf"
        gguf = None if is_hf else local[name][0] if name in local else None
        gguf_only = spec.get("runtime") == "llamacpp" and not is_hf and not hf_weights
        if engine_is_current(folder, source_id, dtype, keep, gguf_only):
            print(f"[build] {folder} is up to date, nothing to do", flush=True)
        elif is_hf:
            convert_hf_dir(local[name][0], folder, dtype, spec["role"], source_id)
        elif gguf_only:
            gguf = gguf or fetch(src, cache)
            describe(gguf, folder, dtype, spec["role"], source_id)
        else:
            gguf = gguf or fetch(src, cache)
            convert(gguf, folder, dtype, spec["role"], source_id, keep)
        if spec.get("runtime") == "llamacpp" and not is_hf and gguf is None:
            gguf = fetch(src, cache)  # verified against its checksum again, or fetched if gone
        link_gguf(folder, spec, gguf)
        record_runtime(folder, spec)
        built[name] = folder
    if all(pair):
        check_same_tokenizer(built[pair[0]], built[pair[1]], *pair)
    return list(built.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", type=Path, default=Path("engines/default.yaml"))
    ap.add_argument("--out", type=Path, default=Path("engines"))
    ap.add_argument("--cache", type=Path, default=Path("engines/.cache"))
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="override every engine's dtype")
    ap.add_argument("--hf-weights", action="store_true",
                    help="convert llama.cpp engines' weights too (TensorRT-LLM builds from them)")
    a = ap.parse_args()
    t0 = time.time()
    try:
        build(a.config, a.out, a.cache, a.dtype, a.hf_weights)
    except ChecksumError as e:
        print(f"[build] ERROR: {e}", file=sys.stderr)
        sys.exit(3)
    except CheckpointError as e:
        print(f"[build] ERROR: {e}", file=sys.stderr)
        sys.exit(4)
    print(f"[build] done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
