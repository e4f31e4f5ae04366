"""The drafter's process: plain drafting (SD, neural backup) and speculation (SSD).

``speculate`` runs while the target verifies a draft D = d_1..d_K:
1. glue pass: extend the cache over prefix + D, giving the drafter's distribution at every depth;
2. candidates (k, t*) per depth (top-F_k, the drafted token excluded), see algorithm/spec_cache;
3. K tree steps decode every branch at once as rows over the shared prefix;
4. the branches stay here (the cache); the orchestrator gets their tokens only, and fetches q'
   rows of the one branch it uses, when sampling.
The glue pass computes only rows the drafter has not computed already: the next round's draft is
a cached branch (a hit) or the neural backup's draft, and the drafter ran a forward of every one of
its tokens but the last while drafting it. Those rows' KV is kept (a branch's is committed in
place of the draft it follows, without recomputing it) and their logits' top entries too (all
`candidates` reads), so on a hit or after a backup draft of K tokens the glue pass is one row, not
K + 1.
Every drafted token is sampled from q' (Saguaro with constant C over the depth's top-F set); those
q' rows are what the verifier receives, which keeps any C lossless.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..algorithm.sampling import probs_from_logits, round_generator, saguaro, sample
from ..algorithm.spec_cache import Branch, SpeculationCache, candidates
from ..engine.engine import ExtendCall, TorchEngine, TreeCall
from .protocol import DraftCall, DraftResult, FetchCall, SpeculateCall, SpeculateResult, attach_timing

DRAFT_STREAM, SPEC_STREAM = 2, 3
TOP_KEPT = 65  # a kept row's top logits: candidates reads the top F + 1 of a depth, F <= 64


@dataclass
class Computed:
    """Rows the drafter ran for a draft of ``prefix``: ``rows[j]``, the top logits after prefix +
    draft[:j], for j < len(rows). Their KV is committed in the engine, or, for a speculation
    branch, sits in the tree's scratch ``slots`` (rows of prefix[-1], draft[0], ...) until a
    glue pass commits it."""

    prefix: list[int]
    draft: list[int]
    rows: list[tuple[torch.Tensor, torch.Tensor]]  # (values, indices) of each row's top logits
    slots: list[int] | None = None


def _top(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top logits of a row (or of each row of a [rows, V] tensor): values, indices."""
    return torch.topk(logits, min(TOP_KEPT, logits.shape[-1]), dim=-1)


def _full(row: tuple[torch.Tensor, torch.Tensor], width: int) -> torch.Tensor:
    """A kept row as logits over the vocabulary: its top entries, -inf elsewhere (the ranking
    candidates reads, for greedy and sampled rows alike)."""
    out = torch.full((width,), float("-inf"))
    out[row[1]] = row[0].float()
    return out


def _pick(logits: torch.Tensor, params, top_f: int, c: float, g) -> tuple[int, torch.Tensor | None]:
    """One drafted token and the q' row it came from (None when greedy)."""
    if params.greedy:
        return int(logits.argmax()), None
    q = probs_from_logits(logits[None], params)[0]
    if c < 1.0 and top_f > 0:
        q = saguaro(q, torch.topk(q, min(top_f, q.numel())).indices, c)
    return sample(q, g), q


class DrafterWorker:
    def __init__(self, engine: TorchEngine):
        self.engine = engine
        self.caches: dict[str, SpeculationCache] = {}
        # per sequence, what the last draft or speculation computed: the draft's rows (key ()) or
        # each branch's (its outcome key); only until the sequence's next call here
        self.computed: dict[str, dict[tuple, Computed]] = {}

    # -- plain drafting: K autoregressive steps, all sequences batched per step -------------------
    def draft(self, calls: list[DraftCall]) -> list[DraftResult]:
        """K tokens per call; a call with k = 0 only brings the sequence's cache up to its tokens
        (a new request's prompt, sent while the target prefills it)."""
        warm = [ExtendCall(c.seq_id, list(c.tokens), 1) for c in calls if c.k == 0 and c.tokens]
        if warm:
            self.engine.extend(warm)
        seqs = [list(c.tokens) for c in calls]
        toks: list[list[int]] = [[] for _ in calls]
        rows: list[list[torch.Tensor]] = [[] for _ in calls]
        kept: list[list] = [[] for _ in calls]
        gens = [None if c.params.greedy else round_generator(c.seed, c.round, DRAFT_STREAM) for c in calls]
        for step in range(max((c.k for c in calls), default=0)):
            active = [i for i, c in enumerate(calls) if step < c.k]
            logits = self.engine.extend([ExtendCall(calls[i].seq_id, seqs[i], 1) for i in active])
            for i, lg in zip(active, logits):
                c = calls[i]
                f = c.fanout[step] if step < len(c.fanout) else 0
                kept[i].append(_top(lg[0]))
                t, q = _pick(lg[0], c.params, f, c.saguaro_c, gens[i])
                toks[i].append(t)
                seqs[i].append(t)
                if q is not None:
                    rows[i].append(q)
        for c, t, k in zip(calls, toks, kept):
            self.computed[c.seq_id] = {(): Computed(list(c.tokens), t, k)} if t else {}
        out = [DraftResult(t, torch.stack(r) if r else None) for t, r in zip(toks, rows)]
        return attach_timing(out, self.engine.take_timing())

    # -- speculation for every likely outcome of the round being verified -------------------------
    def speculate(self, calls: list[SpeculateCall]) -> list[SpeculateResult]:
        known = [self._reuse(c) for c in calls]
        new = self.engine.extend([ExtendCall(c.seq_id, c.tokens + c.draft, n_logits=len(c.draft) + 1 - len(rows))
                                  for c, rows in zip(calls, known)])
        width = self.engine.vocab_size
        depth_logits = [torch.cat([torch.stack([_full(r, width) for r in rows]), lg]) if rows else lg
                        for rows, lg in zip(known, new)]
        keys_per, roots = [], []
        for c, lg in zip(calls, depth_logits):
            probs = lg.float() if c.params.greedy else probs_from_logits(lg, c.params)
            keys = candidates(probs, c.draft, c.fanout)
            keys_per.append(keys)
            base = len(c.tokens)
            roots.append(TreeCall(c.seq_id, [t for _, t in keys], [base + k for k, _ in keys],
                                  [base + k for k, _ in keys], [-1] * len(keys)))
        gens = [None if c.params.greedy else round_generator(c.seed, c.round, SPEC_STREAM) for c in calls]
        drafted: list[list[list[int]]] = [[[] for _ in keys] for keys in keys_per]
        qrows: list[list[list[torch.Tensor]]] = [[[] for _ in keys] for keys in keys_per]
        kept = [[Computed([], [], [], []) for _ in keys] for keys in keys_per]
        step_calls = roots
        live = [i for i, keys in enumerate(keys_per) if keys]
        for step in range(max((c.k for c in calls), default=0)):
            live = [i for i in live if step < calls[i].k]
            if not live:
                break
            results = self.engine.tree([step_calls[i] for i in live])
            next_calls = list(step_calls)
            for i, (logits, slots) in zip(live, results):
                c = calls[i]
                f = c.fanout[step] if step < len(c.fanout) else 0
                new_toks, new_pos = [], []
                top = _top(logits)  # one call for the step's rows
                for b, row in enumerate(logits):
                    kept[i][b].rows.append((top[0][b], top[1][b]))
                    kept[i][b].slots.append(slots[b])
                    t, q = _pick(row, c.params, f, c.saguaro_c, gens[i])
                    drafted[i][b].append(t)
                    if q is not None:
                        qrows[i][b].append(q)
                    new_toks.append(t)
                    new_pos.append(step_calls[i].positions[b] + 1)
                next_calls[i] = TreeCall(c.seq_id, new_toks, new_pos, [0] * len(new_toks), slots)
            step_calls = next_calls
        out = []
        for c, keys, toks, qs, ks in zip(calls, keys_per, drafted, qrows, kept):
            cache = SpeculationCache()
            for key, t, q in zip(keys, toks, qs):
                cache.put(key, Branch(t, torch.stack(q) if q else None))
            self.caches[c.seq_id] = cache
            base = c.tokens + c.draft
            for (k, t_star), t, kb in zip(keys, toks, ks):  # a branch's rows follow the outcome it assumes
                kb.prefix, kb.draft = base[:len(c.tokens) + k] + [t_star], t
            self.computed[c.seq_id] = dict(zip(keys, ks))
            out.append(SpeculateResult({key: t for key, t in zip(keys, toks)}))
        return attach_timing(out, self.engine.take_timing())

    def _reuse(self, c: SpeculateCall) -> list:
        """The kept rows of this call's draft that its glue pass need not run again (at most K of
        its K + 1 depths: the last token's row was never run), with a branch's KV committed."""
        for done in self.computed.pop(c.seq_id, {}).values():
            if done.prefix != c.tokens:
                continue
            n = 0
            while n < min(len(done.rows), len(c.draft)) and (n == 0 or done.draft[n - 1] == c.draft[n - 1]):
                n += 1
            if n and done.slots is not None:
                cached = self.engine.cached_tokens(c.seq_id)
                if len(cached) < len(c.tokens) - 1 or cached[:len(c.tokens) - 1] != c.tokens[:-1]:
                    return []  # the engine no longer holds the speculation's prefix (evicted)
                self.engine.commit_branch(c.seq_id, len(c.tokens) - 1, done.slots[:n], [c.tokens[-1]] + c.draft[:n - 1])
            return done.rows[:n]
        return []

    def fetch(self, calls: list[FetchCall]) -> list[DraftResult]:
        out = []
        for c in calls:
            cache = self.caches.get(c.seq_id)
            branch = cache.lookup(c.key) if cache else None
            if branch is None:
                raise KeyError(f"no cached branch {c.key} for sequence {c.seq_id}")
            out.append(DraftResult(branch.tokens, branch.probs))
        return out

    def release(self, seq_id: str) -> None:
        self.caches.pop(seq_id, None)
        self.computed.pop(seq_id, None)
        self.engine.release(seq_id)
