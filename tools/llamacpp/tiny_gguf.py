"""A tiny random Llama GGUF that llama.cpp loads (tests of the llama.cpp peer; no download).

A SentencePiece-style vocabulary (unknown, BOS, EOS, the 256 byte tokens, then ``words`` pieces) and
f32 weights drawn from a seeded generator, scaled so that greedy decoding wanders over the vocabulary
instead of repeating one token.
"""
from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np

UNKNOWN, CONTROL, NORMAL, BYTE = (gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.NORMAL,
                                  gguf.TokenType.BYTE)


def vocabulary(words: int) -> tuple[list[str], list[int]]:
    tokens, types = ["<unk>", "<s>", "</s>"], [UNKNOWN, CONTROL, CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = [f"\u2581{a}{b}" for a in letters for b in letters][:words]
    return tokens + pieces, types + [NORMAL] * len(pieces)


def write_tiny_gguf(path: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, ffn: int = 128, words: int = 200, context: int = 2048) -> Path:
    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens, types = vocabulary(words)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-random-llama")
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 3 + [-1000.0] * 256 + [-float(i) for i in range(len(tokens) - 259)])
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)

    def mat(rows: int, cols: int, gain: float = 1.5) -> np.ndarray:  # numpy (out, in) = ggml (in, out)
        return (rng.standard_normal((rows, cols)) * gain / math.sqrt(cols)).astype(np.float32)

    head_dim = hidden // heads
    w.add_tensor("token_embd.weight", rng.standard_normal((len(tokens), hidden)).astype(np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "attn_q.weight", mat(heads * head_dim, hidden))
        w.add_tensor(p + "attn_k.weight", mat(kv_heads * head_dim, hidden))
        w.add_tensor(p + "attn_v.weight", mat(kv_heads * head_dim, hidden))
        w.add_tensor(p + "attn_output.weight", mat(hidden, heads * head_dim))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(p + "ffn_gate.weight", mat(ffn, hidden))
        w.add_tensor(p + "ffn_up.weight", mat(ffn, hidden))
        w.add_tensor(p + "ffn_down.weight", mat(hidden, ffn))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", mat(len(tokens), hidden, gain=4.0))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
