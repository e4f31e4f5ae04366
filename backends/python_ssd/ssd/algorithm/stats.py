"""One request's statistics, added up from its rounds' records (rounds.RoundRecord).

Times are wall seconds measured around each call; T_p, T_b and T_sd_draft are the speculation's,
the backup's and SD's drafting time relative to one verify (T_v).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .rounds import RoundRecord


@dataclass
class RequestStats:
    mode: str
    draft_len: int = 0
    rounds: int = 0
    tokens_per_round: list[int] = field(default_factory=list)
    source_per_round: list[str] = field(default_factory=list)  # cache | neural | fast | draft | none
    hits: int = 0
    misses: int = 0
    t_verify: float = 0.0
    t_speculate: float = 0.0
    t_backup: float = 0.0
    t_draft: float = 0.0
    # verify calls that came back with the engine's own forward time (at batch > 1 only the first
    # sequence of a message gets it): round trip and forward seconds, so what lies outside the
    # forward (BLS, JSON, queues; in-process the thread hop) is measured inside one request,
    # whatever the machine's speed that minute
    n_verify_timed: int = 0
    t_verify_timed: float = 0.0
    t_verify_forward: float = 0.0
    prefill_s: float = 0.0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, found in the target's KV (a kept prefix): not computed
    prefill_threads: int = 0  # the prefill's layout: 0 split (the target's own threads), else wide
    decode_s: float = 0.0
    new_tokens: int = 0
    backup_reasons: Counter = field(default_factory=Counter)
    budgets: Counter = field(default_factory=Counter)  # fan-out budget B -> SSD rounds run with it
    decisions: Counter = field(default_factory=Counter)  # "choice: reason" per round (ssd+neural, sd, ar...)
    draft_lens: Counter = field(default_factory=Counter)  # K -> rounds that drafted K tokens (CostModel.best_k)
    last_rates: dict = field(default_factory=dict)  # the scheduler's estimated tokens/s per choice, last round
    predicted_rate: float = 0.0  # ... and for the choice that ran
    degraded: str = ""  # set when a drafter failed and the request went on without it

    def add(self, rec: RoundRecord, rates: dict) -> None:
        """One round of this request (``rates``: the scheduler's estimates that round)."""
        n = rec.steps  # counted per target step: an AR round of n steps is n one-token rounds here
        self.rounds += n
        self.tokens_per_round += [rec.tokens] if n == 1 else [1] * n
        self.source_per_round += [rec.source] * n
        self.decisions[f"{rec.choice}: {rec.reason}"] += n
        if rec.choice.mode != "ar":
            self.draft_lens[rec.k] += 1
        if rates:
            self.last_rates = {str(c): r for c, r in rates.items()}
            self.predicted_rate = rates.get(rec.choice, 0.0)
        self.t_verify += rec.verify_seconds
        self.t_speculate += rec.speculate_seconds
        if rec.choice.mode == "ssd" and rec.source in ("neural", "fast"):
            self.t_backup += rec.draft_seconds
            self.backup_reasons[f"{rec.choice.backup}: {rec.reason}"] += 1
        elif rec.choice.mode == "sd":
            self.t_draft += rec.draft_seconds
        if rec.target_timing:
            self.n_verify_timed += n
            self.t_verify_timed += rec.verify_seconds
            self.t_verify_forward += sum(s for _, s in rec.target_timing)
        if rec.hit is not None:
            self.budgets[rec.budget] += 1
            self.hits += rec.hit
            self.misses += not rec.hit

    @staticmethod
    def _mean(xs: list[int]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    def to_dict(self) -> dict:
        hit_rounds = [t for t, s in zip(self.tokens_per_round, self.source_per_round) if s == "cache"]
        miss_rounds = [t for t, s in zip(self.tokens_per_round, self.source_per_round) if s in ("neural", "fast")]
        lookups = self.hits + self.misses
        p_hit = self.hits / lookups if lookups else 0.0
        t_v = self.t_verify / self.rounds if self.rounds else 0.0
        n_backup = sum(1 for s in self.source_per_round if s in ("neural", "fast"))
        t_p = (self.t_speculate / max(self.rounds, 1)) / t_v if t_v else 0.0
        t_b = (self.t_backup / n_backup) / t_v if (t_v and n_backup) else 0.0
        t_d = (self.t_draft / max(self.rounds, 1)) / t_v if t_v else 0.0
        e_all = self._mean(self.tokens_per_round)
        e_hit, e_miss = self._mean(hit_rounds), self._mean(miss_rounds)
        # the scheduler's estimate for the last round's choice, in tokens per target verify
        predicted = self.predicted_rate * t_v
        # decode rate: output tokens after the first (which the prefill produced) over decode time
        decode_tps = max(self.new_tokens - 1, 0) / self.decode_s if self.decode_s > 0 else 0.0
        return {
            "mode": self.mode,
            "draft_len": self.draft_len,
            "rounds": self.rounds,
            "new_tokens": self.new_tokens,
            "acceptance_length": round(e_all, 4),
            "accepted_per_round": [t - 1 for t in self.tokens_per_round],
            "cache_hits": self.hits,
            "cache_misses": self.misses,
            "p_hit": round(p_hit, 4),
            "e_hit": round(e_hit, 4),
            "e_miss": round(e_miss, 4),
            "backup_used": dict(Counter(s for s in self.source_per_round if s in ("neural", "fast"))),
            "backup_reasons": dict(self.backup_reasons),
            "fanout_budgets": {str(b): n for b, n in sorted(self.budgets.items())},
            "draft_lens": {str(k): n for k, n in sorted(self.draft_lens.items())},
            "policy_decisions": dict(self.decisions),
            "rounds_by_choice": dict(Counter(k.split(":")[0] for k in self.decisions.elements())),
            "policy_rates_tok_s": {k: round(v, 3) for k, v in self.last_rates.items()},
            "degraded": self.degraded,
            "t_verify_ms": round(1000 * t_v, 2),
            "verify_forward_ms": round(1000 * self.t_verify_forward / max(self.n_verify_timed, 1), 2),
            "verify_outside_forward_ms": round(1000 * (self.t_verify_timed - self.t_verify_forward)
                                               / max(self.n_verify_timed, 1), 2),
            "t_p": round(t_p, 4),
            "t_b": round(t_b, 4),
            "t_sd_draft": round(t_d, 4),
            "prefill_s": round(self.prefill_s, 4),
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "prefill_threads": self.prefill_threads,
            "decode_s": round(self.decode_s, 4),
            "decode_tokens_per_s": round(decode_tps, 3),
            "speedup_predicted": round(predicted, 3),
            # measured against this request's own AR cost: one target step per token ~ T_v
            "speedup_measured_vs_ar_step": round(decode_tps * t_v, 3),
        }
