"""A lean Llama / Qwen2 decoder forward (gpt-fast style), written for speculative decoding.

Why not transformers' forward: speculation needs three things it does not give cheaply: rows that
attend to a tree of branches over one shared prefix, a KV cache we can roll back and copy rows
within, and results that do not depend on how many rows share a forward (greedy SD must equal AR
token for token). The projections and the MLP run as one GEMM over every row of every sequence
in the batch; attention runs per sequence (and, in exact mode, per row, over exactly the keys the
row may see, so its reductions have the same length whichever way the row was scheduled).
"""
from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_cache import SequenceKV


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position: int

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        rope = cfg.get("rope_parameters") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            intermediate_size=cfg["intermediate_size"],
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position=int(cfg.get("max_position_embeddings", 32768)),
        )


@dataclass
class RowBatch:
    """The new rows of one sequence in a forward.

    Rows are written to KV slots ``start .. start+n-1`` of ``kv``. ``positions`` are their RoPE
    positions (differ from slots for branches of a tree). ``visible`` is None for a plain causal
    chunk (row i sees slots 0..start+i), else a bool mask [n, start+n] over slots.
    """

    tokens: torch.Tensor  # [n] int64
    positions: torch.Tensor  # [n] int64
    kv: SequenceKV
    start: int
    visible: torch.Tensor | None = None
    logits_from: int = 0  # logits are returned for rows logits_from..n-1
    context_ids: torch.Tensor | None = None  # ids beyond a truncated head seen in the sequence (Transformer)


@functools.cache
def packing_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack a weight of ``dtype`` on this CPU: its bf16 path needs AVX-512
    (bw/vl/dq) or AVX-NE-CONVERT, and an AVX2-only CPU refuses it at load time; such a CPU runs
    the plain GEMM (tried once on a small weight, so whatever oneDNN requires is what decides)."""
    if not (hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 8)
        return True
    except RuntimeError:
        return False


# Batch invariance. oneDNN's bf16 GEMM gives a row the same bits for any row count from 2 to 32
# (the AVX-512 kernel); a single row takes a different path, and above 32 rows it switches to AMX
# tiles whose results depend on the row count (measured on AVX-512 Xeons with AMX for every
# projection of the default target, 1 and 2 threads). So an exact forward runs its GEMMs in tiles of 2..32 rows and a
# row's logits do not depend on what else shares the forward: greedy output under any concurrency
# equals the lone request's.
TILE = 32


def invariant_tiles(sizes: list[int], tile: int = TILE) -> list[tuple[int, int]]:
    """Row ranges [a, b) of a forward over sequences with ``sizes`` new rows, to run as separate
    GEMMs so that every row's result depends on its own sequence only. A sequence with more than
    ``tile`` rows (a prefill) is a range of its own: the same rows alone in every mode and batch.
    The other sequences' rows are split into balanced tiles of at most ``tile`` rows (a 1-row
    tile is padded to 2 by Linear)."""
    out, run_start, off = [], 0, 0

    def close_run(end: int) -> None:
        n = end - run_start
        if n:
            k = -(-n // tile)
            cuts = [run_start + round(i * n / k) for i in range(k + 1)]
            out.extend(zip(cuts[:-1], cuts[1:]))

    for n in sizes:
        if n > tile:
            close_run(off)
            out.append((off, off + n))
            run_start = off + n
        off += n
    close_run(off)
    return out


def _int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


# fbgemm multiplies u8 activations by s8 weights with vpmaddubsw where the CPU lacks AVX-512 VNNI,
# which sums pairs into int16 and saturates: on an AVX2-only EPYC the int8 drafter's top-1 agreed
# with bf16 on 0.25 of a prompt's positions. 7-bit activations (reduce_range) cannot overflow it.
_INT8_REDUCE_RANGE = not torch.cpu._is_vnni_supported()


def _int8_prepack(weight: torch.Tensor, bias: torch.Tensor | None):
    """int8 weights, one scale per output channel (symmetric), packed for fbgemm's dynamic GEMM."""
    torch.backends.quantized.engine = "fbgemm"
    wf = weight.float()
    scale = (wf.abs().amax(1) / 127).clamp(min=1e-8).double()
    with warnings.catch_warnings():  # torch 2.13 marks quantized tensors deprecated; the pin keeps them
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_channel(wf, scale, torch.zeros(wf.shape[0], dtype=torch.long), 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(q, None if bias is None else bias.float())


def _int8_rows(x: torch.Tensor, weight) -> torch.Tensor:
    """fbgemm's dynamic int8 GEMM, its activation scale shared only by rows of like magnitude.

    fbgemm quantizes a call's whole input with one scale, and a few tokens (the first one, some
    delimiters) carry activations hundreds of times larger than the rest, so in a prompt's prefill
    every other row lost most of its bits: the 0.5B drafter's down_proj erred by 24-42% (relative
    norm) in its last layers over a 256-row prefill, against 4-7% row by row, and its drafts after
    a prefill agreed with bf16 on 0.88 of the positions against 0.97 with down_proj in bf16. Rows
    are therefore grouped by the power of two of their largest |value|, one GEMM per group (a
    decode step has one row, a speculation tree's rows are alike: one or two groups)."""
    xf = x.float()
    if xf.shape[0] > 1:
        exponent = torch.frexp(xf.abs().amax(1))[1]
        groups = exponent.unique()
        if groups.numel() > 1:
            out = None
            for g in groups:
                rows = (exponent == g).nonzero().squeeze(1)
                y = torch.ops.quantized.linear_dynamic(xf[rows], weight, _INT8_REDUCE_RANGE)
                out = y.new_empty(xf.shape[0], y.shape[1]) if out is None else out
                out[rows] = y
            return out.to(x.dtype)
    return torch.ops.quantized.linear_dynamic(xf, weight, _INT8_REDUCE_RANGE).to(x.dtype)


class Linear:
    """y = x W^T + b. On CPU the weight is reordered once into oneDNN's blocked layout: decode is
    memory-bound, and the packed kernels stream weights about 2x faster than a plain bf16 GEMM
    (measured here: 19.4 vs 8.1 GB/s on one core). ``int8``: weights in int8 with a scale per
    output channel, activations quantized per group of like rows (``_int8_rows``): half the bytes
    per forward, for a drafter, whose drafts need not be exact (verification is); measured on this
    AMD EPYC, one core, weights out of cache: 0.26 vs 0.44 ms for the 0.5B drafter's gate/up
    projection at 1 row, 0.58 vs 0.79 ms at 12 rows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, int8: bool = False):
        self.bias = bias
        self.int8 = int8 and weight.device.type == "cpu" and _int8_available()
        self.packed = not self.int8 and pack and weight.device.type == "cpu" and packing_available(weight.dtype)
        if self.int8:
            self.weight = _int8_prepack(weight, bias)
        else:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 8) if self.packed else weight

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8:
            return _int8_rows(x, self.weight)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor, tiles: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """``tiles``: row ranges run as separate GEMMs (see invariant_tiles); None: one GEMM."""
        if tiles is None or (len(tiles) == 1 and tiles[0][1] - tiles[0][0] > 1):
            return self._gemm(x)
        outs = []
        for a, b in tiles:
            if b - a == 1:  # a lone row would take the single-row path: pair it with itself
                outs.append(self._gemm(x[a:b].expand(2, -1).contiguous())[:1])
            else:
                outs.append(self._gemm(x[a:b]))
        return torch.cat(outs)


class Transformer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 pack: bool = True, head_vocab: int = 0, device: torch.device | str = "cpu", int8: bool = False,
                 int8_down: bool = False, embedding=None):
        """``head_vocab`` > 0 keeps only the first ``head_vocab`` rows of the output projection (a
        drafter option: BPE ids are ordered by merge rank, so the low ids are the frequent tokens;
        the rest get logit -inf, i.e. q = 0, which verification handles exactly), except the ids a
        sequence's own tokens hold (``RowBatch.context_ids``): those get their real logits. A
        prompt's rare words come back in the answer (GSM8K's names and objects, HumanEval's
        identifiers): with the default drafter's 32768-row head, 16 of 85 verify outcomes were
        such a token, which the drafter could neither draft nor guess. ``int8``: every
        projection but down_proj in int8 (Linear; a drafter option as well); ``int8_down``:
        down_proj as well. Its input (SwiGLU's product) has the largest outliers: rows grouped by
        magnitude (_int8_rows) tame the outlier tokens, not outlier channels within a row. Top-1
        agreement with bf16 of one-row steps, down_proj in bf16 / in int8: SmolLM2-135M
        0.82-0.94 / 0.75-0.84, the default 0.5B drafter 0.95 / 0.94 (its step 108 / 60-76 ms on the
        AVX2-only EPYC, where a bf16 down_proj computes in float32 and was half the step).
        ``embedding``: a callable giving the embedding rows of token ids (embedding.MappedEmbedding:
        the table stays in the file); None keeps the table in memory."""
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        w = {k: v.to(self.device, dtype).contiguous() for k, v in weights.items()}
        # Tensors we keep are cloned: safetensors maps the file, and one surviving view would keep
        # the whole mapping (every page we touched while packing) resident next to the packed copy.
        table = w["model.embed_tokens.weight"]
        self.norm = w["model.norm.weight"].clone()
        tied = config.tie_word_embeddings or "lm_head.weight" not in w
        head = table if tied else w["lm_head.weight"]
        self.head_vocab = head_vocab if 0 < head_vocab < config.vocab_size else config.vocab_size
        self.lm_head = Linear(head[: self.head_vocab].contiguous(), None, pack, int8)
        if embedding is not None:
            self.embed = embedding
        else:
            table = table.clone()
            self.embed = lambda ids: F.embedding(ids, table)
        # the rows beyond the head, for context ids (the embedding's own rows when tied)
        if tied:
            self.head_rest = lambda idx: self.embed(idx + self.head_vocab)
        else:
            rest = head[self.head_vocab:].clone()
            self.head_rest = lambda idx: rest.index_select(0, idx)
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            # q, k and v fused into one GEMM: one pass over the activations instead of three.
            qkv_w = torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])
            qkv_b = None
            if a + "q_proj.bias" in w:
                qkv_b = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
            gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
            self.layers.append(dict(
                ln1=w[p + "input_layernorm.weight"].clone(), ln2=w[p + "post_attention_layernorm.weight"].clone(),
                qkv=Linear(qkv_w, qkv_b, pack, int8), o=Linear(w[a + "o_proj.weight"], None, pack, int8),
                gate_up=Linear(gate_up, None, pack, int8),
                down=Linear(w[p + "mlp.down_proj.weight"], None, pack, int8 and int8_down),
            ))
            for key in list(w):  # free the unpacked copies as we go (peak memory ~ one model)
                if key.startswith(p):
                    del w[key]
        c = config
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
        self._inv_freq = inv.to(self.device)
        self.scale = 1.0 / math.sqrt(c.head_dim)

    def new_kv(self, capacity: int = 256) -> SequenceKV:
        c = self.config
        return SequenceKV(c.num_layers, c.num_kv_heads, c.head_dim, self.dtype, capacity, self.device)

    # -- pieces ---------------------------------------------------------------------------------
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)
        return (xf.to(self.dtype)) * w

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [heads, n, d]; rotate-half convention of HF Llama/Qwen2.
        xf = x.float()
        half = xf.shape[-1] // 2
        rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * cos + rot * sin).to(x.dtype)

    def _attend(self, q: torch.Tensor, rb: RowBatch, layer: int, exact: bool) -> torch.Tensor:
        """q: [H, n, D] -> [n, H*D]. Keys/values of the new rows are already in the cache.

        Grouped-query attention without copying K/V per head: the query heads that share a KV head
        are stacked as extra rows ([Hkv, group*n, D]) against that head's keys.
        """
        c = self.config
        n, hkv, d = q.shape[1], c.num_kv_heads, c.head_dim
        group = c.num_heads // hkv
        end_all = rb.start + n
        k = rb.kv.keys(layer, end_all).float()  # [Hkv, L, D], converted once per layer
        v = rb.kv.values(layer, end_all).float()
        qg = q.float().view(hkv, group, n, d)
        if rb.visible is None and exact:
            # One row at a time over exactly the keys it sees: the same shapes whichever forward the
            # row is part of, so a verify row equals the AR step for that position bit for bit.
            out = torch.empty(hkv, group, n, d, device=q.device)
            for i in range(n):
                end = rb.start + i + 1
                s = torch.matmul(qg[:, :, i], k[:, :end].transpose(1, 2)) * self.scale
                out[:, :, i] = torch.matmul(torch.softmax(s, dim=-1), v[:, :end])
        else:
            mask = (rb.visible if rb.visible is not None
                    else torch.ones(n, end_all, dtype=torch.bool, device=q.device).tril(rb.start))
            s = torch.matmul(qg.reshape(hkv, group * n, d), k.transpose(1, 2)) * self.scale
            s = s.view(hkv, group, n, end_all).masked_fill(~mask, float("-inf"))
            out = torch.matmul(torch.softmax(s, dim=-1).view(hkv, group * n, end_all), v).view(hkv, group, n, d)
        return out.view(c.num_heads, n, d).to(self.dtype).transpose(0, 1).reshape(n, c.num_heads * d)

    # -- the forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: list[RowBatch], exact: bool = False) -> list[torch.Tensor]:
        """Runs the rows of every sequence; writes their K/V; returns float32 logits per sequence.
        ``exact``: every row's result depends on its own sequence only (per-row attention, GEMMs
        in invariant tiles), so it is the same in any mode and any batch."""
        c = self.config
        sizes = [rb.tokens.numel() for rb in batch]
        tiles = invariant_tiles(sizes) if exact else None
        for rb, n in zip(batch, sizes):
            rb.kv.reserve(rb.start + n)
            if rb.visible is not None:
                rb.visible = rb.visible.to(self.device)
        tokens = torch.cat([rb.tokens for rb in batch]).to(self.device)
        positions = torch.cat([rb.positions for rb in batch]).to(self.device)
        cos, sin = self._rope(positions)
        x = self.embed(tokens)
        hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
        for li, L in enumerate(self.layers):
            h = self._rms(x, L["ln1"])
            qkv = L["qkv"](h, tiles)
            q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            attn_out = []
            off = 0
            for rb, n in zip(batch, sizes):
                sl = slice(off, off + n)
                qi = self._apply_rope(q[sl].view(n, hq, d).transpose(0, 1), cos[sl], sin[sl])
                ki = self._apply_rope(k[sl].view(n, hk, d).transpose(0, 1), cos[sl], sin[sl])
                rb.kv.write(li, rb.start, ki, v[sl].view(n, hk, d).transpose(0, 1))
                attn_out.append(self._attend(qi, rb, li, exact))
                off += n
            x = x + L["o"](torch.cat(attn_out), tiles)
            h = self._rms(x, L["ln2"])
            gate, up = L["gate_up"](h, tiles).chunk(2, dim=-1)
            x = x + L["down"](F.silu(gate) * up, tiles)
        # Only the rows that need logits go through the (large) output projection.
        keep, off = [], 0
        for rb, n in zip(batch, sizes):
            keep.append(torch.arange(off + rb.logits_from, off + n))
            off += n
        rows = torch.cat(keep).to(self.device)
        n_logits = [n - rb.logits_from for rb, n in zip(batch, sizes)]
        h = self._rms(x[rows], self.norm)
        logits = self.lm_head(h, invariant_tiles(n_logits) if exact else None).float()
        if self.head_vocab < c.vocab_size:
            logits = self._widen(logits, h, [rb.context_ids for rb in batch], n_logits)
        return list(logits.split(n_logits))

    def _widen(self, logits: torch.Tensor, h: torch.Tensor, context: list, n_logits: list[int]) -> torch.Tensor:
        """Truncated-head logits [n, head_vocab] -> [n, vocab]: -inf beyond the head, except each
        sequence's context ids, computed from the rows beyond the head (a few dozen dot products)."""
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, : self.head_vocab] = logits
        off = 0
        for ids, n in zip(context, n_logits):
            if ids is not None and ids.numel() and n:
                ids = ids.to(self.device)
                w = self.head_rest(ids - self.head_vocab)
                full[off:off + n, ids] = F.linear(h[off:off + n], w).float()
            off += n
        return full
