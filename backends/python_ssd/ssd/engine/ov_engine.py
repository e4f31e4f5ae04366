"""The OpenVINO engine: the torch engine's contract (sequences, prefix reuse, rollback, tree rows,
batches) with every forward run by one compiled OpenVINO graph (ov_graph.py).

Why OpenVINO on CPU: a field-standard runtime whose f32 kernels give a row the same bits whatever
else shares its forward (other rows, other sequences, 1 or 2 threads), so the exact target needs no
tiling or per-row attention, and whose multi-row forwards cost little more than one row
(docs/cpu_engine.md has the figures). It computes in f32: on a CPU without AVX-512 BF16 or AMX its
bf16 path is emulated and far slower. The sequence bookkeeping is TorchEngine's; only the model and
the KV storage differ: KV lives in one slot-major numpy array per sequence, read by the graph in place.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from .engine import Sequence, TorchEngine, _release_freed_memory  # noqa: F401 (Sequence: the shared record)

# On CPUs with AMX, OpenVINO's oneDNN takes multi-row bf16 products with AMX tiles and one-row ones
# with AVX-512, which sum in another order: a row's logits would depend on the rows beside it (2-row
# forwards differ from one-row steps by up to 0.15 on a Xeon with AMX). AMX stays off, as it does in
# the llama.cpp build (tools/llamacpp/cpu_options.sh). Read by oneDNN at its first product, so it is
# set before this module compiles any graph; an ISA the environment sets wins.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
from .meta import engine_meta
from .model import ModelConfig, RowBatch


class SlotKV:
    """A sequence's keys and values, [capacity, layers, 2, Hkv, D] float32: slot-major, so the
    first P slots are one contiguous block the graph reads in place. Values are those the graph
    produced (already rounded to its compute precision), so feeding them back is lossless."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int = 256):
        self.row_shape = (layers, 2, kv_heads, head_dim)
        self.data = np.zeros((0, *self.row_shape), dtype=np.float32)
        self.reserve(capacity)

    @property
    def capacity(self) -> int:
        return self.data.shape[0]

    def reserve(self, slots: int) -> None:
        if slots <= self.capacity:
            return
        grown = np.zeros((max(slots, 2 * self.capacity, 64), *self.row_shape), dtype=np.float32)
        grown[: self.capacity] = self.data
        self.data = grown

    def write(self, start: int, rows: np.ndarray) -> None:
        self.data[start:start + rows.shape[0]] = rows

    def move_slots(self, src: list[int], dst_start: int) -> None:
        if src:
            self.data[dst_start:dst_start + len(src)] = self.data[np.asarray(src)]

    def nbytes(self) -> int:
        return self.data.nbytes


def compute_precision(core, weight_format: str):
    """The CPU plugin's default precision (bf16 where the CPU has native AVX-512 BF16 or AMX, f32
    elsewhere: emulated bf16 is far slower than f32), except that "f32" weights ask for f32."""
    import openvino as ov
    import openvino.properties.hint as hints

    if weight_format != "f32" and core.get_property("CPU", hints.inference_precision) == ov.Type.bf16:
        return ov.Type.bf16
    return ov.Type.f32


# Key positions per sequence are multiples of this: bf16 GEMMs accumulate keys in pairs and blocks,
# so a key's position modulo the block decides which partial sum it joins.
KEY_ALIGN = 64


def _align(n: int) -> int:
    return -(-n // KEY_ALIGN) * KEY_ALIGN


class OpenVinoTransformer:
    """Runs RowBatch forwards (model.Transformer's interface) through one compiled graph."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], weight_format: str = "f32",
                 threads: int | None = None):
        import openvino as ov
        import openvino.properties as props
        import openvino.properties.hint as hints

        from .ov_graph import build_model

        self.config = config
        self.head_vocab = config.vocab_size
        self.weight_format = weight_format
        model = build_model(config, weights, weight_format)
        core = ov.Core()
        self.precision = compute_precision(core, weight_format)
        cfg = {hints.inference_precision: self.precision, hints.performance_mode: hints.PerformanceMode.LATENCY,
               props.num_streams: 1, hints.dynamic_quantization_group_size: 0,
               hints.enable_cpu_pinning: False}
        if threads:
            cfg[props.inference_num_threads] = int(threads)
        # Compiled from a saved copy: compiled from the in-memory model, the plugin's packed weights sat
        # beside the graph's constants in anonymous memory (0.5B in f32: 4.2 GB); from a file the
        # originals are a read-only mapping of it (page cache the kernel can drop), 1.7 GB anonymous.
        with tempfile.TemporaryDirectory(prefix="ov_engine_") as tmp:
            ov.save_model(model, f"{tmp}/model.xml", compress_to_fp16=False)
            del model
            self.compiled = core.compile_model(f"{tmp}/model.xml", "CPU", cfg)
        self.request = self.compiled.create_infer_request()

    def new_kv(self, capacity: int = 256) -> SlotKV:
        c = self.config
        return SlotKV(c.num_layers, c.num_kv_heads, c.head_dim, capacity)

    def forward(self, batch: list[RowBatch], exact: bool = False) -> list[torch.Tensor]:
        """Every row of every sequence in one inference. Each sequence's keys (its committed slots,
        then its new rows) are laid out at a position that is a multiple of KEY_ALIGN, so its slot j
        sits where it would sit alone (j mod KEY_ALIGN), and each row's mask admits only its own
        sequence's keys: a row's logits do not depend on its company (``exact`` needs nothing more)."""
        sizes = [rb.tokens.numel() for rb in batch]
        n = sum(sizes)
        pad = n == 1  # a one-row product takes a GEMV kernel: pair the row with a copy nobody sees
        if len(batch) == 1:
            past = batch[0].kv.data[: batch[0].start]
        else:
            past = np.concatenate([rb.kv.data[: rb.start] for rb in batch])
        p_total = past.shape[0]
        zero_slot = p_total + n + pad
        spans = [_align(rb.start + k) for rb, k in zip(batch, sizes)]
        length = sum(spans) + pad
        key_slots = np.full(length, zero_slot, dtype=np.int64)
        mask = np.full((n + pad, length), -np.inf, dtype=np.float32)
        rows, p_off, r_off, base = [], 0, 0, 0
        for rb, k, span in zip(batch, sizes, spans):
            key_slots[base:base + rb.start] = np.arange(p_off, p_off + rb.start)
            key_slots[base + rb.start:base + rb.start + k] = np.arange(p_total + r_off, p_total + r_off + k)
            if rb.visible is None:  # causal chunk: row i sees slots 0..start+i
                vis = np.tril(np.ones((k, rb.start + k), dtype=bool), rb.start)
            else:
                vis = rb.visible.numpy()
            mask[r_off:r_off + k, base:base + rb.start + k][vis] = 0.0
            rows.extend(range(r_off + rb.logits_from, r_off + k))
            p_off += rb.start
            r_off += k
            base += span
        tokens = torch.cat([rb.tokens for rb in batch]).numpy()
        positions = torch.cat([rb.positions for rb in batch]).numpy()
        if pad:  # the copy sees only its own key, in the last position
            tokens, positions = np.repeat(tokens, 2), np.repeat(positions, 2)
            key_slots[-1] = p_total + 1
            mask[1, -1] = 0.0
        inputs = {"tokens": tokens, "positions": positions, "past": np.ascontiguousarray(past),
                  "key_slots": key_slots, "mask": mask, "logit_rows": np.asarray(rows, dtype=np.int64)}
        self.request.infer(inputs, share_inputs=True)
        logits = torch.from_numpy(self.request.get_tensor("logits").data.copy())
        new_kv = self.request.get_tensor("new_kv").data
        r_off = 0
        for rb, k in zip(batch, sizes):
            rb.kv.reserve(rb.start + k)
            rb.kv.write(rb.start, new_kv[r_off:r_off + k])
            r_off += k
        return list(logits.split([k - rb.logits_from for rb, k in zip(batch, sizes)]))


class OpenVinoEngine(TorchEngine):
    """TorchEngine's sequence handling over OpenVinoTransformer, computing in f32. ``weights``: "f32"
    (the built engine's values exactly) or "int8" (weight-only, one scale per output channel: a
    quarter of the bytes, decode faster; see docs/cpu_engine.md). ``threads``: OpenVINO's threads."""

    def __init__(self, folder: str | os.PathLike, weights: str = "bf16", threads: int | None = None,
                 exact: bool = True, max_sequences: int = 64, max_len: int | None = None):
        folder = Path(folder)
        with open(folder / "config.json") as f:
            hf = json.load(f)
        meta = engine_meta(folder)
        self.config = ModelConfig.from_hf(hf)
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        tensors = load_file(str(folder / "model.safetensors"))
        self.model = OpenVinoTransformer(self.config, tensors, weights or "bf16", threads)
        del tensors
        _release_freed_memory()
        eos = hf.get("eos_token_id", [])
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) | set(meta.get("eos_token_ids", []))
        self.exact = exact
        self.max_sequences = max_sequences
        self.max_len = max_len or self.config.max_position
        self.sequences: dict[str, Sequence] = {}
        self.folder = folder
        self.timing: list[tuple[int, float]] = []

    def allows_threads(self, n: int) -> bool:
        return False  # OpenVINO's thread count is fixed when the graph compiles: split rounds only

    def _timed_forward(self, batch: list, exact: bool) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        out = self.model.forward(batch, exact=exact)
        self.timing.append((sum(len(b.tokens) for b in batch), time.perf_counter() - t0))
        return out
