"""The llama.cpp engine: the target's extend contract (prefix reuse, rollback, per-position logits,
batches of sequences, threads per call) on llama.cpp, reading the GGUF file the engine was built from
(its 4-bit weights as published).

Why these settings (docs/cpu_engine.md has the measurements):
- A row's logits must not depend on how many rows share its forward (a verify of K + 1 rows must
  give the bits of K + 1 one-row steps). llama.cpp picks its kernel by the number of rows in a
  product: for the repacked Q4_K weights (interleaved for SIMD) a GEMV for fewer than 4 rows and a
  4-row GEMM above, which give a row the same bits once the GEMV adds its sums in the GEMM's order
  (tools/llamacpp/patches); for the other K-quants a row-by-row dot product below 8 rows and tiled
  kernels from 8 on, which give a row the same bits for Q6_K once the dot product sums as the tiled
  kernel does (the second patch). So the tiled kernels stay on for a file whose multi-row K-quants
  are Q4_K and Q6_K (a Q4_K_M file) and are turned off for any other (GGML_CPU_TILED_MM, set before
  the library's first product unless the environment sets it). It runs the rows whose logits it
  returns (every decode and verify row, hence every generated token) in forwards of at most
  `logit_rows` rows, all sequences' together: the largest of 16, 7, 3, 1 for which load-time
  checks (llamacpp_checks.py) find the rows' logits equal to one-row forwards in forwards of every
  size up to it, of one sequence and of several (16 with the patched build, which refuses to load
  with less; 7 with the tiled kernels on and unpatched; 3 on an unpatched build). Another check
  prefills a history in one forward and steps it one row at a time: if the two differ (kernels
  this build does not make agree), the engine refuses to load rather than decode inexactly. The
  same bits at 1 and 2 threads: threads split a product's outputs, never a sum.
- A call's context rows (a prompt's, before its last token) run in forwards of up to N_BATCH rows,
  the prompts of a call packed together as logit rows are, where the GEMM kernels make a prefill
  several times cheaper a row. A row's bits do not depend on its forward (the same kernels), so a
  prompt prefilled with others, or its history recomputed in one prefill, gives the same bits, and
  a prompt's logit rows end its last prefill forward instead of taking a forward of their own
  (a one-row forward reads every weight: 30-40 ms a request at 2 threads).
- The library is built without the llamafile GEMMs (tools/llamacpp/install_llama_cpp_python.sh).
- Attention sums over a sequence's KV cells in SIMD lanes picked by the cell's index, so a sequence
  must occupy the same cells whatever else is cached: one KV stream per sequence (kv_unified off),
  allocated once: max_sequences x (max_len + DRAFT_HEADROOM) x the model's KV bytes per token.
- Flash attention off: its CPU kernel takes a tiled path for larger batches.
- A released sequence's stream keeps its KV until another sequence needs the stream, and a new
  sequence takes the free stream whose kept tokens share the longest prefix with its own (llama.cpp's
  `cache_prompt`, vLLM's prefix caching): a chat template's system prompt, or a conversation's
  earlier turns, are not computed again. Exact for the reasons above: the kept rows have the bits a
  new prefill would give them, in the cells it would put them in.
"""
from __future__ import annotations

import ctypes
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .engine import ExtendCall, common_prefix, same_bits_at
from .llamacpp_checks import choose_logit_rows, prefill_keeps_bits
from .meta import engine_meta, gguf_tensor_types
from .prefix_store import PrefixStore

GGUF_NAME = "model.gguf"
N_BATCH = 512  # context rows per llama_decode: longer prefills run in chunks
DRAFT_HEADROOM = 64  # cells past max_len: a verify's draft rows may run past the longest sequence


def pack_forwards(per_sequence: list[list[tuple]], limit: int) -> list[list[tuple]]:
    """Groups sequences' logit rows into forwards llama.cpp runs as one graph: at most ``limit`` rows,
    the same number from each sequence, the sequences' streams consecutive and ascending. llama.cpp
    splits any other batch across KV streams into one forward per run of such sequences, so
    three one-row sequences on streams 4, 9 and 2 would cost three forwards instead of one.
    Each sequence's rows keep their order; rows are (call index, slot, position, token, logits?)."""
    queues = sorted((list(q) for q in per_sequence if q), key=lambda q: q[0][1].index)
    forwards = []
    while queues:
        best = None
        for r in range(1, min(limit, len(queues[0])) + 1):  # r rows from each sequence of a run
            run = [queues[0]]
            for q in queues[1:]:
                if (len(run) + 1) * r > limit or q[0][1].index != run[-1][0][1].index + 1 or len(q) < r:
                    break
                run.append(q)
            if best is None or len(run) * r > best[0] * best[1]:
                best = (len(run), r)
        n, r = best
        forwards.append([row for q in queues[:n] for row in q[:r]])
        for q in queues[:n]:
            del q[:r]
        queues = [q for q in queues if q]
    return forwards


# llama.cpp's tiled kernels (ggml-cpu/tiled) take the products of 8 rows and more of these types when
# their weights are not repacked; the patched build gives a row the same bits in them as in the
# one-row kernels only for Q6_K (Q4_K weights are repacked and take the patched GEMV / GEMM instead)
TILED_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
               "IQ3_S", "IQ1_S", "IQ1_M"}
TILED_EXACT_TYPES = {"Q4_K", "Q6_K"}


def tiled_kernels_keep_bits(types) -> bool:
    """Whether every weight type (``types``, GGUF type names) that llama.cpp's tiled kernels may take
    is one whose one-row kernel the patched build makes agree with them."""
    return not (set(types) & TILED_TYPES) - TILED_EXACT_TYPES


def _llama(folder: Path):
    # Read by llama.cpp once, at its first product (so the first engine of a process decides). On
    # the 1.5B Q4_K_M target the tiled kernels make a 16-sequence step about 25% cheaper
    # (docs/cpu_engine.md).
    if "GGML_CPU_TILED_MM" not in os.environ:
        os.environ["GGML_CPU_TILED_MM"] = "1" if tiled_kernels_keep_bits(gguf_tensor_types(folder, GGUF_NAME)) else "0"
    import llama_cpp
    from llama_cpp import _logger

    _logger.set_verbose(os.environ.get("SSD_LLAMA_VERBOSE", "") == "1")
    return llama_cpp


@dataclass
class Slot:
    index: int  # the llama.cpp sequence id (its KV stream)
    tokens: list[int] = field(default_factory=list)  # tokens whose KV the stream holds
    last_used: float = 0.0


class LlamaCppEngine:
    def __init__(self, folder: str | os.PathLike, threads: int | None = None, exact: bool = True,
                 max_sequences: int = 16, max_len: int = 4096, cache_ram_mb: float = 0):
        folder = Path(folder)
        gguf = folder / GGUF_NAME
        if not gguf.exists():
            raise FileNotFoundError(f"{gguf}: a llamacpp engine needs the GGUF file (build_engines.sh with "
                                    "`runtime: llamacpp` links it there)")
        L = self.L = _llama(folder)
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = True  # repacked weights: a faster one-row GEMV and multi-row GEMM
        # Read, not memory-mapped: the repacked tensors are copies, and a mapping keeps the file's pages
        # of them resident beside the copies (0.6 GB of the 1.5B target's RSS).
        mp.load_mode = L.LLAMA_LOAD_MODE_NONE
        self.model = L.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.vocab_size = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.threads = int(threads or 1)
        self.max_sequences, self.max_len = int(max_sequences), int(max_len)
        cp = L.llama_context_default_params()
        cp.n_ctx = self.max_sequences * (self.max_len + DRAFT_HEADROOM)
        cp.n_batch = cp.n_ubatch = N_BATCH
        cp.n_seq_max = self.max_sequences
        cp.kv_unified = False
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {self.max_sequences} x {self.max_len} "
                               "tokens (max_sequences x max_len): lower them")
        self.memory = L.llama_get_memory(self.ctx)
        self.batch = L.llama_batch_init(N_BATCH, 0, 1)
        with open(folder / "config.json") as f:
            hf = json.load(f)
        if hf.get("vocab_size", self.vocab_size) != self.vocab_size:  # the drafter's logits have the config's width
            raise ValueError(f"{gguf}: {self.vocab_size} tokens, but config.json says vocab_size {hf['vocab_size']}")
        eos = hf.get("eos_token_id", [])
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) | set(engine_meta(folder).get("eos_token_ids", []))
        self.exact = exact
        self.folder = folder
        self.sequences: dict[str, Slot] = {}
        self.free = {i: [] for i in range(self.max_sequences)}  # free stream -> the tokens its KV still holds
        self.reused: dict[str, int] = {}  # new sequences' prompt tokens found in a free stream (take_reused)
        self.store = PrefixStore(int(cache_ram_mb * 2**20))  # kept prefixes past the streams (prefix_store.py)
        self.timing: list[tuple[int, float]] = []
        self._thread_check: dict[int, bool] = {}
        self.logit_rows = N_BATCH
        if exact:
            if not prefill_keeps_bits(self):
                raise RuntimeError(
                    f"{gguf}: a history prefilled in one forward gets other logits than one-row steps give it "
                    f"(llama.cpp's multi-row kernels for this file's weight types round differently on this CPU, "
                    f"GGML_CPU_TILED_MM={os.environ.get('GGML_CPU_TILED_MM')}): rebuild llama-cpp-python with the "
                    "patches (make venv) or set GGML_CPU_TILED_MM=0")
            self.logit_rows = choose_logit_rows(self)

    # -- threads -------------------------------------------------------------------------------------
    def set_threads(self, n: int) -> None:
        self.L.llama_set_n_threads(self.ctx, n, n)

    def allows_threads(self, n: int) -> bool:
        """As TorchEngine.allows_threads: drafts always; an exact engine only if its rows keep their
        bits at ``n`` threads (llama.cpp splits a product's outputs, never a sum, over threads, but
        this is checked, once per count, rather than assumed)."""
        if not self.exact or n == self.threads:
            return True
        if n not in self._thread_check:
            self._thread_check[n] = same_bits_at(self, n)
        return self._thread_check[n]

    # -- sequences -----------------------------------------------------------------------------------
    def _slot(self, seq_id: str, keep: set[str], tokens: list[int]) -> Slot:
        s = self.sequences.get(seq_id)
        if s is None:
            if not self.free:  # evict the least recently used sequence not in this call
                candidates = [k for k in self.sequences if k not in keep]
                if not candidates:
                    raise RuntimeError(f"more than max_sequences ({self.max_sequences}) sequences in one call")
                self.release(min(candidates, key=lambda k: self.sequences[k].last_used))
            # the longest kept prefix; on a tie the lowest stream, so the live streams stay consecutive
            # (pack_forwards)
            index = max(self.free, key=lambda i: (common_prefix(self.free[i], tokens), -i))
            s = Slot(index, self._from_store(index, self.free.pop(index), tokens))
            self.sequences[seq_id] = s
        s.last_used = time.monotonic()
        return s

    def _from_store(self, index: int, kept: list[int], tokens: list[int]) -> list[int]:
        """The tokens stream ``index`` holds for a new sequence of ``tokens``: its kept tokens are
        saved to the store before they are overwritten, and a stored prefix longer than theirs is
        written back into the stream."""
        if not self.store.budget:
            return kept
        have = common_prefix(kept, tokens)
        if len(kept) > have and not self.store.covers(kept):
            size = self.L.llama_state_seq_get_size(self.ctx, index)
            buf = (ctypes.c_uint8 * size)()
            if self.L.llama_state_seq_get_data(self.ctx, buf, size, index) == size:
                self.store.put(kept, buf)  # the buffer itself: no copy on the way in or back
        n, key = self.store.longest(tokens)
        if n <= have:
            return kept
        data = self.store.entries[key]
        if self.L.llama_state_seq_set_data(self.ctx, data, len(data), index):
            return list(key)
        self.L.llama_memory_seq_rm(self.memory, index, 0, -1)  # a failed restore leaves nothing usable
        return []

    def release(self, seq_id: str, keep_prefix: bool = True) -> None:
        """Frees the sequence's stream; its KV stays for a later sequence with the same prefix unless
        ``keep_prefix`` is False (checks that must compute every row)."""
        s = self.sequences.pop(seq_id, None)
        if s is not None:
            if not keep_prefix:
                self.L.llama_memory_seq_rm(self.memory, s.index, 0, -1)
            self.free[s.index] = s.tokens if keep_prefix else []

    def take_reused(self) -> dict[str, int]:
        """Per sequence that took a stream since the last call: its leading tokens whose KV the
        stream already held (they are not computed)."""
        out, self.reused = self.reused, {}
        return out

    def cached_tokens(self, seq_id: str) -> list[int]:
        s = self.sequences.get(seq_id)
        return list(s.tokens) if s else []

    def truncate(self, seq_id: str, length: int) -> None:
        s = self.sequences.get(seq_id)
        if s is not None and length < len(s.tokens):
            self.L.llama_memory_seq_rm(self.memory, s.index, length, -1)
            del s.tokens[length:]

    def take_timing(self) -> list[tuple[int, float]]:
        out, self.timing = self.timing, []
        return out

    # -- forwards ------------------------------------------------------------------------------------
    def extend(self, calls: list[ExtendCall]) -> list[torch.Tensor]:
        """Makes each sequence's cache cover ``tokens``; returns [n_logits, V] float32 logits each."""
        if len(calls) > self.max_sequences:  # more sequences than KV streams: in groups
            return [x for i in range(0, len(calls), self.max_sequences)
                    for x in self.extend(calls[i:i + self.max_sequences])]
        keep = {c.seq_id for c in calls}
        context, logit_rows = [], []  # per sequence: (call index, slot, position, token, logits?)
        for i, c in enumerate(calls):
            if not c.tokens:
                raise ValueError("tokens must not be empty")
            if len(c.tokens) > self.max_len + DRAFT_HEADROOM:
                raise ValueError(f"sequence length {len(c.tokens)} exceeds the engine's max_len {self.max_len} "
                                 f"(+ {DRAFT_HEADROOM} draft rows)")
            new = c.seq_id not in self.sequences
            s = self._slot(c.seq_id, keep, c.tokens)
            n_logits = max(1, min(c.n_logits, len(c.tokens)))
            first_logit = len(c.tokens) - n_logits
            start = min(common_prefix(s.tokens, c.tokens), first_logit)
            if new:
                self.reused[c.seq_id] = start
            self.L.llama_memory_seq_rm(self.memory, s.index, start, -1)
            s.tokens = list(c.tokens[:start])
            if start < first_logit:  # a prompt: its logit rows end its last context forward (no one-row forward of their own)
                context.append([(i, s, p, c.tokens[p], p >= first_logit) for p in range(start, len(c.tokens))])
            else:
                logit_rows.append([(i, s, p, c.tokens[p], True) for p in range(first_logit, len(c.tokens))])
        out: list[list[np.ndarray]] = [[] for _ in calls]
        t0 = time.perf_counter()
        for rows in pack_forwards(context, N_BATCH):  # prompts arriving together share forwards
            self._decode(rows, out)
        if context:  # prompts: 0 rows, which the cost curves skip (workers/target.py reports them apart)
            self.timing.append((0, time.perf_counter() - t0))
        if logit_rows:
            t0 = time.perf_counter()
            for rows in pack_forwards(logit_rows, self.logit_rows):
                self._decode(rows, out)
            # the cost curve prices a call's decode and verify rows; prefills take other kernels
            self.timing.append((sum(map(len, logit_rows)), time.perf_counter() - t0))
        for c in calls:
            self.sequences[c.seq_id].tokens = list(c.tokens)
        return [torch.from_numpy(np.stack(o)) for o in out]

    def _decode(self, rows: list, out: list[list[np.ndarray]]) -> None:
        b, L = self.batch, self.L
        for j, (_, s, pos, tok, logits) in enumerate(rows):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = tok, pos, 1, int(logits)
            b.seq_id[j][0] = s.index
        b.n_tokens = len(rows)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc}) on {len(rows)} rows")
        for j, (i, *_rest, logits) in enumerate(rows):
            if logits:
                out[i].append(np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, j), shape=(self.vocab_size,)).copy())

    def __del__(self):
        try:
            self.L.llama_batch_free(self.batch)
            self.L.llama_free(self.ctx)
            self.L.llama_model_free(self.model)
        except Exception:
            pass
