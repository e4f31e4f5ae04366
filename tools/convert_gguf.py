"""Converts a GGUF checkpoint once into a torch engine folder (the CPU "engine build").

Output: ``model.safetensors`` (bf16 or fp32), ``config.json``, tokenizer files and ``engine.json``
(dtype, source checksum, role). Loading GGUF through transformers dequantises it (~60 s for the
1.5B target); reloading the safetensors takes seconds. ``--keep-layers N`` derives a small drafter
from the first N layers of a checkpoint (same vocabulary): used for the tiny test pair.

A llama.cpp engine runs the GGUF itself: ``describe`` writes its folder without the weights
(config, tokenizer and engine.json, read from the GGUF's metadata in seconds).
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path


def convert(gguf: Path, out: Path, dtype: str, role: str, sha256: str = "", keep_layers: int = 0) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    print(f"[convert] loading {gguf.name} with transformers (dequantising to {dtype}) ...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch_dtype)
    cfg = model.config.to_dict()
    state = model.state_dict()
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    if keep_layers:
        state = {k: v for k, v in state.items()
                 if not k.startswith("model.layers.") or int(k.split(".")[2]) < keep_layers}
        cfg["num_hidden_layers"] = keep_layers
    tmp = _staging(out)
    print(f"[convert] writing {len(state)} tensors to {out} ...", flush=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "model.safetensors"))
    _finish(gguf, tmp, out, cfg, dict(dtype=dtype, role=role, source=gguf.name, source_sha256=sha256,
                                      keep_layers=keep_layers), t0)


def describe(gguf: Path, out: Path, dtype: str, role: str, sha256: str = "") -> None:
    """The folder of an engine that runs ``gguf`` itself (llama.cpp): config, tokenizer and
    engine.json, no converted weights (``weights: gguf`` in engine.json)."""
    from transformers import AutoConfig

    t0 = time.time()
    print(f"[convert] reading {gguf.name}'s config and tokenizer (llama.cpp runs the GGUF itself) ...", flush=True)
    cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).to_dict()
    _finish(gguf, _staging(out), out, cfg, dict(dtype=dtype, role=role, source=gguf.name, source_sha256=sha256,
                                                 keep_layers=0, weights="gguf"), t0)


def _staging(out: Path) -> Path:
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def _finish(gguf: Path, tmp: Path, out: Path, cfg: dict, meta: dict, t0: float) -> None:
    """Writes config.json, the tokenizer and engine.json into ``tmp``, then moves it to ``out``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg.pop("quantization_config", None)
    cfg["dtype"] = meta["dtype"]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    tok.save_pretrained(str(tmp))
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    for name in ("<|im_end|>", "<|endoftext|>"):
        tid = tok.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid >= 0 and tid != tok.unk_token_id:
            eos.add(tid)
    meta.update(eos_token_ids=sorted(eos), built_in_s=round(time.time() - t0, 1))
    (tmp / "engine.json").write_text(json.dumps(meta, indent=2))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    print(f"[convert] {out} ready in {time.time() - t0:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--role", default="target")
    ap.add_argument("--keep-layers", type=int, default=0)
    a = ap.parse_args()
    convert(a.gguf, a.out, a.dtype, a.role, keep_layers=a.keep_layers)


if __name__ == "__main__":
    main()
