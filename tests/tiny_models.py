"""Tiny random Llama-style engine folders for tests (no downloads, built in milliseconds).

A folder holds what ``TorchEngine`` loads: an HF-style ``config.json``, ``model.safetensors`` with
HF tensor names and ``engine.json``. Weights are random but scaled so that next-token distributions
are neither one-hot nor uniform (a statistical test needs both frequent and rare tokens) and so that
they depend on the context (otherwise a joint-distribution test says little about conditionals).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def make_tiny_engine(folder: str | Path, seed: int, vocab: int = 16, hidden: int = 32, layers: int = 2,
                     heads: int = 4, kv_heads: int = 2, intermediate: int = 64, tie: bool = True,
                     logit_scale: float = 0.2, base: dict[str, torch.Tensor] | None = None,
                     noise: float = 1.0) -> Path:
    """Writes a random model to ``folder`` and returns the folder.

    ``logit_scale`` is the final norm's weight: with unit-norm embeddings the logits' spread is
    about sqrt(hidden) * logit_scale, which sets the entropy. ``base`` (the tensors of another tiny
    model) + ``noise`` makes a correlated model: a drafter that agrees with the target only partly.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    head_dim = hidden // heads

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def proj(out_f: int, in_f: int, gain: float = 1.5) -> torch.Tensor:
        # gain > 1: the attention and MLP change the residual stream enough to make p depend on context
        return rnd(out_f, in_f, std=gain / math.sqrt(in_f))

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(vocab, hidden, std=1.0)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = proj(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = proj(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = proj(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = proj(hidden, heads * head_dim)
        w[p + "mlp.gate_proj.weight"] = proj(intermediate, hidden)
        w[p + "mlp.up_proj.weight"] = proj(intermediate, hidden)
        w[p + "mlp.down_proj.weight"] = proj(hidden, intermediate)
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
    if base is not None:  # correlated model: base + noise * fresh randomness (norms stay at 1)
        w = {k: (base[k] + noise * v) / math.sqrt(1 + noise**2) if "layernorm" not in k else v
             for k, v in w.items()}
    w["model.norm.weight"] = torch.full((hidden,), logit_scale)
    if not tie:
        w["lm_head.weight"] = rnd(vocab, hidden, std=1.0)
    save_file({k: v.contiguous() for k, v in w.items()}, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": intermediate, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": tie, "max_position_embeddings": 256,
        "eos_token_id": -1,  # no real token is EOS: generations never end early
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    (folder / "engine.json").write_text(json.dumps({"dtype": "float32"}))
    return folder


def load_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(folder) / "model.safetensors"))
