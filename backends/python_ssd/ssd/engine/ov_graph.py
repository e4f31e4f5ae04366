"""The Llama / Qwen2 decoder forward as an OpenVINO graph with the inputs speculation needs.

One graph serves every forward the engine runs (prefill, decode, verify, tree rows, batches of
sequences): the caller passes the rows' tokens and RoPE positions, the keys and values of the slots
they may attend to (``past``, slot-major so a sequence's committed slots are a zero-copy slice), an
additive mask over past + new slots, and which rows want logits. It returns those rows' logits and
the new rows' keys and values, which the caller stores: the KV cache, rollback and tree bookkeeping
stay in Python (ov_engine.py), the arithmetic runs in OpenVINO's CPU kernels.

Attention normalises with the same GEMM that applies the values (a column of ones appended to V)
instead of a Softmax node: a vectorised softmax sums across its row in lanes, so a row's sum
depends on how long the row is (how many masked slots share the forward), while a GEMM accumulates
each output along the keys in order, and masked slots add exact zeros. So a row's attention does not
depend on how many other rows or sequences share its forward, provided each key sits at the same
position modulo the kernel's accumulation grouping: bf16 GEMMs add products in pairs of keys (and in
blocks), so the caller places every sequence's keys at a position congruent to its slot number
(``key_slots`` gathers them there; gaps read a zero slot and are masked).
"""
from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset15 as ops
import torch

from .model import ModelConfig


WEIGHTS = ("f32", "bf16", "int8")


def _const(t: torch.Tensor) -> ov.Node:
    # shared: the constant keeps the array alive instead of copying it (one f32 copy of each weight)
    return ops.constant(t.detach().float().contiguous().numpy(), shared_memory=True)


def _bf16_const(t: torch.Tensor) -> ov.Node:
    """The bf16 values as an OpenVINO bf16 constant (numpy has no bf16: the bits travel as uint16)."""
    bits = t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    tensor = ov.Tensor(ov.Type.bf16, list(bits.shape))
    tensor.data.view(np.uint16)[...] = bits
    return ov.op.Constant(tensor)


def _weight(t: torch.Tensor, weights: str) -> tuple[ov.Node, ov.Node | None]:
    """A [out, in] weight for a MatMul: f32 (every bf16 value exactly), or "int8": int8 with one f32
    scale per output row, widened inside the CPU plugin's kernels (its decompression pattern) while
    activations stay f32 (dynamic quantization is off). Such a graph's rows differ in the last bits
    with the row count, so int8 is for drafters only. Returns (constant, scale or None)."""
    if weights == "f32":
        return _const(t), None
    if weights == "bf16":
        return _bf16_const(t), None
    wf = t.detach().float()
    scale = (wf.abs().amax(1, keepdim=True) / 127).clamp(min=1e-12)
    q = torch.round(wf / scale).clamp(-127, 127).to(torch.int8)
    return ops.constant(q.contiguous().numpy(), shared_memory=True), _const(scale)


def _widened(node: ov.Node, scale: ov.Node | None) -> ov.Node:
    """The weight as the graph computes with it: bf16 converted (the plugin keeps it bf16 where it
    computes in bf16), int8 converted and scaled (its decompression pattern), f32 as is."""
    if scale is not None:
        return ops.multiply(ops.convert(node, ov.Type.f32), scale)
    if node.get_output_element_type(0) != ov.Type.f32:
        return ops.convert(node, ov.Type.f32)
    return node


def _i64(values) -> ov.Node:
    return ops.constant(np.array(values, dtype=np.int64))


def build_model(config: ModelConfig, weights: dict[str, torch.Tensor], weight_format: str = "f32") -> ov.Model:
    """Inputs: tokens [n] i64, positions [n] i64, past [P, layers, 2, Hkv, D] f32, key_slots [L] i64
    (each key position's source in past + new rows + one zero slot at P + n), mask [n, L] f32
    (0 or -inf), logit_rows [m] i64. Outputs: logits [m, V] f32, new_kv [n, layers, 2, Hkv, D] f32."""
    c = config
    hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
    group = hq // hkv
    tokens = ops.parameter([-1], ov.Type.i64, name="tokens")
    positions = ops.parameter([-1], ov.Type.i64, name="positions")
    past = ops.parameter([-1, c.num_layers, 2, hkv, d], ov.Type.f32, name="past")
    key_slots = ops.parameter([-1], ov.Type.i64, name="key_slots")
    mask = ops.parameter([-1, -1], ov.Type.f32, name="mask")
    logit_rows = ops.parameter([-1], ov.Type.i64, name="logit_rows")
    for p in (tokens, positions, past, key_slots, mask, logit_rows):
        p.output(0).set_names({p.get_friendly_name()})

    w = weights
    if weight_format not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weight_format!r}")
    embed, embed_scale = _weight(w["model.embed_tokens.weight"], weight_format)
    x = ops.gather(embed, tokens, _i64(0))  # [n, hidden]
    if weight_format == "bf16":
        x = ops.convert(x, ov.Type.f32)
    if embed_scale is not None:
        x = ops.multiply(ops.convert(x, ov.Type.f32), ops.gather(embed_scale, tokens, _i64(0)))

    inv = 1.0 / (c.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    freqs = ops.multiply(ops.unsqueeze(ops.convert(positions, ov.Type.f32), _i64(1)),
                         ops.constant(inv[None, :].astype(np.float32)))
    emb = ops.concat([freqs, freqs], 1)  # [n, D]
    cos = ops.unsqueeze(ops.cos(emb), _i64(1))  # [n, 1, D]: broadcast over heads
    sin = ops.unsqueeze(ops.sin(emb), _i64(1))
    scale = ops.constant(np.float32(1.0 / np.sqrt(d)))
    eps = ops.constant(np.float32(c.rms_eps))

    def rms(h: ov.Node, weight: torch.Tensor) -> ov.Node:
        var = ops.reduce_mean(ops.multiply(h, h), _i64([-1]), True)
        return ops.multiply(ops.divide(h, ops.sqrt(ops.add(var, eps))), _const(weight))

    def linear(h: ov.Node, name: str, bias: bool) -> ov.Node:
        y = ops.matmul(h, _widened(*_weight(w[name + ".weight"], weight_format)), False, True)
        if bias and name + ".bias" in w:
            y = ops.add(y, _const(w[name + ".bias"]))
        return y

    def rope(t: ov.Node) -> ov.Node:  # t: [n, heads, D], rotate-half convention of HF Llama/Qwen2
        first, second = ops.split(t, _i64(-1), 2).outputs()
        rot = ops.concat([ops.negative(second), first], -1)
        return ops.add(ops.multiply(t, cos), ops.multiply(rot, sin))

    # the mask per score row: rows are (query head in group, token), so tile it group times
    mask_rows = ops.unsqueeze(ops.tile(mask, _i64([max(group, 2), 1])), _i64(0))  # [1, copies*n, L]
    new_kv = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = rope(ops.reshape(linear(h, a + "q_proj", True), _i64([0, hq, d]), True))
        k = rope(ops.reshape(linear(h, a + "k_proj", True), _i64([0, hkv, d]), True))
        v = ops.reshape(linear(h, a + "v_proj", True), _i64([0, hkv, d]), True)
        new_kv.append(ops.unsqueeze(ops.concat([ops.unsqueeze(k, _i64(1)), ops.unsqueeze(v, _i64(1))], 1),
                                    _i64(1)))  # [n, 1, 2, Hkv, D]
        past_k = ops.gather(ops.gather(past, _i64(i), _i64(1)), _i64(0), _i64(1))  # [P, Hkv, D]
        past_v = ops.gather(ops.gather(past, _i64(i), _i64(1)), _i64(1), _i64(1))
        zero = ops.constant(np.zeros((1, hkv, d), dtype=np.float32))
        keys = ops.transpose(ops.gather(ops.concat([past_k, k, zero], 0), key_slots, _i64(0)), _i64([1, 0, 2]))
        values = ops.transpose(ops.gather(ops.concat([past_v, v, zero], 0), key_slots, _i64(0)), _i64([1, 0, 2]))
        # queries grouped by KV head, [Hkv, group*n, D]: one GEMM per KV head with at least two rows
        # (a one-row product takes a GEMV kernel whose sums differ from the GEMM's in the last bit)
        qg = ops.reshape(ops.transpose(q, _i64([1, 0, 2])), _i64([hkv, -1, d]), False)
        if group == 1:
            qg = ops.concat([qg, qg], 1)
        scores = ops.multiply(ops.matmul(qg, keys, False, True), scale)  # [Hkv, copies*n, L]
        scores = ops.add(scores, mask_rows)
        e = ops.exp(ops.subtract(scores, ops.reduce_max(scores, _i64([-1]), True)))
        ones = ops.broadcast(ops.constant(np.float32(1.0)),
                             ops.concat([ops.gather(ops.shape_of(values), _i64([0, 1]), _i64(0)), _i64([1])], 0))
        out_aug = ops.matmul(e, ops.concat([values, ones], -1), False, False)  # [Hkv, copies*n, D+1]
        num, den = ops.variadic_split(out_aug, _i64(-1), _i64([d, 1])).outputs()
        attn = ops.divide(num, den)
        if group == 1:
            attn = ops.split(attn, _i64(1), 2).output(0)
        attn = ops.reshape(ops.transpose(ops.reshape(attn, _i64([hq, -1, d]), False), _i64([1, 0, 2])),
                           _i64([0, hq * d]), True)
        x = ops.add(x, linear(attn, a + "o_proj", False))
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = linear(h, p + "mlp.gate_proj", False)
        up = linear(h, p + "mlp.up_proj", False)
        x = ops.add(x, linear(ops.multiply(ops.swish(gate), up), p + "mlp.down_proj", False))
    h = rms(ops.gather(x, logit_rows, _i64(0)), w["model.norm.weight"])
    if c.tie_word_embeddings or "lm_head.weight" not in w:
        head = _widened(embed, embed_scale)
    else:
        head = _widened(*_weight(w["lm_head.weight"], weight_format))
    logits = ops.matmul(h, head, False, True)
    logits.output(0).set_names({"logits"})
    kv_out = ops.concat(new_kv, 1)
    kv_out.output(0).set_names({"new_kv"})
    return ov.Model([logits, kv_out], [tokens, positions, past, key_slots, mask, logit_rows], "decoder")
