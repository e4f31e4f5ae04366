"""Which choice (mode, backup, K) the batch's next round runs: a discounted-UCB bandit with a prior.

Each round the batch asks once. For every choice at the current batch size b:
- the prior is the cost model's predicted tokens/s per sequence (cost_model.py), scaled by what
  its formula misses (Python, IPC, sampling, a drafter's hand-offs): measured tokens over the
  prior's tokens in the same seconds, pooled over the measured choices of the same mode at this
  batch size (AR's formula misses what AR rounds pay on either layout, SD's what SD rounds pay),
  and over every measured choice for a mode not yet measured there;
- the record is the choice's own discounted tokens and seconds per (choice, batch-size bucket):
  an old round weighs half after ``half_life_s`` seconds of the batch's decoding, so the record
  follows the machine's drift and a choice not run for a while falls back to its prior. Drift on a
  shared machine happens in time, not in rounds: forgetting per round, a batch of 30-200 ms rounds
  re-tried its losing choices every half minute;
- the estimate blends the two, the prior weighing ``prior_rounds`` rounds;
- the score is discounted UCB's bound on the estimate, est * (1 + explore * sqrt(log n_total /
  n_choice)): relative, as the estimate's error is (the prior is off by a factor); a choice whose
  estimate is close to the best and whose record is thin gets tried, one far below does not.
  The bound is on the choice's steady rate; a drafter's catch-up (below) is measured, not
  uncertain, so it is priced after the bound, as it is after the estimate.
The highest score runs, but a change of choice must beat the current one's score by
``hysteresis`` (a change costs a round without a cached draft), except between the two SSD
backups, which share the speculation. With ``adaptive_k`` each choice runs its own best K.
A choice that drafts after AR rounds first gives the drafter every token it has not seen (the
batch's prompts, when they were prefilled on a wide layout, and the AR rounds' tokens): its
estimate counts those seconds, spread over the tokens the batch's sequences still have to make, so
a batch near its end does not switch into a catch-up it cannot earn back.
Free drafts (lookup, lookup@wide) are priced from each request's own acceptance (``lookup``, the
batch's LookupOutlook), so their record cannot hold a rate: a rate measured on an edit says nothing
of a chat. It holds what the rounds made against what their prior predicted when they were
chosen, and the estimate is the prior of now times that ratio.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .cost_model import CostModel, StepCost
from .lookup_estimate import LookupOutlook
from .rounds import SPLIT_CHOICES, Choice, RoundRecord


@dataclass
class PolicyConfig:
    """The scheduler's knobs: the `ssd` model's parameters of the same names set them (config.py)."""

    half_life_s: float = 120.0  # seconds of decoding after which a round's record weighs half
    prior_rounds: float = 1.0  # the cost model's prediction counts as one measured round: it ranks roughly
    explore: float = 0.35  # UCB width, a share of the choice's own estimate: tries a choice whose prior is close
    hysteresis: float = 0.1  # a costly change must predict this much more: it pays a round without a cached draft
    tree_slack: float = 0.25  # share of a verify the speculation tree's extra branches may cost
    k_margin: float = 0.10  # a shorter K must predict this much more: per-round costs favour fewer rounds
    flat_rows: int = 32  # rows a forward holds at one row's cost when nothing larger was measured

    def validate(self) -> None:
        """Raises ValueError naming the knob (the `ssd` model's parameter of the same name)."""
        for name in ("half_life_s", "prior_rounds", "flat_rows"):
            if not getattr(self, name) > 0:
                raise ValueError(f"parameter '{name}': must be > 0, got {getattr(self, name)}")
        for name in ("explore", "hysteresis", "tree_slack", "k_margin"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"parameter '{name}': must be >= 0, got {getattr(self, name)}")


@dataclass
class Decision:
    choice: Choice
    reason: str  # policy | explore | forced | request | warmup | drafter down
    rates: dict = field(default_factory=dict)  # estimated tokens/s per sequence, per choice
    ks: dict = field(default_factory=dict)  # each choice's K this round (empty: the request's)
    prior: dict = field(default_factory=dict)  # the cost model's tokens/s per sequence, per choice

    @property
    def mode(self) -> str:
        return self.choice.mode

    @property
    def backup(self) -> str:
        return self.choice.backup


@dataclass
class Discounted:
    """Tokens, seconds and weight of a choice's rounds, each old round's weight halved every
    ``half_life`` seconds of the scheduler's clock (the seconds its batch has decoded)."""

    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0
    at: float = 0.0
    expected: float = 0.0  # tokens the prior predicted in those seconds when each round was chosen

    def decayed(self, now: float, half_life: float) -> "Discounted":
        f = 0.5 ** (max(now - self.at, 0.0) / half_life)
        return Discounted(self.tokens * f, self.seconds * f, self.weight * f, now, self.expected * f)

    def add(self, tokens: float, seconds: float, weight: float, expected: float = 0.0) -> None:
        self.tokens += weight * tokens
        self.seconds += weight * seconds
        self.weight += weight
        self.expected += weight * expected


def bucket(batch: int) -> int:
    """Batch sizes 1 | 2 | 3-5 | 6-11 | 12-22 | ...: centred on powers of two, where load settles."""
    return round(math.log2(max(batch, 1)))


class Scheduler:
    def __init__(self, config: PolicyConfig | None = None, forced_mode: str | None = None,
                 forced_backup: str | None = None, trace=None):
        self.cfg = cfg = config or PolicyConfig()
        self.model = CostModel(cfg.tree_slack, cfg.k_margin, StepCost(cfg.flat_rows), StepCost(cfg.flat_rows))
        self.forced_mode, self.forced_backup = forced_mode, forced_backup
        self.trace = trace  # callable(dict): every decision and measured round (SSD_POLICY_TRACE)
        self.current = Choice.SSD_NEURAL
        self.rounds = 0  # decided rounds of the batch
        self.clock = 0.0  # seconds of the batch's rounds: the records' time
        self.records: dict[tuple[Choice, int], Discounted] = {}
        self._round: Decision | None = None  # this round's decision, shared by every sequence asking
        self._asked: set = set()

    def choose(self, batch: int, k: int, budget: int, allowed=SPLIT_CHOICES, seq: str | None = None,
               adaptive_k: bool = False, owed_rows: int = 0, tokens_left: float = 0.0,
               lookup: LookupOutlook | None = None) -> Decision:
        """The choice for sequence ``seq``'s next round among ``allowed``. A round of the batch
        starts when a sequence asks again (or ``seq`` is None); every sequence asking within it
        gets the same answer, so a change moves the whole batch at once. ``owed_rows``: tokens the
        batch's drafter caches lack; ``tokens_left``: what each sequence still has to make (mean);
        ``lookup``: the batch's free-draft outlook."""
        allowed = tuple(Choice(c) for c in allowed)
        if forced := self._forced(allowed):
            return Decision(forced, "forced")
        if self.forced_backup:
            allowed = tuple(c for c in allowed if c.mode != "ssd" or c.backup == self.forced_backup) or allowed
        if len(allowed) == 1:
            rates = self.model.rates(batch, k, budget, lookup) if self.model.known else {}
            return Decision(allowed[0], "forced" if self.forced_backup else "request", rates, prior=rates)
        if not self.model.known:
            return Decision(self.current if self.current in allowed else allowed[0], "warmup")
        if seq is None or seq in self._asked or self._round is None:
            self._asked.clear()
            self._round = self._next_round(batch, k, budget, allowed, adaptive_k, owed_rows, tokens_left, lookup)
        self._asked.add(seq)
        d = self._round
        choice = d.choice if d.choice in allowed else max(allowed, key=lambda c: d.rates[c])
        return Decision(choice, d.reason if choice == d.choice else "policy", d.rates, d.ks, d.prior)

    def running(self, allowed=SPLIT_CHOICES) -> Choice:
        """The choice the batch runs now among ``allowed``: a new request's prefill takes its layout,
        so it does not stop a wide batch's cores to run on one (or a split batch's drafter)."""
        allowed = tuple(Choice(c) for c in allowed)
        return self._forced(allowed) or (self.current if self.current in allowed else allowed[0])

    def _forced(self, allowed: tuple) -> Choice | None:
        """The forced mode (``forced_mode``) where ``allowed`` admits it."""
        forced = Choice(self.forced_mode) if self.forced_mode else None
        return forced if forced in allowed else None

    def estimates(self, batch: int, k: int, budget: int, ks: dict | None = None, prior: dict | None = None,
                  lookup: LookupOutlook | None = None):
        """(estimated tokens/s, weight in rounds) per choice at this batch size (see the top);
        ``prior``: the cost model's rates, where the caller has them."""
        prior = prior or self.model.rates_at(batch, k, budget, ks, lookup)
        recs = {c: self.records.get((c, bucket(batch)), Discounted()).decayed(self.clock, self.cfg.half_life_s)
                for c in Choice}

        def shortfall(choices) -> float | None:
            expected = sum(prior[c] * recs[c].seconds for c in choices)
            return min(max(sum(recs[c].tokens for c in choices) / expected, 0.1), 10.0) if expected > 0 else None

        rated = [c for c in Choice if c.mode != "lookup"]
        pooled = shortfall(rated) or 1.0
        by_mode = {m: shortfall([c for c in rated if c.mode == m]) for m in {c.mode for c in rated}}
        p = self.cfg.prior_rounds
        est = {c: (p * (by_mode[c.mode] or pooled) * prior[c] + r.tokens / max(r.seconds, 1e-9) * r.weight)
               / (p + r.weight) for c, r in recs.items() if c.mode != "lookup"}
        # lookup, per request: the prior of now, corrected as its rounds measured; before they have,
        # as the rounds that run the target alone (a lookup round is a target forward and a free
        # draft: the neural drafter's shortfall, its core's contention and its acceptance, is not its)
        target_alone = by_mode["ar"] or pooled
        for c in (Choice.LOOKUP, Choice.LOOKUP_WIDE):
            r = recs[c]
            ratio = min(max(r.tokens / r.expected, 0.1), 10.0) if r.expected > 0 else target_alone
            est[c] = (p * target_alone + ratio * r.weight) / (p + r.weight) * prior[c]
        return est, {c: p + r.weight for c, r in recs.items()}

    def after_catch_up(self, est: dict, owed_rows: int, tokens_left: float) -> dict:
        """``est`` with each drafting choice's rate over the sequences' ``tokens_left`` tokens
        including the seconds its drafter first needs for ``owed_rows`` rows."""
        if owed_rows <= 0 or tokens_left <= 0:
            return est
        out = dict(est)
        for c, rate in est.items():
            if c.uses_drafter and rate > 0:
                out[c] = tokens_left / (tokens_left / rate + self.model.catch_up_seconds(owed_rows, c.wide))
        return out

    def _next_round(self, batch: int, k: int, budget: int, allowed: tuple, adaptive_k: bool,
                    owed_rows: int = 0, tokens_left: float = 0.0, lookup: LookupOutlook | None = None) -> Decision:
        self.rounds += 1
        ks = self.model.best_k(batch, k, budget) if adaptive_k else None
        prior = self.model.rates_at(batch, k, budget, ks, lookup)
        if lookup is not None:
            ks = dict(ks or {}) | {c: self.model.lookup_k(batch, lookup, c.wide)
                                   for c in (Choice.LOOKUP, Choice.LOOKUP_WIDE)}
        steady, n = self.estimates(batch, k, budget, ks, prior)
        width = self.cfg.explore * math.sqrt(math.log(sum(n[c] for c in allowed)))
        # the bound is on the steady rate, the uncertain part; the catch-up is a measured one-off,
        # priced after the bound (an optimistic rate must still earn back the same seconds)
        bound = {c: steady[c] * (1 + width / math.sqrt(n[c])) for c in allowed}
        est = self.after_catch_up(steady, owed_rows, tokens_left)
        score = self.after_catch_up(bound, owed_rows, tokens_left)
        top = max(est[c] for c in allowed)
        best = max(allowed, key=score.get)
        cur = self.current if self.current in allowed else best
        if not cur.switch_is_free(best) and score[best] <= score[cur] * (1 + self.cfg.hysteresis):
            best = cur
        reason = "policy" if best == cur or est[best] >= top else "explore"
        self.current = best
        if self.trace:
            self.trace({"ev": "decide", "round": self.rounds, "batch": batch, "k": k, "budget": budget,
                        "choice": best.value, "reason": reason, "owed_rows": owed_rows, "tokens_left": tokens_left,
                        "lookup": None if lookup is None else {"alpha": round(lookup.alpha, 3), "p_draft": round(
                            lookup.p_draft, 3), "length": round(lookup.length, 2), "k_max": lookup.k_max},
                        "ks": {c.value: v for c, v in (ks or {}).items()},
                        "prior": {c.value: round(v, 3) for c, v in prior.items()},
                        "est": {c.value: round(v, 3) for c, v in est.items()},
                        "score": {c.value: round(v, 3) for c, v in score.items()}})
        return Decision(best, reason, est, dict(ks or {}), prior)

    def observe(self, rec: RoundRecord) -> None:
        """A round's tokens and seconds join its choice's record at its batch size; every sequence
        of the batch reports the same round, so together they weigh one. A round right after a
        costly change measures the change, not the choice, and is left out."""
        if self.trace:  # every round, the ones left out of the records too
            self.trace({"ev": "round", "choice": rec.choice.value, "batch": rec.batch, "k": rec.k,
                        "tokens": rec.tokens, "drafted": rec.drafted, "s": round(rec.seconds, 4),
                        "fast_guess": [rec.ngram_accepted, rec.ngram_drafted],  # accepted of drafted
                        "prompt_s": round(rec.prompt_seconds, 4),
                        "draft_s": round(rec.draft_seconds, 4), "verify_s": round(rec.verify_seconds, 4),
                        "drafter_forward_s": round(sum(s for _, s in rec.drafter_timing), 4),
                        "target_forward_s": round(sum(s for _, s in rec.target_timing), 4),
                        "source": rec.source, "after_switch": rec.after_switch})
        self.clock += max(rec.seconds, 0.0) / max(rec.batch, 1)  # each of the batch's sequences reports the round
        if rec.after_switch or rec.seconds <= 0:
            return
        key = (Choice(rec.choice), bucket(rec.batch))
        r = self.records[key] = self.records.get(key, Discounted()).decayed(self.clock, self.cfg.half_life_s)
        r.add(rec.tokens, rec.own_seconds, 1.0 / max(rec.batch, 1), rec.predicted_rate * rec.own_seconds)
