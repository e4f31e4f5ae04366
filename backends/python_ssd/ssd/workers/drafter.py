"""The drafter's process: plain drafting (SD, neural backup) and speculation (SSD).

``speculate`` runs while the target verifies a draft D = d_1..d_K:
1. glue pass: extend the cache over prefix + D, giving the drafter's distribution at every depth;
2. candidates (k, t*) per depth (top-F_k, the drafted token excluded), see algorithm/spec_cache;
3. K tree steps decode every branch at once as rows over the shared prefix;
4. the branches stay here (the cache); the orchestrator gets their tokens only, and fetches q'
   rows of the one branch it uses, when sampling.
Every drafted token is sampled from q' (Saguaro with constant C over the depth's top-F set); those
q' rows are what the verifier receives, which keeps any C lossless.
"""
from __future__ import annotations

import torch

from ..algorithm.sampling import probs_from_logits, round_generator, saguaro, sample
from ..algorithm.spec_cache import Branch, SpeculationCache, candidates
from ..engine.engine import ExtendCall, TorchEngine, TreeCall
from .protocol import DraftCall, DraftResult, FetchCall, SpeculateCall, SpeculateResult, attach_timing

DRAFT_STREAM, SPEC_STREAM = 2, 3


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
        gens = [None if c.params.greedy else round_generator(c.seed, c.round, DRAFT_STREAM) for c in calls]
        for step in range(max((c.k for c in calls), default=0)):
            active = [i for i, c in enumerate(calls) if step < c.k]
            logits = self.engine.extend([ExtendCall(calls[i].seq_id, seqs[i], 1) for i in active])
            for i, lg in zip(active, logits):
                c = calls[i]
                f = c.fanout[step] if step < len(c.fanout) else 0
                t, q = _pick(lg[0], c.params, f, c.saguaro_c, gens[i])
                toks[i].append(t)
                seqs[i].append(t)
                if q is not None:
                    rows[i].append(q)
        out = [DraftResult(t, torch.stack(r) if r else None) for t, r in zip(toks, rows)]
        return attach_timing(out, self.engine.take_timing())

    # -- speculation for every likely outcome of the round being verified -------------------------
    def speculate(self, calls: list[SpeculateCall]) -> list[SpeculateResult]:
        depth_logits = self.engine.extend(
            [ExtendCall(c.seq_id, c.tokens + c.draft, n_logits=len(c.draft) + 1) for c in calls])
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
                for b, row in enumerate(logits):
                    t, q = _pick(row, c.params, f, c.saguaro_c, gens[i])
                    drafted[i][b].append(t)
                    if q is not None:
                        qrows[i][b].append(q)
                    new_toks.append(t)
                    new_pos.append(step_calls[i].positions[b] + 1)
                next_calls[i] = TreeCall(c.seq_id, new_toks, new_pos, [0] * len(new_toks), slots)
            step_calls = next_calls
        out = []
        for c, keys, toks, qs in zip(calls, keys_per, drafted, qrows):
            cache = SpeculationCache()
            for key, t, q in zip(keys, toks, qs):
                cache.put(key, Branch(t, torch.stack(q) if q else None))
            self.caches[c.seq_id] = cache
            out.append(SpeculateResult({key: t for key, t in zip(keys, toks)}))
        return attach_timing(out, self.engine.take_timing())

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
        self.engine.release(seq_id)
