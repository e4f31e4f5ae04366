"""A user's own checkpoints as engines: a local Hugging Face folder or a GGUF file per role.

An engines/*.yaml source with `path:` names either
- a Hugging Face checkpoint folder: config.json, *.safetensors (one file or shards) and the
  tokenizer (tokenizer.json, tokenizer_config.json, chat template); the weights are cast to the
  engine's dtype and written as one model.safetensors beside the config and tokenizer files; or
- a GGUF file, dequantised by transformers' GGUF loader (tools/convert_gguf.py, as the embedded pair).

The CPU torch engine (backends/python_ssd/ssd/engine/model.py) runs the Llama and Qwen2 decoder
families with plain RoPE: `LlamaForCausalLM` (Llama 2, SmolLM/SmolLM2, TinyLlama, ...) and
`Qwen2ForCausalLM` (Qwen2, Qwen2.5, Qwen2.5-Coder). Anything else is refused before any
conversion, and so is a drafter whose tokenizer differs from the target's: speculative decoding
passes token ids between the two, so every id must mean the same text to both.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

SUPPORTED = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


class CheckpointError(ValueError):
    """A checkpoint the CPU engine cannot serve, or a pair it cannot serve together."""


def _supported_list() -> str:
    return ", ".join(f"{arch} (model_type '{t}')" for t, arch in SUPPORTED.items())


def check_hf_config(cfg: dict, where: str) -> None:
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type not in SUPPORTED or any(a != SUPPORTED[model_type] for a in archs):
        raise CheckpointError(f"{where}: unsupported architecture {archs or model_type!r} (model_type "
                              f"{model_type!r}); the CPU engine serves {_supported_list()}")
    for key in ("rope_scaling", "rope_parameters"):  # transformers 4 and 5 spellings
        rope = cfg.get(key) or {}
        kind = rope.get("rope_type") or rope.get("type")
        if kind in (None, "default"):
            continue
        raise CheckpointError(f"{where}: {key} type {kind!r} is not supported by the CPU engine (plain RoPE only)")


def gguf_architecture(path: Path) -> str:
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("general.architecture")
    if field is None:
        raise CheckpointError(f"{path}: not a GGUF model file (no general.architecture)")
    return bytes(field.parts[field.data[0]]).decode()


def check_source(path: Path) -> str:
    """'hf' or 'gguf' for a checkpoint the engine can serve; CheckpointError otherwise."""
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.exists():
            raise CheckpointError(f"{path}: a Hugging Face checkpoint folder needs config.json")
        if not list(path.glob("*.safetensors")):
            raise CheckpointError(f"{path}: no *.safetensors weights (convert .bin checkpoints to safetensors first)")
        if not (path / "tokenizer.json").exists():
            raise CheckpointError(f"{path}: no tokenizer.json (the fast tokenizer file is required)")
        check_hf_config(json.loads(cfg_path.read_text()), str(path))
        return "hf"
    if path.is_file() and path.suffix == ".gguf":
        arch = gguf_architecture(path)
        if arch not in SUPPORTED:
            raise CheckpointError(f"{path}: unsupported GGUF architecture {arch!r}; the CPU engine serves "
                                  f"{_supported_list()}")
        return "gguf"
    raise CheckpointError(f"{path}: expected a Hugging Face checkpoint folder or a .gguf file")


def fingerprint(path: Path) -> str:
    """Changes when the checkpoint does (config, tokenizer, weights' names, sizes and times)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    for p in files:
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return "local:" + h.hexdigest()


def _eos_ids(cfg: dict, folder: Path) -> list[int]:
    from tokenizers import Tokenizer

    eos = cfg.get("eos_token_id")
    ids = set(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tcfg_path = folder / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text()) if tcfg_path.exists() else {}
    names = [tcfg.get("eos_token")] if isinstance(tcfg.get("eos_token"), str) else []
    for name in names + ["<|im_end|>", "<|endoftext|>"]:
        tid = tok.token_to_id(name)
        if tid is not None:
            ids.add(tid)
    return sorted(i for i in ids if i >= 0)


def convert_hf_dir(src: Path, out: Path, dtype: str, role: str, source_id: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    t0 = time.time()
    cfg = json.loads((src / "config.json").read_text())
    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    state = {}
    for shard in sorted(src.glob("*.safetensors")):
        state.update({k: v.to(torch_dtype).contiguous() for k, v in load_file(str(shard)).items()})
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    print(f"[convert] writing {len(state)} tensors from {src} to {out} ({dtype}) ...", flush=True)
    save_file(state, str(tmp / "model.safetensors"))
    cfg.pop("quantization_config", None)
    cfg["dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, tmp / name)
    meta = dict(dtype=dtype, role=role, source=str(src), source_sha256=source_id, keep_layers=0,
                eos_token_ids=_eos_ids(cfg, tmp), built_in_s=round(time.time() - t0, 1))
    (tmp / "engine.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"[convert] {out} ready in {time.time() - t0:.0f} s", flush=True)


def check_same_tokenizer(target: Path, drafter: Path, target_name: str = "", drafter_name: str = "") -> None:
    """Refuses a drafter whose token ids mean other text than the target's (engine or HF folders)."""
    from tokenizers import Tokenizer

    tn, dn = f"{target_name or target.name} ({target})", f"{drafter_name or drafter.name} ({drafter})"
    t = Tokenizer.from_file(str(target / "tokenizer.json")).get_vocab(with_added_tokens=True)
    d = Tokenizer.from_file(str(drafter / "tokenizer.json")).get_vocab(with_added_tokens=True)
    if t != d:
        t_by_id, d_by_id = {i: s for s, i in t.items()}, {i: s for s, i in d.items()}
        diff = sorted(i for i in set(t_by_id) | set(d_by_id) if t_by_id.get(i) != d_by_id.get(i))
        i = diff[0]
        raise CheckpointError(
            f"the drafter {dn} has a different tokenizer from the target {tn}: "
            f"{len(diff)} token ids differ (drafter {len(d)} tokens, target {len(t)}; e.g. id {i} is "
            f"{d_by_id.get(i)!r} for the drafter and {t_by_id.get(i)!r} for the target). Speculative decoding "
            f"needs a drafter from the target's family with the same tokenizer")
    tv = json.loads((target / "config.json").read_text())["vocab_size"]
    dv = json.loads((drafter / "config.json").read_text())["vocab_size"]
    if tv != dv:
        raise CheckpointError(f"the drafter {dn} has {dv} output logits and the target {tn} "
                              f"{tv}: the engines need the same vocab_size (the same padded embedding)")
