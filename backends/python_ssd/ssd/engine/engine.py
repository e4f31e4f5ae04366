"""The torch engine: sequences, prefix reuse, rollback and tree rows over a lean forward.

Contract (shared with the TensorRT-LLM engine): a call names a sequence and the *full* token list it
should have; the engine reuses the longest cached prefix, rolls back anything after it, runs only the
new tokens and returns logits for the last positions asked for. Callers never manage KV state, so a
restarted engine or a lost cache costs time, never correctness.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from .embedding import MappedEmbedding
from .kv_cache import SequenceKV
from .meta import engine_meta
from .model import TILE, ModelConfig, RowBatch, Transformer, packing_available

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


def load_dtype(requested: str | None, stored: str | None, device: str = "cpu") -> torch.dtype:
    """The dtype an engine computes in: ``requested`` if given (not "auto"), else the one it was
    built in (``stored``, from ``engine_meta``; bf16 if it does not say), except that a bf16
    engine computes in float32 on a CPU without a native bf16 GEMM (oneDNN packs bf16 only with
    AVX-512 or AVX-NE-CONVERT). There bf16 is converted in the inner loop and the cost grows with
    every row: measured on an AVX2-only EPYC, one core, a
    4864 x 896 projection: bf16 0.96 ms at 1 row, 11.0 ms at 12; float32 (packed) 1.1 and 3.1 ms.
    A verify of K + 1 rows and a speculation tree are exactly those row counts. The weights stay the
    same values (float32 holds every bf16 value); only the arithmetic is wider."""
    if requested and requested != "auto":
        return DTYPES[requested]
    dtype = DTYPES[stored or "bfloat16"]
    if dtype == torch.bfloat16 and torch.device(device).type == "cpu" and not packing_available(torch.bfloat16):
        return torch.float32
    return dtype


@dataclass
class Sequence:
    kv: SequenceKV
    tokens: list[int] = field(default_factory=list)  # committed tokens, KV in slots 0..len-1
    scratch_end: int = 0  # first free slot after the committed tokens and the current tree rows
    last_used: float = 0.0
    tree_parent: dict[int, int] = field(default_factory=dict)  # tree slot -> parent slot (-1: root)
    tree_prefix: dict[int, int] = field(default_factory=dict)  # tree slot -> committed tokens it sees
    tree_context: torch.Tensor | None = None  # the tree's context ids (its committed tokens do not change)


@dataclass
class ExtendCall:
    seq_id: str
    tokens: list[int]
    n_logits: int = 1  # logits for the last n positions of `tokens`


@dataclass
class TreeCall:
    """New tree rows of one sequence. ``parents[i]`` is the index of row i's parent among the rows
    already in the tree (global row ids returned by earlier calls) or -1; ``prefix_lens[i]`` is how
    many committed tokens the row's root sees."""

    seq_id: str
    tokens: list[int]
    positions: list[int]
    prefix_lens: list[int]
    parents: list[int]


def device_context(device: torch.device):
    """The CUDA current-device scope of an engine on ``device`` (a no-op elsewhere). Kernels follow
    their tensors' device, but streams, CUDA graphs, graph memory pools and the cuBLAS workspace are
    made on the *current* device: without this scope an engine on cuda:4 would capture its graphs on
    cuda:0, whose replays never touch the engine's tensors."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _release_freed_memory() -> None:
    """Loading and packing free several GB; glibc keeps freed heap pages unless asked to return
    them (without this the target process stays at ~2x its real size)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def same_bits_at(engine, n: int) -> bool:
    """Whether ``engine``'s extend forwards give the same bits at ``n`` threads as at its own count:
    one of each shape the target runs (a prefill, one row, a verify, a batch of two sequences)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, engine.vocab_size, (48,), generator=g).tolist()
    a, b = "__threads_probe_a", "__threads_probe_b"

    def forwards() -> list[torch.Tensor]:
        out = [engine.extend([ExtendCall(a, ids[:40], 1)])[0], engine.extend([ExtendCall(a, ids[:41], 1)])[0],
               engine.extend([ExtendCall(a, ids[:46], 5)])[0]]
        out += engine.extend([ExtendCall(a, ids[:48], 2), ExtendCall(b, ids[5:12], 3)])
        engine.release(a, keep_prefix=False)  # the second pass must compute every row again
        engine.release(b, keep_prefix=False)
        return out

    try:
        ref = forwards()
        engine.set_threads(n)
        got = forwards()
    finally:
        engine.set_threads(engine.threads)
        engine.take_timing()
        engine.take_reused()
    return all(torch.equal(x, y) for x, y in zip(ref, got))


WEIGHT_QUANT = ("", "int8", "int8_full")


class TorchEngine:
    def __init__(self, folder: str | os.PathLike, dtype: str | None = None, threads: int | None = None,
                 exact: bool = True, max_sequences: int = 64, max_len: int | None = None,
                 head_vocab: int = 0, device: str = "cpu", weight_quant: str = ""):
        """``exact``: extend forwards are batch-invariant (model.invariant_tiles): a row's logits
        are bit-identical in any mode and any batch, in bf16 too. ``device``: "cpu" or a CUDA
        device; logits always come back on the CPU, where sampling and verification run.
        ``weight_quant``: "" (the weights in ``dtype``), "int8" (every projection but the MLP's
        down_proj in int8: model.Linear) or "int8_full" (down_proj too: faster, and for models
        whose down_proj takes it; see Transformer). CPU, drafters: it changes the logits, so
        never for an exact target."""
        if weight_quant not in WEIGHT_QUANT:
            raise ValueError(f"weight_quant must be one of {WEIGHT_QUANT}, got {weight_quant!r}")
        if weight_quant and exact:
            raise ValueError(f"weight_quant {weight_quant!r} changes the logits: it needs batch_invariant false "
                             "(a drafter)")
        if threads:
            torch.set_num_threads(int(threads))
        self.threads = torch.get_num_threads()  # the engine's own count; set_threads changes it per call
        self._thread_check: dict[int, bool] = {}
        folder = Path(folder)
        with open(folder / "config.json") as f:
            hf = json.load(f)
        meta = engine_meta(folder)
        self.config = ModelConfig.from_hf(hf)
        self.device = torch.device(device)
        self.dtype = load_dtype(dtype, meta.get("dtype"), device)
        weights = load_file(str(folder / "model.safetensors"))
        # on the CPU the embedding table stays in the file (embedding.py): half a GB less resident
        embedding = (MappedEmbedding(folder / "model.safetensors", "model.embed_tokens.weight", self.dtype)
                     if self.device.type == "cpu" else None)
        with self.on_device():
            self.model = Transformer(self.config, weights, self.dtype, head_vocab=head_vocab, device=self.device,
                                     int8=bool(weight_quant), int8_down=weight_quant == "int8_full",
                                     embedding=embedding)
        del weights
        _release_freed_memory()
        eos = hf.get("eos_token_id", [])
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) | set(meta.get("eos_token_ids", []))
        self.exact = exact
        self.max_sequences = max_sequences
        self.max_len = max_len or self.config.max_position
        self.sequences: dict[str, Sequence] = {}
        self.folder = folder
        self.timing: list[tuple[int, float]] = []

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def on_device(self):
        """Every CUDA call of the engine runs inside this scope (``device_context``)."""
        return device_context(self.device)

    def set_threads(self, n: int) -> None:
        torch.set_num_threads(n)

    def allows_threads(self, n: int) -> bool:
        """Whether forwards at ``n`` threads may replace forwards at the engine's own count: always
        for drafts (they need not be exact); for an exact engine, only if its rows come out with
        the same bits at both counts. oneDNN keeps each output's sum on one thread for some CPUs
        and kernels and splits it on others, so this is checked once per count on this machine,
        with a forward of each shape the target runs (a prefill, one row, a verify, a batch)."""
        if not self.exact or n == self.threads:
            return True
        if n not in self._thread_check:
            self._thread_check[n] = same_bits_at(self, n)
        return self._thread_check[n]

    def _timed_forward(self, batch: list, exact: bool) -> list[torch.Tensor]:
        with self.on_device():
            return self._forward_on_device(batch, exact)

    def _forward_on_device(self, batch: list, exact: bool) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        out = self.model.forward(batch, exact=exact)
        if self.device.type != "cpu":  # one copy per forward; it also waits for the GPU, so the timing is real
            out = list(torch.cat(out).cpu().split([o.shape[0] for o in out]))
        sizes = [len(b.tokens) for b in batch]
        # An exact forward with a prefill runs that prefill as one large GEMM, far cheaper per row
        # than the same number of decode rows in invariant tiles: it would teach the cost curve
        # the wrong price for the rows the policy compares (b and b*(K+1) decode rows), so skip it.
        # (Not reported as a prompt's forward either: other sequences' rows share it, and a round
        # would be charged nothing for them.)
        if not (exact and max(sizes) > TILE):
            self.timing.append((sum(sizes), time.perf_counter() - t0))
        return out

    def take_timing(self) -> list[tuple[int, float]]:
        """(rows, seconds) of every forward since the last call: what the mode policy learns from."""
        out, self.timing = self.timing, []
        return out

    def take_reused(self) -> dict[str, int]:
        """Prompt tokens new sequences found computed (LlamaCppEngine.take_reused): none here."""
        return {}

    # -- sequence bookkeeping -------------------------------------------------------------------
    def _seq(self, seq_id: str) -> Sequence:
        s = self.sequences.get(seq_id)
        if s is None:
            if len(self.sequences) >= self.max_sequences:  # evict the least recently used
                oldest = min(self.sequences, key=lambda k: self.sequences[k].last_used)
                del self.sequences[oldest]
            s = Sequence(kv=self.model.new_kv())
            self.sequences[seq_id] = s
        s.last_used = time.monotonic()
        return s

    def release(self, seq_id: str, keep_prefix: bool = True) -> None:
        """Drops the sequence and its KV (each sequence owns its tensors here, so nothing is kept
        for a later prefix, whatever ``keep_prefix`` says)."""
        self.sequences.pop(seq_id, None)

    def cached_tokens(self, seq_id: str) -> list[int]:
        s = self.sequences.get(seq_id)
        return list(s.tokens) if s else []

    def truncate(self, seq_id: str, length: int) -> None:
        s = self.sequences.get(seq_id)
        if s is not None:
            del s.tokens[length:]
            s.scratch_end = len(s.tokens)

    def _context_ids(self, tokens: list[int]) -> torch.Tensor | None:
        """The ids of ``tokens`` beyond a truncated output head (``head_vocab``): the forward
        computes their logits too (``Transformer._widen``). None with a full head."""
        head = self.model.head_vocab
        if head >= self.config.vocab_size:
            return None
        ids = sorted({t for t in tokens if t >= head})
        return torch.tensor(ids, dtype=torch.long) if ids else None

    # -- linear extension (prefill, decode, verify) ----------------------------------------------
    def extend(self, calls: list[ExtendCall]) -> list[torch.Tensor]:
        """Makes each sequence's cache cover ``tokens`` and returns [n_logits, V] float32 logits."""
        batch, wants = [], []
        for c in calls:
            if not c.tokens:
                raise ValueError("tokens must not be empty")
            if len(c.tokens) > self.max_len:
                raise ValueError(f"sequence length {len(c.tokens)} exceeds the engine's max_len {self.max_len}")
            s = self._seq(c.seq_id)
            n_logits = max(1, min(c.n_logits, len(c.tokens)))
            start = min(common_prefix(s.tokens, c.tokens), len(c.tokens) - n_logits)
            new = c.tokens[start:]
            batch.append(RowBatch(torch.tensor(new, dtype=torch.long),
                                  torch.arange(start, len(c.tokens), dtype=torch.long), s.kv, start, None,
                                  len(new) - n_logits, self._context_ids(c.tokens)))
            wants.append((s, c.tokens))
        out = self._timed_forward(batch, self.exact)
        for s, tokens in wants:
            s.tokens = list(tokens)
            s.scratch_end = len(tokens)
        return out

    # -- tree rows (speculation branches) ------------------------------------------------------------
    def tree(self, calls: list[TreeCall]) -> list[tuple[torch.Tensor, list[int]]]:
        """Runs branch rows in scratch slots. Returns per call the logits of its rows and the slots
        they occupy (row ids for later ``parents`` are these slots)."""
        batch, slots_out = [], []
        for c in calls:
            s = self._seq(c.seq_id)
            start, n = s.scratch_end, len(c.tokens)
            visible = torch.zeros(n, start + n, dtype=torch.bool)
            if start == len(s.tokens):  # a fresh tree
                s.tree_parent.clear()
                s.tree_prefix.clear()
                s.tree_context = self._context_ids(s.tokens)  # once per tree, not per step
            parent_of, root_prefix = s.tree_parent, s.tree_prefix
            for i in range(n):
                slot = start + i
                parent_of[slot] = c.parents[i]
                root_prefix[slot] = c.prefix_lens[i] if c.parents[i] < 0 else root_prefix[c.parents[i]]
                node = slot
                while node >= 0:
                    visible[i, node] = True
                    node = parent_of[node]
                visible[i, : root_prefix[slot]] = True
            batch.append(RowBatch(torch.tensor(c.tokens, dtype=torch.long),
                                  torch.tensor(c.positions, dtype=torch.long), s.kv, start, visible, 0,
                                  s.tree_context))
            slots_out.append(list(range(start, start + n)))
            s.scratch_end = start + n
        out = self._timed_forward(batch, False)
        return list(zip(out, slots_out))

    def commit_branch(self, seq_id: str, prefix_len: int, slots: list[int], tokens: list[int]) -> None:
        """Makes a tree branch (its rows in ``slots``, holding ``tokens``) part of the committed
        sequence after the first ``prefix_len`` tokens, without recomputing it."""
        s = self.sequences[seq_id]
        with self.on_device():
            s.kv.move_slots(slots, prefix_len)
        s.tokens = s.tokens[:prefix_len] + list(tokens)
        s.scratch_end = len(s.tokens)
