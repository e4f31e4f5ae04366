"""Which decoding to run for the next round: SSD (neural or fast backup), SD or AR.

Every round each request asks the policy, with b = the number of sequences decoding now. The
policy predicts each choice's tokens per second per sequence from what it has measured: the
engines' forward time as a function of rows (cost_model.StepCost, reported by the engines), the
acceptance per round, the cache hit rate p and the fast backup's latency. With K draft tokens and
B speculation branches per sequence:

    AR        1 / T_t(b)
    SD        E_sd / (K T_d(b) + T_t(b(K+1)))
    SSD(kind) [p E_hit + (1-p) E_miss(kind)] / (max(T_v, T_s) + (1 - p^b) T_backup(kind))
              T_v = T_t(b(K+1)),  T_s = T_d(b(K+1)) + K T_d(bB)   (verify and speculation overlap)
              T_backup(neural) = K T_d(m), m = expected missing rows; T_backup(fast) = measured
              p = the share of rounds whose draft is a cache hit (below)

The hit rate depends on what the round verifies. A model-quality draft (a cached branch or the
neural backup's) is accepted far and wide, so its outcome (k, t*) is hard to guess: p_m. An n-gram
draft is mostly rejected at once (k = 0), which the speculation's widest fan-out covers: p_f, much
higher. With the neural backup every draft is model-quality, p = p_m. With the fast backup a hit
leads to a model-quality round and a miss to an n-gram round: a two-state chain whose share of
hit rounds is p = p_f / (1 - p_m + p_f). One hit rate for both (what SSD ran last) under-rated
whichever backup was not running: measured served at batch 1, the policy kept the neural backup
(p 0.52) at 3.6-4.1 tok/s where the fast one ran at 4.8-5.4 (p 0.61).

The whole batch waits for any row that misses (probability 1 - p^b), and the speculation tree puts
b B rows through the drafter per step, so SSD's edge shrinks as b grows: a fast backup first, then
plain SD (no tree), then AR (no draft rows at all) take over once they predict more tokens/s.
E_miss(fast) is measured for free: after each round we score what the n-gram lookup would have
proposed; until SSD has run, E_hit is taken as E_sd (a cached branch is what SD would have drafted).
The formulas count forward time only; what they miss (Python, BLS, sampling, two engines sharing
memory bandwidth) is learned as a calibration factor per choice and batch-size bucket (1, 2, 3-5,
6-11, 12-22, ...): measured tokens/s over predicted, from the rounds that choice ran at that batch
size, each round weighing one sample however many sequences report it (the nearest smaller bucket's
until a bucket has 2 rounds, else the factor over all sizes). The caller leaves out the first round
after a change of choice (it pays for the switch: the drafter catching up, no cached draft), and
keeps a request's first round and rounds that another request's prefill overlapped out of the
calibration (not out of the choice's own record: see ``observe_round``). So the formulas extrapolate
and the measurements decide. Statistics only come from running a choice, so one that has not run at
this batch size for a while gets a 3-round probe (``explore``, priced and spaced: ``_probe_due``).
A new choice must predict ``hysteresis`` more than the current one, and a choice stays at least
``min_dwell`` rounds: every switch into SSD costs a round without a cached draft, so flapping on
noise would cost more than it gains. Two rules keep stale or borrowed evidence from moving the batch: the step-aside
ladder (a choice that a later one in CHOICES beat, by more than the hysteresis, at the nearest
smaller batch size where it was measured is neither probed nor chosen at a larger one, until it has
a record there) and confirmation (a switch to a choice whose record here is ``stale_after`` rounds
old waits for a probe of it, reason "confirm", whose rounds outweigh the old ones: a machine that
slows down shows in the running choice's record alone). Decisions are made once per round of the
whole batch (``choose``), not per sequence; with ``adaptive_k`` each choice also gets its own K
(``best_k``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .cost_model import StepCost
from .estimators import Acceptance, Ema, Measured

CHOICES = ("ssd+neural", "ssd+fast", "sd", "ar")
MEASURED = 2  # rounds of calibration after which a choice counts as measured at a batch size


@dataclass
class Decision:
    mode: str  # ssd | sd | ar
    backup: str  # neural | fast (what drafts after a miss; meaningful for ssd)
    reason: str  # policy | forced | request | warmup | drafter down
    rates: dict[str, float] = field(default_factory=dict)  # predicted tokens/s per sequence
    ks: dict[str, int] = field(default_factory=dict)  # each choice's K this round (empty: the request's)

    @property
    def choice(self) -> str:
        return f"ssd+{self.backup}" if self.mode == "ssd" else self.mode


@dataclass
class ModePolicy:
    forced_backup: str | None = None  # "neural" | "fast" | None (auto)
    forced_mode: str | None = None  # one of CHOICES, or None (auto)
    hysteresis: float = 0.1
    min_dwell: int = 16
    # cache hit rate by the source of the draft being verified: "model" (cached / neural) or "fast"
    p_hit: dict = field(default_factory=lambda: {"model": Ema(0.6), "fast": Ema(0.8)})
    e_hit: Acceptance = field(default_factory=lambda: Acceptance(0.7))  # drafts from the speculation cache
    e_miss: dict = field(default_factory=lambda: {"neural": Acceptance(0.7), "fast": Acceptance(0.25)})
    t_fast: Ema = field(default_factory=lambda: Ema(0.002))  # seconds per n-gram backup call
    target: StepCost = field(default_factory=StepCost)
    drafter: StepCost = field(default_factory=StepCost)
    calib: dict = field(default_factory=dict)  # (choice, bucket or None for all sizes) -> Ema
    measured: dict = field(default_factory=dict)  # (choice, bucket) -> Measured
    current: str = "ssd+neural"
    explore_new: int = 8  # rounds between tries of a choice with < MEASURED rounds of calibration
    explore_every: int = 256  # ... and of one measured before
    explore_margin: float = 1.5
    explore_budget: float = 0.03  # share of the rounds that probes may give up (see _probe_due)
    probe_rounds: int = 3  # the first pays for the switch; 2 measure (MEASURED)
    stale_after: int = 32  # rounds after which a choice's record is re-measured before a switch to it
    tree_slack: float = 0.25  # share of a verify the speculation's extra branches may cost (tree_budget)
    k_margin: float = 0.03  # a shorter K must predict this much more (per-round costs the formulas omit)
    rounds: int = 0  # rounds of the batch so far (one per round, whatever the batch size)
    switched_at: int = -10**9  # round of the last switch (none yet: the first one may come at once)
    probe: str = ""  # the choice being probed, why (explore | confirm) and the round its probe ends at
    probe_reason: str = "explore"
    probe_until: int = 0
    last_run: dict = field(default_factory=dict)  # (choice, bucket) -> round it last ran at
    trace: object = None  # callable(dict): every decision and measurement, for offline study (SSD_POLICY_TRACE)
    _round: Decision | None = None  # this round's decision, shared by every sequence asking in it
    _asked: set = field(default_factory=set)  # sequences that asked in this round

    # -- predictions ------------------------------------------------------------------------------
    def model_rates(self, batch: int, k: int, budget: int) -> dict[str, float]:
        """The formulas above, forward time only (all 0 until both engines reported a forward)."""
        if not (self.target.known and self.drafter.known):
            return {c: 0.0 for c in CHOICES}
        b, T_t, T_d = max(batch, 1), self.target, self.drafter
        t_v = T_t(b * (k + 1))
        t_s = T_d(b * (k + 1)) + k * T_d(b * budget)
        e_sd = self.e_miss["neural"].tokens(k)
        e_hit = self.e_hit.tokens(k) if self.e_hit.count else e_sd
        out = {"ar": 1 / T_t(b), "sd": e_sd / (k * T_d(b) + t_v)}
        for kind in ("neural", "fast"):
            p = self.hit_share(kind)
            missing = max(1.0, (1 - p) * b)
            t_backup = k * T_d(missing) if kind == "neural" else self.t_fast.value
            num = p * e_hit + (1 - p) * self.e_miss[kind].tokens(k)
            out[f"ssd+{kind}"] = num / (max(t_v, t_s) + (1 - p ** b) * t_backup)
        return out

    def tree_budget(self, batch: int, k: int, budget: int) -> int:
        """This round's fan-out budget: the largest B <= ``budget`` whose speculation tree costs the
        drafter at most ``tree_slack`` of a verify more than the smallest tree (B = K + 1, one
        branch per depth). At batch 1 the drafter is bound by reading its weights and 8 branches
        cost what 5 do, so B stays; at batch 16 a tree of b B = 128 rows is compute-bound and
        takes several verifies, so B shrinks until the speculation fits again (as K does for the
        target's rows, ``SharedState.round_k``). Fewer branches lower the hit rate, never the
        output: every round is verified in full."""
        floor = k + 1
        if budget <= floor or not (self.target.known and self.drafter.known):
            return budget
        b = max(batch, 1)
        base, allowance = self.drafter(b * floor), self.tree_slack * self.target(b * (k + 1)) / k
        return next((B for B in range(budget, floor, -1) if self.drafter(b * B) - base <= allowance), floor)

    def hit_share(self, backup: str) -> float:
        """The share of SSD rounds that start from a cache hit with this backup (see the top)."""
        p_m, p_f = self.p_hit["model"].value, self.p_hit["fast"].value
        return p_m if backup == "neural" else p_f / max(1.0 - p_m + p_f, 1e-9)

    def observe_lookup(self, draft_source: str, hit: bool) -> None:
        """A round whose draft came from ``draft_source`` (cache | neural | fast) was verified and
        its outcome was (``hit``) or was not among the pre-drafted branches."""
        self.p_hit["fast" if draft_source == "fast" else "model"].update(float(hit))

    def _calib(self, choice: str, bucket: int | None) -> Ema:
        return self.calib.setdefault((choice, bucket), Ema(1.0, alpha=0.05))

    def factor(self, choice: str, batch: int) -> float:
        """The choice's calibration at this batch-size bucket; until it has 2 rounds, that of the
        nearest smaller bucket that has (batch 8's reality is closer to batch 16's than batch 1's,
        where SSD runs best), else the factor over all sizes."""
        here = _nearest(self.calib, choice, _bucket(batch), MEASURED)
        return here.value if here is not None else self._calib(choice, None).value

    def _measured_here(self, choice: str, bucket: int) -> "Measured | None":
        """The choice's own record at this bucket, once it has ``MEASURED`` rounds there."""
        m = self.measured.get((choice, bucket))
        return m if m is not None and m.count >= MEASURED else None

    def best_k(self, batch: int, k_max: int, budget: int) -> dict[str, int]:
        """Each choice's K for a round at this batch size: the K <= ``k_max`` whose formula predicts
        the most tokens/s, each K with its own fan-out budget (``tree_budget`` under ``budget``).
        The formula's calibration factor multiplies every K of a choice alike, so the formula alone
        ranks them. Why per choice: SSD's round lasts max(verify, speculation), and the speculation
        (glue pass + K tree steps) grows with K while a short verify costs what one row does; at
        batch 1 a K that SD drafts well leaves SSD waiting for its drafter (traced: speculation
        0.86 s against a 0.42-s verify at K = 4). A shorter K must win by ``k_margin``: each round
        also pays costs the formulas leave out (Python, IPC), which favour fewer, longer rounds."""
        if not (self.target.known and self.drafter.known):
            return {c: k_max for c in CHOICES}
        best: dict[str, tuple[int, float]] = {}
        for k in range(k_max, 0, -1):
            for c, r in self.model_rates(batch, k, self.tree_budget(batch, k, budget)).items():
                if c not in best or r > best[c][1] * (1 + self.k_margin):
                    best[c] = (k, r)
        return {c: k for c, (k, _) in best.items()}

    def _formula(self, batch: int, k: int, budget: int, ks: dict[str, int] | None) -> dict[str, float]:
        """``model_rates`` per choice at its own K (``ks``, each K with its tree budget under
        ``budget``), one evaluation per distinct K; None: every choice at ``k`` and ``budget``."""
        if ks is None:
            return self.model_rates(batch, k, budget)
        at = {kc: self.model_rates(batch, kc, self.tree_budget(batch, kc, budget)) for kc in set(ks.values()) | {k}}
        return {c: at[ks.get(c, k)][c] for c in CHOICES}

    def rates(self, batch: int, k: int, budget: int, ks: dict[str, int] | None = None) -> dict[str, float]:
        """Predicted tokens/s per sequence for each choice: what it measured at this batch-size
        bucket, once it has ``MEASURED`` rounds there; else the formula times its calibration.
        ``ks``: each choice's own K (``best_k``; ``budget`` is then the cap each K's tree budget
        is found under); None: every choice at ``k`` and ``budget``.
        (Formula times factor at a measured bucket let one choice's rounds move another's rate:
        SD rounds beside the drafter slowed the target's 8-row forwards, the cost curve rose, and
        AR's rate at 8 users fell from 3.3 to 2.2 tokens/s without a single AR round.)"""
        bk, out = _bucket(batch), {}
        for c, r in self._formula(batch, k, budget, ks).items():
            m = self._measured_here(c, bk)
            out[c] = m.rate if m is not None else r * self.factor(c, batch)
        return out

    def observe_round(self, choice: str, tokens: int, seconds: float, batch: int, k: int, budget: int,
                      clean: bool = True) -> None:
        """A round that ran ``choice`` produced ``tokens`` in ``seconds``: it goes into the choice's
        own record at this batch size, and, if ``clean`` (no other request's prefill overlapped it,
        not a request's first round), calibrates the formula's prediction. The record is what the
        choice delivers, joins included: kept out of it, they made SD at 8 users look 1.5x faster
        than its cells ran (traced: measured rounds covered 57% of SD's sequence-time, 77% of
        AR's), and the policy held SD where AR ran 20% faster. The formula prices forwards only,
        and a 1-2 s prefill stall in a factor would move it for every batch size."""
        if seconds <= 0 or not (self.target.known and self.drafter.known):
            return
        predicted = self.model_rates(batch, k, budget)[choice]
        if predicted > 0:
            ratio = min(max(tokens / seconds / predicted, 0.1), 10.0)
            # every sequence of the batch reports the same round: together they weigh one round
            # (one sample each let a single slow round at 16 users move the factor by 56%)
            w = 1.0 / max(batch, 1)
            if self.trace:
                self.trace({"ev": "round", "choice": choice, "batch": batch, "k": k, "budget": budget,
                            "tokens": tokens, "s": round(seconds, 4), "predicted": round(predicted, 3),
                            "clean": clean})
            self.measured.setdefault((choice, _bucket(batch)), Measured()).update(tokens, seconds, w, self.rounds)
            if clean:
                self._calib(choice, _bucket(batch)).update(ratio, w)
                self._calib(choice, None).update(ratio, w)

    def choose(self, batch: int, k: int, budget: int, allowed: tuple[str, ...] = CHOICES,
               seq: str | None = None, adaptive_k: bool = False) -> Decision:
        """The choice for the next round of sequence ``seq``, among ``allowed`` (a request may pin
        its mode). The choice is made once per round of the batch: a round starts when a sequence
        asks again (or when ``seq`` is None), and every sequence asking within it gets the same
        answer, so a switch or a probe moves the whole batch at once instead of mixing choices
        within a round (mixed rounds slow each other and mislead the calibration).
        ``adaptive_k``: ``k`` is the most a round may draft and ``budget`` the most branches;
        the decision carries each choice's K (``best_k``) and its rates are predicted at those."""
        if self.forced_mode and self.forced_mode in allowed:
            return _decision(self.forced_mode, "forced")
        if self.forced_backup:
            other = "ssd+neural" if self.forced_backup == "fast" else "ssd+fast"
            allowed = tuple(c for c in allowed if c != other) or allowed
        if len(allowed) == 1:
            return _decision(allowed[0], "request" if not self.forced_backup else "forced")
        if not (self.target.known and self.drafter.known):
            first = self.current if self.current in allowed else allowed[0]
            return _decision(first, "warmup")
        if seq is None or seq in self._asked or self._round is None:
            self._asked.clear()
            self._round = self._next_round(batch, k, budget, allowed, adaptive_k)
        self._asked.add(seq)
        d = self._round
        if d.choice not in allowed:  # a request with other options than the one that opened the round
            best = max(allowed, key=lambda c: d.rates[c])
            return _decision(best, "policy", d.rates, d.ks)
        return _decision(d.choice, d.reason, d.rates, d.ks)

    def _next_round(self, batch: int, k: int, budget: int, allowed: tuple[str, ...], adaptive_k: bool) -> Decision:
        self.rounds += 1
        bk = _bucket(batch)
        ks = self.best_k(batch, k, budget) if adaptive_k else None
        rates = self.rates(batch, k, budget, ks)
        d = self._next_decision(batch, bk, rates, allowed)
        d.ks = ks or {}
        if self.trace:
            self.trace({"ev": "decide", "round": self.rounds, "batch": batch, "k": k, "budget": budget,
                        "ks": d.ks,
                        "choice": d.choice, "reason": d.reason, "rates": {c: round(r, 3) for c, r in rates.items()},
                        "model": {c: round(r, 3) for c, r in self._formula(batch, k, budget, ks).items()},
                        "p": {s: round(e.value, 3) for s, e in self.p_hit.items()},
                        "alpha": {"hit": round(self.e_hit.alpha, 3), "neural": round(self.e_miss["neural"].alpha, 3),
                                  "fast": round(self.e_miss["fast"].alpha, 3)},
                        "T_t": [round(self.target(r), 4) for r in (batch, batch * (k + 1))],
                        "T_d": [round(self.drafter(r), 4) for r in (1, batch, batch * (k + 1), batch * budget)]})
        return d

    def _next_decision(self, batch: int, bk: int, rates: dict, allowed: tuple[str, ...]) -> Decision:
        if self.probe in allowed and self.rounds < self.probe_until:
            return self._ran(_decision(self.probe, self.probe_reason, rates), bk)
        allowed = tuple(c for c in allowed if not self._dominated(c, bk)) or allowed
        top = max(rates[c] for c in allowed)
        others = len(allowed) - 1
        stale = [c for c in allowed if self._probe_due(c, bk, rates[c], top, others)]
        if stale:
            return self._start_probe(min(stale, key=lambda c: self.last_run.get((c, bk), 0)), "explore", rates, bk)
        best = max(allowed, key=lambda c: rates[c])
        cur = self.current if self.current in allowed else best
        settled = self.rounds - self.switched_at >= self.min_dwell
        if cur != best and (cur not in allowed or settled and rates[best] > rates[cur] * (1 + self.hysteresis)):
            if cur in allowed and self._stale(best, bk):
                # its record is old and the current choice's is fresh: a machine that slowed down
                # shows in the running choice alone (traced at 8 users: AR's rounds went from 0.44
                # to 0.58 s, and the batch moved to SD for 16 rounds on a 60-s-old figure)
                self.measured[(best, bk)].forget()  # the probe's rounds are news, not noise
                return self._start_probe(best, "confirm", rates, bk)
            cur, self.switched_at = best, self.rounds
        self.current = cur
        return self._ran(_decision(cur, "policy", rates), bk)

    def _probe_due(self, choice: str, bucket: int, rate: float, top: float, others: int) -> bool:
        """Whether ``choice`` should be measured again at this batch size. Not while even
        ``explore_margin`` times its prediction stays below the best (unless it never ran at all:
        then once, at no price); otherwise after
        ``explore_new`` rounds (fewer than 2 measured rounds) or ``explore_every`` rounds, and no
        sooner than its price allows: a probe gives up ``probe_rounds * (1 - rate / top)`` rounds
        of the best choice (cheap when it is nearly as good, dear at a large batch where SD's
        verify rows cost several AR steps), and the probes of all ``others`` choices together may
        spend ``explore_budget`` of the rounds. A probe moves the whole batch for ``probe_rounds``
        rounds (a lone SSD round among SD rounds would stall the drafter for every sequence); the
        first pays for the switch, the others measure."""
        if choice == self.current:
            return False
        # never run at any batch size: its prediction is the formula alone, which can be far off
        # (measured after AR and SD runs: SSD predicted at 0.47x SD at batch 1, where it runs 1.3x),
        # so it gets one probe at the usual spacing whatever it predicts
        never = self._calib(choice, None).count == 0
        if rate * self.explore_margin < top and not never:
            return False
        measured = self._measured_here(choice, bucket) is not None
        since = self.rounds - self.last_run.get((choice, bucket), 0)
        # priced in time, not rounds: at 8 users an SSD probe round took 1.8 s against AR's 0.5 s,
        # and probes priced per round took 16% of a load-test cell
        mine, best = self._round_seconds(choice, bucket), self._round_seconds(self.current, bucket)
        longer = mine / best if mine and best else 1.0
        price = 0.0 if never else (self.probe_rounds * longer * max(0.0, 1.0 - rate / top) * others
                                   / self.explore_budget)
        return since >= max(self.explore_every if measured else self.explore_new, price)

    def _start_probe(self, choice: str, reason: str, rates: dict, bucket: int) -> Decision:
        self.probe, self.probe_reason, self.probe_until = choice, reason, self.rounds + self.probe_rounds
        return self._ran(_decision(choice, reason, rates), bucket)

    def _stale(self, choice: str, bucket: int) -> bool:
        """Measured at this bucket, but not for ``stale_after`` rounds."""
        m = self._measured_here(choice, bucket)
        return m is not None and self.rounds - m.last > self.stale_after

    def _dominated(self, choice: str, bucket: int) -> bool:
        """Whether a choice further down the step-aside ladder (CHOICES: ssd+neural, ssd+fast, sd,
        ar) beat this one, by more than ``hysteresis``, at the nearest smaller bucket where this
        one was measured, and this bucket has no record of its own. Each step of the ladder drafts
        fewer rows per token, so what was beaten at a smaller batch stays beaten at a larger one;
        such a choice is neither probed nor chosen here. (Traced: at 8 and 16 users the SSD
        choices' probes and the dwell after an optimistic first measurement cost 20-35% of a cell
        against AR, where SD had already beaten them at 4 users.)"""
        if self._measured_here(choice, bucket) is not None:
            return False
        b = _nearest_bucket(self.measured, choice, bucket - 1, MEASURED)
        if b is None:
            return False
        bar = self.measured[(choice, b)].rate * (1 + self.hysteresis)
        later = CHOICES[CHOICES.index(choice) + 1:]
        return any((m := self._measured_here(c, b)) is not None and m.rate > bar for c in later)

    def _round_seconds(self, choice: str, bucket: int) -> float | None:
        """Measured seconds per round of ``choice`` at this bucket or the nearest smaller one that
        has any (None: never measured; probes then count in rounds)."""
        m = _nearest(self.measured, choice, bucket, 0.0)
        return max(m.seconds.value, 1e-6) if m is not None else None

    def _ran(self, d: "Decision", bucket: int) -> "Decision":
        self.last_run[(d.choice, bucket)] = self.rounds
        return d

    def b_star(self, k: int, budget: int, max_batch: int = 256) -> int | None:
        """Smallest batch at which SSD with the fast backup beats SSD with the neural one."""
        if not (self.target.known and self.drafter.known):
            return None
        for b in range(1, max_batch + 1):
            r = self.rates(b, k, budget)
            if r["ssd+fast"] > r["ssd+neural"]:
                return b
        return None

    # -- learning -----------------------------------------------------------------------------------
    def observe_timing(self, engine: str, timing: list) -> None:
        curve = self.target if engine == "target" else self.drafter
        for rows, seconds in timing:
            curve.observe(rows, seconds)


def _bucket(batch: int) -> int:
    """Batch sizes 1 | 2 | 3-5 | 6-11 | 12-22 | ...: centred on powers of two, because load comes in
    them (16 users keep 15-16 sequences decoding; with floor(log2) buckets they straddled two, and
    each was probed and calibrated on its own: traced, 22% of a 16-user run's time went to probes)."""
    return round(math.log2(max(batch, 1)))


def _nearest_bucket(table: dict, choice: str, bucket: int, least: float) -> int | None:
    """This bucket or the nearest smaller one where ``table[(choice, b)]`` has a weight above 0 and
    at least ``least`` (batch 8's reality is closer to batch 16's than batch 1's); else None."""
    for b in range(bucket, -1, -1):
        entry = table.get((choice, b))
        if entry is not None and entry.count > 0 and entry.count >= least:
            return b
    return None


def _nearest(table: dict, choice: str, bucket: int, least: float):
    """``table[(choice, b)]`` at ``_nearest_bucket``; else None."""
    b = _nearest_bucket(table, choice, bucket, least)
    return None if b is None else table[(choice, b)]


def _decision(choice: str, reason: str, rates: dict | None = None, ks: dict | None = None) -> Decision:
    mode, _, backup = choice.partition("+")
    return Decision(mode, backup or "neural", reason, rates or {}, dict(ks or {}))
