"""The torch engine for a GPU drafter: a static KV cache and fixed-shape steps, captured as CUDA graphs.

A drafter's decode and tree steps are small (one row, or a tree's few dozen rows, per sequence), so
on a GPU the eager forward costs its kernel launches, not its FLOPs: hundreds of launches a step.
Here every step of ``batch`` sequences x ``rows`` new rows over ``length`` cache positions runs one
fixed-shape function over a KV pool allocated once: each sequence owns a slot [kv_heads,
static_len, head_dim] per layer, the new rows' K/V are scattered to (slot, position), and attention
reads the first ``length`` positions of the batch's slots with a boolean mask [batch, rows, length]:
a causal prefix for a decode, the shared prefix plus each branch's ancestors for a tree step
(batched tree attention). ``length`` is the smallest of a few length buckets (256, x4 up to
static_len) that holds the batch's longest sequence, so a step costs what its sequences use, not
the whole slot. The query heads sharing a KV head attend as one group of rows, so K/V are never
expanded to the query heads. Batch and rows round up to powers of two; padding rows write to a
spare slot nobody reads. On CUDA every (batch, rows, length) shape is captured as a CUDA graph
(torch.cuda.graph) when the engine loads, before the model reports READY, and replayed with the
inputs copied into its static buffers, as gpt-fast and the reference SSD engine do; capture and
replay run in the engine's device scope (engine.device_context). On the CPU the same function runs
eagerly, which is how the tests check it against the dynamic forward.

Forwards the static step does not take (a prefill longer than ``max_step_rows``, an exact forward)
run the dynamic forward on the same pool (a slot is a SequenceKV view), so both write one cache.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .engine import Sequence, TorchEngine
from .kv_cache import SequenceKV
from .model import RowBatch, Transformer


def bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def length_buckets(static_len: int, smallest: int = 256, factor: int = 4) -> list[int]:
    """The attention widths a step is captured for: ``smallest``, x ``factor``, ..., ``static_len``.
    A step reads at most ``factor`` times the positions its longest sequence uses."""
    out, n = [], min(smallest, static_len)
    while n < static_len:
        out.append(n)
        n *= factor
    return out + [static_len]


class KVPool:
    """Per layer K and V of shape [slots + 1, kv_heads, static_len, head_dim]; the last slot is
    the spare that padding rows write to."""

    def __init__(self, model: Transformer, slots: int, static_len: int):
        c = model.config
        shape = (slots + 1, c.num_kv_heads, static_len, c.head_dim)
        self.k = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_layers)]
        self.v = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_layers)]
        self.spare, self.static_len = slots, static_len


class SlotKV(SequenceKV):
    """One sequence's slot of the pool, as the SequenceKV the dynamic forward writes and reads."""

    def __init__(self, pool: KVPool, slot: int):
        t = pool.k[0]
        self.layers, self.kv_heads, self.head_dim, self.dtype = len(pool.k), t.shape[1], t.shape[3], t.dtype
        self.device, self.slot, self.capacity = t.device, slot, pool.static_len
        self.k = [k[slot] for k in pool.k]
        self.v = [v[slot] for v in pool.v]

    def reserve(self, slots: int) -> None:
        if slots > self.capacity:
            raise ValueError(f"sequence needs {slots} KV slots, more than the static cache's {self.capacity} "
                             "(parameter static_kv_len)")


class StaticStep:
    """One fixed (batch, rows, length) shape: its input buffers, and on CUDA its captured graph."""

    def __init__(self, model: Transformer, pool: KVPool, batch: int, rows: int, length: int, use_graph: bool,
                 mempool=None):
        self.model, self.pool, self.batch, self.rows, self.length = model, pool, batch, rows, length
        dev, n = model.device, batch * rows
        self.buf = {"tokens": torch.zeros(n, dtype=torch.long, device=dev),
                    "positions": torch.zeros(n, dtype=torch.long, device=dev),
                    "write_slot": torch.full((n,), pool.spare, dtype=torch.long, device=dev),
                    "write_pos": torch.arange(n, device=dev) % pool.static_len,
                    "slots": torch.full((batch,), pool.spare, dtype=torch.long, device=dev),
                    "mask": torch.zeros(batch, rows, length, dtype=torch.bool, device=dev)}
        self.buf["mask"][:, :, 0] = True  # padding rows see one key: no all-masked softmax
        self.graph, self.out = None, None
        if use_graph:
            self._capture(mempool)

    @torch.inference_mode()
    def _capture(self, mempool) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph (cuBLAS workspaces, lazy inits)
            for _ in range(2):
                self.forward(**self.buf)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=mempool):
            self.out = self.forward(**self.buf)

    def run(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        for key, value in inputs.items():
            if key == "mask":  # only the slots in use cross from the host; the rest is cleared in place
                width = value.shape[-1]
                self.buf[key][..., :width].copy_(value, non_blocking=True)
                self.buf[key][..., width:].fill_(False)
            else:
                self.buf[key].copy_(value, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
            return self.out
        with torch.inference_mode():
            return self.forward(**self.buf)

    def forward(self, tokens, positions, write_slot, write_pos, slots, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (final-norm hidden states [batch*rows, hidden], head logits [batch*rows, head_vocab])."""
        m, c, pool = self.model, self.model.config, self.pool
        b, r, length = self.batch, self.rows, self.length
        hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
        g = hq // hk
        # the g query heads of a KV head attend as g*r rows of one group: K/V stay [b, hk, length, d]
        group_mask = mask[:, None].expand(b, g, r, length).reshape(b, 1, g * r, length)
        cos, sin = m._rope(positions)
        x = m.embed(tokens)
        for li, layer in enumerate(m.layers):
            h = m._rms(x, layer["ln1"])
            q, k, v = layer["qkv"](h).split([hq * d, hk * d, hk * d], dim=-1)
            q = m._apply_rope(q.view(-1, hq, d).transpose(0, 1), cos, sin)
            k = m._apply_rope(k.view(-1, hk, d).transpose(0, 1), cos, sin)
            pool.k[li][write_slot, :, write_pos] = k.transpose(0, 1)
            pool.v[li][write_slot, :, write_pos] = v.view(-1, hk, d)
            keys = pool.k[li][:, :, :length].index_select(0, slots)  # [batch, kv_heads, length, d]
            values = pool.v[li][:, :, :length].index_select(0, slots)
            qb = q.view(hq, b, r, d).transpose(0, 1).reshape(b, hk, g * r, d)
            att = F.scaled_dot_product_attention(qb, keys, values, attn_mask=group_mask, scale=m.scale)
            att = att.view(b, hq, r, d)
            x = x + layer["o"](att.permute(0, 2, 1, 3).reshape(b * r, hq * d))
            h = m._rms(x, layer["ln2"])
            gate, up = layer["gate_up"](h).chunk(2, dim=-1)
            x = x + layer["down"](F.silu(gate) * up)
        h = m._rms(x, m.norm)
        return h, m.lm_head(h).float()


class StaticEngine(TorchEngine):
    """TorchEngine with a static KV pool of ``max_sequences`` slots of ``static_len`` tokens; steps
    of up to ``max_step_rows`` rows per sequence run as StaticStep (CUDA graphs when ``cuda_graphs``,
    by default on a CUDA device, every shape captured here, at load)."""

    def __init__(self, folder, *, static_len: int = 4096, max_step_rows: int = 64, cuda_graphs: bool | None = None,
                 min_length: int = 256, **kw):
        super().__init__(folder, **kw)
        self.max_len = min(self.max_len, static_len)
        self.max_step_rows = max_step_rows
        self.use_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        self.lengths = length_buckets(static_len, min_length)
        self.steps: dict[tuple[int, int, int], StaticStep] = {}
        self.capture_s = 0.0
        with self.on_device():
            self.pool = KVPool(self.model, self.max_sequences, static_len)
            self._mempool = self._graph_pool() if self.use_graphs else None
            if self.use_graphs:
                self._capture_all()
        self.free_slots = list(range(self.max_sequences - 1, -1, -1))

    @staticmethod
    def _graph_pool():
        return torch.cuda.graph_pool_handle()

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every (batch, rows, length) a step can take: batch and rows as powers of two up to the
        engine's limits, length from the length buckets."""
        batches = [1 << i for i in range(bucket(self.max_sequences).bit_length())]
        rows = [1 << i for i in range(bucket(self.max_step_rows).bit_length())]
        return [(b, r, n) for b in batches for r in rows for n in self.lengths]

    def _capture_all(self) -> None:
        """Captures every shape now, so no request (and no calibration run) pays for a capture."""
        t0 = time.perf_counter()
        for b, r, n in self.shapes():
            self.steps[(b, r, n)] = StaticStep(self.model, self.pool, b, r, n, True, self._mempool)
        self.capture_s = time.perf_counter() - t0

    # -- slots ----------------------------------------------------------------------------------
    def _seq(self, seq_id: str) -> Sequence:
        s = self.sequences.get(seq_id)
        if s is None:
            if not self.free_slots:  # evict the least recently used
                self.release(min(self.sequences, key=lambda k: self.sequences[k].last_used))
            s = Sequence(kv=SlotKV(self.pool, self.free_slots.pop()))
            self.sequences[seq_id] = s
        s.last_used = time.monotonic()
        return s

    def release(self, seq_id: str, keep_prefix: bool = True) -> None:
        """Frees the sequence's slot (a later sequence computes its prefix again, whatever ``keep_prefix`` says)."""
        s = self.sequences.pop(seq_id, None)
        if s is not None:
            self.free_slots.append(s.kv.slot)

    # -- the static step ------------------------------------------------------------------------
    def _step(self, batch: int, rows: int, length: int) -> StaticStep:
        key = (batch, rows, length)
        if key not in self.steps:  # eager steps (no graphs) are made on first use; graphs all exist already
            self.steps[key] = StaticStep(self.model, self.pool, batch, rows, length, self.use_graphs, self._mempool)
        return self.steps[key]

    def _forward_on_device(self, batch: list[RowBatch], exact: bool) -> list[torch.Tensor]:
        sizes = [rb.tokens.numel() for rb in batch]
        if exact or max(sizes) > self.max_step_rows or len(batch) > self.max_sequences:
            return super()._forward_on_device(batch, exact)
        t0 = time.perf_counter()
        b, r = bucket(len(batch)), bucket(max(sizes))
        length = max(rb.start + n for rb, n in zip(batch, sizes))  # the mask's width: the slots in use
        # the step's attention width (a length past the slot fails in reserve below, naming static_kv_len)
        width = next((n for n in self.lengths if n >= length), self.lengths[-1])
        spare = self.pool.spare
        tokens = torch.zeros(b, r, dtype=torch.long)
        positions = torch.zeros(b, r, dtype=torch.long)
        write_slot = torch.full((b, r), spare, dtype=torch.long)
        write_pos = (torch.arange(b * r) % self.pool.static_len).view(b, r)
        slots = torch.full((b,), spare, dtype=torch.long)
        mask = torch.zeros(b, r, length, dtype=torch.bool)
        mask[:, :, 0] = True
        for i, (rb, n) in enumerate(zip(batch, sizes)):
            rb.kv.reserve(rb.start + n)
            tokens[i, :n], positions[i, :n] = rb.tokens, rb.positions
            write_slot[i, :n] = rb.kv.slot
            write_pos[i, :n] = torch.arange(rb.start, rb.start + n)
            slots[i] = rb.kv.slot
            visible = rb.visible if rb.visible is not None else torch.ones(n, rb.start + n, dtype=torch.bool).tril(rb.start)
            mask[i, :n, : rb.start + n] = visible
        dev = self.device
        h, logits = self._step(b, r, width).run({
            "tokens": tokens.view(-1).to(dev), "positions": positions.view(-1).to(dev),
            "write_slot": write_slot.view(-1).to(dev), "write_pos": write_pos.view(-1).to(dev),
            "slots": slots.to(dev), "mask": mask.to(dev)})
        rows = torch.cat([torch.arange(i * r + rb.logits_from, i * r + n) for i, (rb, n) in enumerate(zip(batch, sizes))])
        n_logits = [n - rb.logits_from for rb, n in zip(batch, sizes)]
        rows = rows.to(dev)
        out = logits.index_select(0, rows)
        if self.model.head_vocab < self.config.vocab_size:
            out = self.model._widen(out, h.index_select(0, rows), [rb.context_ids for rb in batch], n_logits)
        result = list(out.cpu().split(n_logits))  # the copy waits for the GPU: the timing is real
        self.timing.append((sum(sizes), time.perf_counter() - t0))
        return result
