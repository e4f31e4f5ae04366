"""Which decoding to run for the next round: SSD (neural or fast backup), SD or AR.

Every round each request asks the policy, with b = the number of sequences decoding now. The
speedup model (speedup_model.py) predicts each choice's tokens per second per sequence from what
was measured: the engines' forward time as a function of rows, the acceptance per round, the cache
hit rate and the fast backup's latency. As b grows, SSD's edge shrinks: a fast backup first, then
plain SD (no tree), then AR (no draft rows at all) take over once they predict more tokens/s.
The formulas count forward time only; what they miss (Python, BLS, sampling, two engines sharing
memory bandwidth) is learned as a calibration factor per choice and batch-size bucket (1, 2, 3-5,
6-11, 12-22, ...): measured tokens/s over predicted, from the rounds that choice ran at that batch
size, each round weighing one sample however many sequences report it (the nearest smaller bucket's
until a bucket has 2 rounds, else the factor over all sizes). The caller leaves out the first round
after a change of choice (it pays for the switch: the drafter catching up, no cached draft), and
keeps a request's first round and rounds that another request's prefill overlapped out of the
calibration (not out of the choice's own record: see ``observe_round``). So the formulas extrapolate
and the measurements decide. The two SSD choices run the same rounds on a cache hit and differ only
on a miss, so their records are kept by draft source too and rated from those parts (ssd_parts.py).
Statistics only come from running a choice, so one that has not run at this batch size for a while
gets a 3-round probe (``explore``, priced and spaced: ``_probe_due``).
A new choice must predict ``hysteresis`` more than the current one, and a choice stays at least
``min_dwell`` rounds: every switch into SSD costs a round without a cached draft, so flapping on
noise would cost more than it gains. The dwell ends early when both have records here and the new
one's is ``explore_margin`` times the current one's (``_outran``), and when no round was decided
for ``dwell_idle_s`` (no batch left to flap). Two rules keep stale or borrowed evidence from moving
the batch: the step-aside ladder (a choice that a later one in CHOICES beat, by more than the
hysteresis, at the nearest smaller batch size where it was measured is neither probed nor chosen
at a larger one, until it has a record there) and confirmation (a switch to a choice whose record
here is ``stale_after`` rounds old waits for a probe of it, reason "confirm", whose rounds
outweigh the old ones: a machine that slows down shows in the running choice's record alone).
Decisions are made once per round of the whole batch (``choose``), not per sequence; with
``adaptive_k`` each choice also gets its own K (``SpeedupModel.best_k``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

from .estimators import MEASURED, Ema, Measured
from .speedup_model import CHOICES, SpeedupModel, free_switch
from .ssd_parts import SsdParts, other_ssd


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
    dwell_idle_s: float = 10.0  # a gap this long between decided rounds ends the dwell (see _next_round)
    clock: Callable[[], float] = time.monotonic
    decided_at: float | None = None  # clock() at the last decided round
    model: SpeedupModel = field(default_factory=SpeedupModel)  # the predictions and what they learn from
    calib: dict = field(default_factory=dict)  # (choice, bucket or None for all sizes) -> Ema
    measured: dict = field(default_factory=dict)  # (choice, bucket) -> Measured
    parts: SsdParts = field(default_factory=SsdParts)  # the SSD choices' records by draft source
    current: str = "ssd+neural"
    explore_new: int = 8  # rounds between tries of a choice with < MEASURED rounds of calibration
    explore_every: int = 256  # ... and of one measured before
    explore_margin: float = 1.5
    explore_budget: float = 0.03  # share of the rounds that probes may give up (see _probe_due)
    probe_rounds: int = 3  # the first pays for the switch; 2 measure (MEASURED)
    stale_after: int = 32  # rounds after which a choice's record is re-measured before a switch to it
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
    def _calib(self, choice: str, bucket: int | None) -> Ema:
        return self.calib.setdefault((choice, bucket), Ema(1.0, alpha=0.05))

    def factor(self, choice: str, batch: int) -> float:
        """The choice's calibration at this batch-size bucket; until it has 2 rounds, that of the
        nearest smaller bucket that has (batch 8's reality is closer to batch 16's than batch 1's,
        where SSD runs best), else the factor over all sizes. An SSD choice never calibrated takes
        the other SSD choice's: their formulas share all but the miss term (traced: a warm-up
        prompt the drafter drafted badly took SSD's factor to 0.6, and the never-run fast backup,
        at 1.0, looked 50% faster and took the batch on no evidence)."""
        if choice.startswith("ssd") and self._calib(choice, None).count == 0:
            choice = other_ssd(choice)
        here = _nearest(self.calib, choice, _bucket(batch), MEASURED)
        return here.value if here is not None else self._calib(choice, None).value

    def _measured_here(self, choice: str, bucket: int) -> "Measured | None":
        """The choice's own record at this bucket, once it has ``MEASURED`` rounds there."""
        m = self.measured.get((choice, bucket))
        return m if m is not None and m.count >= MEASURED else None

    def rates(self, batch: int, k: int, budget: int, ks: dict[str, int] | None = None) -> dict[str, float]:
        """Predicted tokens/s per sequence for each choice: what it measured at this batch-size
        bucket, once it has ``MEASURED`` rounds there; else the formula times its calibration.
        ``ks``: each choice's own K (``best_k``; ``budget`` is then the cap each K's tree budget
        is found under); None: every choice at ``k`` and ``budget``.
        (Formula times factor at a measured bucket let one choice's rounds move another's rate:
        SD rounds beside the drafter slowed the target's 8-row forwards, the cost curve rose, and
        AR's rate at 8 users fell from 3.3 to 2.2 tokens/s without a single AR round.)"""
        return self._rates_from(self.model.rates_at(batch, k, budget, ks), batch, _k_of(k, ks))

    def _rates_from(self, formula: dict[str, float], batch: int, k_of: dict[str, int]) -> dict[str, float]:
        """``rates`` from the formula's rates at this batch (``SpeedupModel.rates_at``)."""
        bk, out = _bucket(batch), {}
        for c, r in formula.items():
            rec = self._record_rate(c, bk, k_of[c])
            out[c] = rec if rec is not None else r * self.factor(c, batch)
        return out

    def _record_rate(self, choice: str, bucket: int, k: int) -> float | None:
        """What the choice measured at this bucket, in tokens/s per sequence (None: fewer than
        ``MEASURED`` rounds there); an SSD choice's is put together by draft source."""
        m = self._measured_here(choice, bucket)
        if m is None:
            return None
        by_source = self.parts.rate(choice, bucket, k, self.model) if choice.startswith("ssd") else None
        return m.rate if by_source is None else by_source

    def observe_round(self, choice: str, tokens: int, seconds: float, batch: int, k: int, budget: int,
                      clean: bool = True, first: bool = False, source: str = "") -> None:
        """A round that ran ``choice`` produced ``tokens`` in ``seconds``: it goes into the choice's
        own record at this batch size, and, if ``clean`` (no other request's prefill overlapped it,
        not a request's first round), calibrates the formula's prediction. The record is what the
        choice delivers, joins included: kept out of it, they made SD at 8 users look 1.5x faster
        than its cells ran (traced: measured rounds covered 57% of SD's sequence-time, 77% of
        AR's), and the policy held SD where AR ran 20% faster. The formula prices forwards only,
        and a 1-2 s prefill stall in a factor would move it for every batch size. A request's
        ``first`` round is in the record's means but not its round count (``Measured``): a
        choice is measured once it has rounds of its own, not just requests' starts. An SSD round
        also goes into the part of its record for its draft ``source`` (cache: a hit; else the
        backup's name): see ssd_parts.py."""
        if seconds <= 0 or not self.model.known:
            return
        predicted = self.model.rates(batch, k, budget)[choice]
        if predicted > 0:
            ratio = min(max(tokens / seconds / predicted, 0.1), 10.0)
            # every sequence of the batch reports the same round: together they weigh one round
            # (one sample each let a single slow round at 16 users move the factor by 56%)
            w = 1.0 / max(batch, 1)
            if self.trace:
                self.trace({"ev": "round", "choice": choice, "batch": batch, "k": k, "budget": budget,
                            "tokens": tokens, "s": round(seconds, 4), "predicted": round(predicted, 3),
                            "clean": clean, "first": first, "source": source})
            record = self.measured.setdefault((choice, _bucket(batch)), Measured())
            record.update(tokens, seconds, w, self.rounds, counts=not first)
            if source and choice.startswith("ssd"):
                self.parts.observe(choice, _bucket(batch), source, tokens, seconds, w, self.rounds, not first)
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
            other = other_ssd(f"ssd+{self.forced_backup}")
            allowed = tuple(c for c in allowed if c != other) or allowed
        if len(allowed) == 1:
            return _decision(allowed[0], "request" if not self.forced_backup else "forced")
        if not self.model.known:
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
        now = self.clock()
        if self.decided_at is not None and now - self.decided_at > self.dwell_idle_s:
            # nothing decoded under the policy for a while (idle, or only requests that pinned their
            # mode, which ask no rounds): the dwell guarded a batch that is gone (traced, load test:
            # the dwell on SD left from an SSD cell's first part held the next SSD part's first 7
            # rounds on SD, after a minute of pinned AR and SD cells, where SSD predicted 17% more)
            self.switched_at = min(self.switched_at, self.rounds - self.min_dwell)
        self.decided_at = now
        bk = _bucket(batch)
        ks = self.model.best_k(batch, k, budget) if adaptive_k else None
        formula = self.model.rates_at(batch, k, budget, ks)
        k_of = _k_of(k, ks)
        rates = self._rates_from(formula, batch, k_of)
        d = self._next_decision(batch, bk, rates, allowed, k_of)
        d.ks = ks or {}
        if self.trace:
            self.trace({"ev": "decide", "round": self.rounds, "batch": batch, "k": k, "budget": budget,
                        "ks": d.ks,
                        "choice": d.choice, "reason": d.reason, "rates": {c: round(r, 3) for c, r in rates.items()},
                        "model": {c: round(r, 3) for c, r in formula.items()},
                        "p": {s: round(e.value, 3) for s, e in self.model.p_hit.items()},
                        "alpha": {"hit": round(self.model.e_hit.alpha, 3), "neural": round(self.model.e_miss["neural"].alpha, 3),
                                  "fast": round(self.model.e_miss["fast"].alpha, 3)},
                        "T_t": [round(self.model.target(r), 4) for r in (batch, batch * (k + 1))],
                        "T_d": [round(self.model.drafter(r), 4) for r in (1, batch, batch * (k + 1), batch * budget)]})
        return d

    def _next_decision(self, batch: int, bk: int, rates: dict, allowed: tuple[str, ...], k_of: dict) -> Decision:
        if self.probe in allowed and self.rounds < self.probe_until:
            return self._ran(_decision(self.probe, self.probe_reason, rates), bk)
        allowed = tuple(c for c in allowed if not self._dominated(c, bk, k_of)) or allowed
        top = max(rates[c] for c in allowed)
        others = len(allowed) - 1
        stale = [c for c in allowed if self._probe_due(c, bk, rates[c], top, others)]
        if stale:
            return self._start_probe(min(stale, key=lambda c: self.last_run.get((c, bk), 0)), "explore", rates, bk)
        best = max(allowed, key=lambda c: rates[c])
        cur = self.current if self.current in allowed else best
        free = free_switch(cur, best)  # between the SSD choices: nothing to pay, nothing to dwell on
        settled = free or self.rounds - self.switched_at >= self.min_dwell or self._outran(best, cur, bk, k_of)
        if cur != best and (cur not in allowed or settled and rates[best] > rates[cur] * (1 + self.hysteresis)):
            if cur in allowed and (self._stale(best, bk) or self._unproven(best, bk)):
                # its record is old and the current choice's is fresh: a machine that slowed down
                # shows in the running choice alone (traced at 8 users: AR's rounds went from 0.44
                # to 0.58 s, and the batch moved to SD for 16 rounds on a 60-s-old figure); or it
                # has none here and the current choice has (see _unproven)
                return self._start_probe(best, "confirm", rates, bk)
            cur = best
            if not free:
                self.switched_at = self.rounds
        self.current = cur
        return self._ran(_decision(cur, "policy", rates), bk)

    def _probe_due(self, choice: str, bucket: int, rate: float, top: float, others: int) -> bool:
        """Whether ``choice`` should be measured again at this batch size. Not while even
        ``explore_margin`` times its prediction stays below the best (unless it never ran at all:
        then once, at no price; or its record here is ``explore_every`` rounds old); otherwise after
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
        measured = self._measured_here(choice, bucket) is not None
        since = self.rounds - self.last_run.get((choice, bucket), 0)
        # the margin screens predictions, not records: a record is what the choice ran at one time,
        # and one taken while the machine stalled (a process's first rounds, allocating: traced, the
        # in-process bench's SSD with the neural backup kept 1.3 tok/s from its warm-up where it ran
        # 2.8) would otherwise stand for good, since nothing re-measures a choice that is not run;
        # after ``explore_every`` rounds it is measured again, at the usual price
        if rate * self.explore_margin < top and not never and not (measured and since >= self.explore_every):
            return False
        # priced in time, not rounds: at 8 users an SSD probe round took 1.8 s against AR's 0.5 s,
        # and probes priced per round took 16% of a load-test cell
        mine, best = self._round_seconds(choice, bucket), self._round_seconds(self.current, bucket)
        longer = mine / best if mine and best else 1.0
        price = 0.0 if never else (self.probe_rounds * longer * max(0.0, 1.0 - rate / top) * others
                                   / self.explore_budget)
        return since >= max(self.explore_every if measured else self.explore_new, price)

    def _start_probe(self, choice: str, reason: str, rates: dict, bucket: int) -> Decision:
        if self._stale(choice, bucket):  # an old record: the probe's rounds are news, not noise
            self.measured[(choice, bucket)].forget()
            self.parts.forget(choice, bucket)
        self.probe, self.probe_reason, self.probe_until = choice, reason, self.rounds + self.probe_rounds
        return self._ran(_decision(choice, reason, rates), bucket)

    def _outran(self, best: str, cur: str, bucket: int, k_of: dict) -> bool:
        """Both choices have records at this bucket and ``best``'s is ``explore_margin`` times
        ``cur``'s or more: a gap that size is not the noise the dwell guards against, and a switch
        round costs less than a dwell on the slower choice. (Traced, 4-user load test: the batch
        moved to SD at 3 sequences, a probe 5 rounds later measured SSD at 3.0-4.0 tokens/s
        against SD's 1.36 at batch 1, and the dwell held SD for 11 more rounds.)"""
        mine, theirs = self._record_rate(best, bucket, k_of[best]), self._record_rate(cur, bucket, k_of[cur])
        return mine is not None and theirs is not None and mine > theirs * self.explore_margin

    def _unproven(self, choice: str, bucket: int) -> bool:
        """No record at this bucket while the current choice has one, and no probe of it just
        ended: its rate is the formula's guess against the current choice's measurement, so it is
        measured before the batch moves (traced, served bench: 2 rounds into the warm-up haiku a
        lucky 5-token hit raised SSD's calibration, the never-run n-gram backup, priced by the
        formula times that factor, beat the neural backup's record by 17%, and the dwell then held
        it for 16 rounds while its record said 0.74 tokens/s against the neural backup's 2.2)."""
        if self._measured_here(choice, bucket) is not None or self._measured_here(self.current, bucket) is None:
            return False
        probed = self.last_run.get((choice, bucket))
        return probed is None or self.rounds - probed > 1

    def _stale(self, choice: str, bucket: int) -> bool:
        """Measured at this bucket, but not for ``stale_after`` rounds."""
        m = self._measured_here(choice, bucket)
        return m is not None and self.rounds - m.last > self.stale_after

    def _dominated(self, choice: str, bucket: int, k_of: dict) -> bool:
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
        bar = self._record_rate(choice, b, k_of[choice]) * (1 + self.hysteresis)
        later = CHOICES[CHOICES.index(choice) + 1:]
        return any((r := self._record_rate(c, b, k_of[c])) is not None and r > bar for c in later)

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
        if not self.model.known:
            return None
        for b in range(1, max_batch + 1):
            r = self.rates(b, k, budget)
            if r["ssd+fast"] > r["ssd+neural"]:
                return b
        return None


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


def _k_of(k: int, ks: dict[str, int] | None) -> dict[str, int]:
    """Each choice's K this round: its own (``best_k``) or the request's."""
    return {c: (ks or {}).get(c, k) for c in CHOICES}


def _decision(choice: str, reason: str, rates: dict | None = None, ks: dict | None = None) -> Decision:
    mode, _, backup = choice.partition("+")
    return Decision(mode, backup or "neural", reason, rates or {}, dict(ks or {}))
