"""The scheduler's prior: each choice's tokens/s per sequence, predicted from the engines' costs.

With K draft tokens, B speculation branches per sequence and b sequences decoding together:

    AR        1 / T_t(b)
    SD        E_sd(K) / (K T_d(b) + T_t(b(K+1)))
    LOOKUP    E_l(K) / (T_lookup + T_t(b R_l(K)))   free drafts (free_draft.py): no drafter computes;
              E_l, R_l: the batch's expected tokens and verify rows a sequence at K, from each
              request's own lookup estimate (lookup_estimate.py); K is the lookup's own, up to
              the longest draft a verify keeps exact (LookupOutlook.k_max)
    AR@wide, SD@wide, LOOKUP@wide: the same with the engines' curves at every core (W_t, W_d); where a wide
              forward of that size was not measured, the split curve's shape (no gain assumed
              until measured: the bandit tries them)
    SSD(kind) [p E_hit(K) + (1-p) E_miss(K)] / (max(T_v, T_s) + (1 - p^b) T_backup(kind))
              T_v = T_t(b(K+1)),  T_s = T_d(b g) + K T_d(bB)   (verify and speculation overlap)
              g: the glue pass's rows a sequence, 1 where the drafter ran the draft's other rows
              already (a cached branch, the neural backup's draft; workers/drafter.py), K + 1
              after an n-gram draft: 1 for the neural backup, 1 + (1-p) K for the fast one

T_t, T_d: each engine's forward seconds by rows (StepCost). E(K) = 1 + a + ... + a^K from the
per-position acceptance a of each draft source (cache, neural, fast). p: the share of rounds that
start from a cache hit. A model-quality draft (cached or neural) is accepted far, so its outcome is
hard to guess (p_m); an n-gram draft is mostly rejected at once, which the widest fan-out covers
(p_f). With the fast backup a hit leads to a model-quality round and a miss to an n-gram round, so
its share of hit rounds is the chain's p_f / (1 - p_m + p_f). The whole batch waits for any row
that misses (1 - p^b), and the tree puts b B rows through the drafter per step: SSD's edge shrinks
as b grows, and the formulas say where SD and AR take over.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .estimators import Acceptance, Ema
from .lookup_estimate import LookupOutlook
from .rounds import Choice, RoundRecord


@dataclass
class StepCost:
    """One engine's seconds per forward as a function of rows: per-bucket running means joined
    piecewise-linearly, and past the largest measured bucket continued at the last segment's
    marginal cost per row. A forward is flat while it reads weights and linear once it computes (an
    exact 4-bit target computes from the first row on), which is all it takes to compare choices
    that put different rows through one engine. With one bucket measured, it is taken as flat up
    to ``flat_rows``.

    A bucket spans an eighth of an octave of rows: an engine's cost steps where its rows pass a
    kernel's tile (llama.cpp runs a call's rows in forwards of up to 32), and 32 and 33 rows must
    stay two points. A forward of fewer rows is priced at no more than any measured forward of more
    rows (the curve is the suffix minimum of its points): a price that a larger forward measured
    in the rounds undercuts is stale, whatever measured it. Measurements come as priors (the
    calibration's, before any round) or from rounds: a bucket's first round sample replaces its
    prior, then its mean runs over the first 1/alpha samples and moves by alpha after."""

    flat_rows: int = 32  # rows a forward may hold at one row's cost when nothing larger was measured
    alpha: float = 0.2
    # bucket -> [mean rows, mean seconds, rounds' samples (0: a prior)]
    buckets: dict[int, list[float]] = field(default_factory=dict)

    def observe(self, rows: int, seconds: float, prior: bool = False) -> None:
        if rows <= 0 or seconds <= 0:
            return
        key = round(8 * math.log2(rows))
        b = self.buckets.get(key)
        if b is None or (b[2] == 0 and not prior):  # new, or a prior a round now measures: replaced
            self.buckets[key] = [float(rows), float(seconds), 0 if prior else 1]
            return
        if not prior:
            b[2] += 1
        a = max(self.alpha, 1.0 / b[2]) if b[2] else self.alpha
        b[0] += a * (rows - b[0])
        b[1] += a * (seconds - b[1])

    def points(self) -> list[tuple[float, float]]:
        """(rows, seconds) of the buckets by rows, each no dearer than any point of more rows."""
        pts = sorted((b[0], b[1]) for b in self.buckets.values())
        for i in range(len(pts) - 2, -1, -1):
            pts[i] = (pts[i][0], min(pts[i][1], pts[i + 1][1]))
        return pts

    @property
    def known(self) -> bool:
        return bool(self.buckets)

    def __call__(self, rows: float) -> float:
        pts = self.points()
        if not pts or rows <= 0:
            return 0.0
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, s0), (r1, s1) in zip(pts, pts[1:]):
            if rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        r, s = pts[-1]
        if len(pts) > 1:  # past the largest measured forward: the last measured rows' marginal cost
            r0, s0 = pts[-2]
            return s + max(0.0, (s - s0) / (r - r0)) * (rows - r)
        return s * max(1.0, rows / max(r, self.flat_rows))

    def along(self, shape: "StepCost"):
        """This curve at its measured rows; elsewhere ``shape``'s curve times this curve's ratio to
        it at the nearest measured rows (between two, the ratio interpolated). The same engine on
        more cores keeps its cost's shape in rows: a wide curve that has seen only one-row steps
        prices a verify from the split curve's verify, not at one row's cost, and one measured at a
        few batch sizes keeps the split curve's steps between them (33 rows a forward dearer than
        32). Unmeasured: ``shape`` itself."""
        if not self.known:
            return shape
        if not shape.known:
            return self
        ratios = [(r, s / shape(r)) for r, s in self.points() if shape(r) > 0]

        def cost(rows: float) -> float:
            if rows <= ratios[0][0]:
                return shape(rows) * ratios[0][1]
            for (r0, k0), (r1, k1) in zip(ratios, ratios[1:]):
                if rows <= r1:
                    return shape(rows) * (k0 + (k1 - k0) * (rows - r0) / (r1 - r0))
            return shape(rows) * ratios[-1][1]
        return cost


@dataclass
class CostModel:
    tree_slack: float = 0.25  # share of a verify the speculation tree's extra branches may cost
    k_margin: float = 0.10  # a shorter K must predict this much more (per-round costs the formulas omit)
    target: StepCost = field(default_factory=StepCost)
    drafter: StepCost = field(default_factory=StepCost)
    target_wide: StepCost = field(default_factory=StepCost)  # the same engines on every core
    drafter_wide: StepCost = field(default_factory=StepCost)
    accept: dict = field(default_factory=lambda: {"cache": Acceptance(0.7), "neural": Acceptance(0.7),
                                                   "fast": Acceptance(0.25)})
    p_hit: dict = field(default_factory=lambda: {"model": Ema(0.6), "fast": Ema(0.8)})  # by verified draft
    t_fast: Ema = field(default_factory=lambda: Ema(0.002))  # seconds per n-gram backup call
    t_lookup: Ema = field(default_factory=lambda: Ema(0.0005))  # seconds per free draft (in the orchestrator)
    # the drafter's prefill seconds a row, split (False) and wide (True), where calibration measured it
    catch_up_row_seconds: dict = field(default_factory=dict)

    @property
    def known(self) -> bool:
        return self.target.known and self.drafter.known

    def rates(self, batch: int, k: int, budget: int, lookup: LookupOutlook | None = None) -> dict[str, float]:
        """Each choice's tokens/s per sequence (all 0 until both engines reported a forward);
        ``lookup``: the batch's free-draft outlook (None: no draft expected, an AR step's price)."""
        if not self.known:
            return {c: 0.0 for c in Choice}
        b, T_t, T_d = max(batch, 1), self.target, self.drafter
        t_v = T_t(b * (k + 1))
        e_sd = self.accept["neural"].tokens(k)
        e_hit = self.accept["cache"].tokens(k) if self.accept["cache"].count else e_sd
        out = {Choice.AR: 1 / T_t(b), Choice.SD: e_sd / (k * T_d(b) + t_v)}
        W_t, W_d = self.target_wide.along(T_t), self.drafter_wide.along(T_d)
        out[Choice.AR_WIDE] = 1 / W_t(b)
        out[Choice.SD_WIDE] = e_sd / (k * W_d(b) + W_t(b * (k + 1)))
        for c in (Choice.SSD_NEURAL, Choice.SSD_FAST):
            p = self.hit_share(c.backup)
            glue = 1.0 if c.backup == "neural" else 1.0 + (1 - p) * k
            t_s = T_d(b * glue) + k * T_d(b * budget)
            tokens = p * e_hit + (1 - p) * self.accept[c.backup].tokens(k)
            out[c] = tokens / (max(t_v, t_s) + (1 - p ** b) * self.backup_seconds(c.backup, b, k))
        o = lookup or LookupOutlook()
        out[Choice.LOOKUP] = self._lookup_best(T_t, b, o)[0]
        out[Choice.LOOKUP_WIDE] = self._lookup_best(W_t, b, o)[0]
        return out

    def lookup_k(self, batch: int, lookup: LookupOutlook, wide: bool) -> int:
        """The free drafts' K with the most predicted tokens/s on the layout's curve."""
        if not self.known:
            return lookup.k_max
        curve = self.target_wide.along(self.target) if wide else self.target
        return self._lookup_best(curve, max(batch, 1), lookup)[1]

    def _lookup_best(self, curve, b: int, o: LookupOutlook) -> tuple[float, int]:
        """(tokens/s, K) of the best free-draft K <= ``o.k_max`` (a shorter K must predict k_margin more)."""
        best = (0.0, 1)
        for k in range(max(o.k_max, 1), 0, -1):
            rate = o.tokens(k) / (self.t_lookup.value + curve(b * o.rows(k)))
            if rate > best[0] * (1 + self.k_margin):
                best = (rate, k)
        return best

    def rates_at(self, batch: int, k: int, budget: int, ks: dict | None,
                 lookup: LookupOutlook | None = None) -> dict[str, float]:
        """``rates`` with each choice at its own K (``ks``) and that K's tree budget; None: all at ``k``.
        Free drafts pick their own K (``lookup_k``)."""
        if ks is None:
            return self.rates(batch, k, budget, lookup)
        at = {kc: self.rates(batch, kc, self.tree_budget(batch, kc, budget), lookup) for kc in set(ks.values())}
        out = {c: at[kc][c] for c, kc in ks.items()}
        any_k = next(iter(at.values()))
        return {c: out.get(c, any_k[c]) for c in any_k}

    def best_k(self, batch: int, k_max: int, budget: int) -> dict[str, int]:
        """Each choice's K <= ``k_max`` with the most predicted tokens/s (with its tree budget).
        SSD's round lasts max(verify, speculation) and the speculation grows with K while a short
        verify costs what one row does, so SSD's best K can be shorter than SD's."""
        best: dict = {}
        for k in range(k_max, 0, -1):
            for c, r in self.rates(batch, k, self.tree_budget(batch, k, budget)).items():
                if c not in best or r > best[c][1] * (1 + self.k_margin):
                    best[c] = (k, r)
        return {c: k for c, (k, _) in best.items()}

    def tree_budget(self, batch: int, k: int, budget: int) -> int:
        """The largest B <= ``budget`` whose tree costs the drafter at most ``tree_slack`` of a
        verify more than the smallest tree (B = K + 1): free branches while the drafter reads
        weights, fewer once b B rows make it compute-bound. Fewer branches lower the hit rate,
        never the output."""
        floor = k + 1
        if budget <= floor or not self.known:
            return budget
        b = max(batch, 1)
        base, allowance = self.drafter(b * floor), self.tree_slack * self.target(b * (k + 1)) / k
        return next((B for B in range(budget, floor, -1) if self.drafter(b * B) - base <= allowance), floor)

    def catch_up_seconds(self, rows: int, wide: bool) -> float:
        """The drafter's seconds to take ``rows`` tokens it has not seen (prompts prefilled on a
        wide layout, tokens of AR rounds): its measured prefill seconds a row, or, unmeasured, one
        forward of that many rows on its curve."""
        if rows <= 0:
            return 0.0
        if wide in self.catch_up_row_seconds:
            return rows * self.catch_up_row_seconds[wide]
        return (self.drafter_wide.along(self.drafter) if wide else self.drafter)(rows)

    def drafter_alpha(self) -> float:
        """Per-position acceptance of the drafter's drafts: the speculation's once a cached draft
        was verified, SD's before (as ``rates`` reads them); the fan-out shape reads it too."""
        return (self.accept["cache"] if self.accept["cache"].count else self.accept["neural"]).alpha

    def hit_share(self, backup: str) -> float:
        p_m, p_f = self.p_hit["model"].value, self.p_hit["fast"].value
        return p_m if backup == "neural" else p_f / max(1.0 - p_m + p_f, 1e-9)

    def backup_seconds(self, backup: str, batch: int, k: int) -> float:
        """What a round that misses waits for: K drafter steps over the expected missing rows, or
        one n-gram lookup."""
        if backup == "fast":
            return self.t_fast.value
        return k * self.drafter(max(1.0, (1 - self.hit_share(backup)) * max(batch, 1)))

    def b_star(self, k: int, budget: int, max_batch: int = 256) -> int | None:
        """Smallest batch at which the fast backup predicts more than the neural one."""
        if not self.known:
            return None
        return next((b for b in range(1, max_batch + 1)
                     if (r := self.rates(b, k, budget))[Choice.SSD_FAST] > r[Choice.SSD_NEURAL]), None)

    def learn(self, rec: RoundRecord) -> None:
        """Engine costs, acceptance per draft source and hit rate per verified draft, from one round."""
        curves = (self.target_wide, self.drafter_wide) if rec.choice.wide else (self.target, self.drafter)
        for curve, timing in zip(curves, (rec.target_timing, rec.drafter_timing)):
            for rows, seconds in timing:
                curve.observe(rows, seconds)
        source = "neural" if rec.source == "draft" else rec.source
        if source in ("cache", "neural") and rec.drafted:
            self.accept[source].update(rec.tokens - 1, rec.drafted)
        # the n-gram lookup is scored on every round, whichever source drafted it
        self.accept["fast"].update(rec.ngram_accepted, rec.ngram_drafted)
        if rec.hit is not None:
            self.p_hit["fast" if rec.source == "fast" else "model"].update(float(rec.hit))
        if rec.source == "fast" and rec.draft_seconds > 0:
            self.t_fast.update(rec.draft_seconds)
        if rec.source == "lookup" and rec.draft_seconds > 0:
            self.t_lookup.update(rec.draft_seconds)
