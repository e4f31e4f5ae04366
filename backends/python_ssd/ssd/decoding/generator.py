"""The per-request decoding loops: AR, SD and SSD, over any WorkerClient.

All three start with the same prefill (a verify with an empty draft), so the first token and every
later greedy token are the target's own; they differ only in where the drafts come from:
- ar:  no draft; one target step per token.
- sd:  the drafter drafts K tokens, then the target verifies them (serially).
- ssd: verify(round T) and speculate(round T+1 for likely outcomes) run at the same time in two
       processes; a cache hit starts the next round at once, a miss calls a backup (neural drafter
       or n-gram) chosen by the policy for the current batch size.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from ..algorithm.fanout import FanoutEstimator, allocate
from ..algorithm.ngram import propose
from ..algorithm.policy import BackupPolicy
from ..algorithm.sampling import SamplingParams
from ..algorithm.stats import RequestStats
from ..workers.protocol import (DraftCall, DraftResult, FetchCall, SpeculateCall, SpeculateResult,
                                VerifyCall, VerifyResult)

MODES = ("ar", "sd", "ssd")
BACKUPS = ("auto", "neural", "fast")


class WorkerClient(Protocol):
    async def verify(self, call: VerifyCall) -> VerifyResult: ...
    async def draft(self, call: DraftCall) -> DraftResult: ...
    async def speculate(self, call: SpeculateCall) -> SpeculateResult: ...
    async def fetch(self, call: FetchCall) -> DraftResult: ...
    async def fast_draft(self, call: DraftCall) -> DraftResult: ...
    async def release(self, seq_id: str) -> None: ...


@dataclass
class DecodeConfig:
    mode: str = "ssd"
    k: int = 4
    fanout_budget: int = 8
    fanout_shape: str = "geometric"
    saguaro_c: float = 1.0
    backup: str = "auto"

    def validate(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.backup not in BACKUPS:
            raise ValueError(f"backup must be one of {BACKUPS}, got {self.backup!r}")
        if not 1 <= self.k <= 16:
            raise ValueError(f"num_draft_tokens must be in 1..16, got {self.k}")
        if not 0.0 <= self.saguaro_c <= 1.0:
            raise ValueError(f"saguaro_c must be in [0, 1], got {self.saguaro_c}")
        if self.fanout_budget < self.k + 1:
            raise ValueError(f"fanout_budget must be at least num_draft_tokens + 1 = {self.k + 1}")


@dataclass
class SharedState:
    """Server-wide estimates every request learns from (and feeds)."""

    estimator: FanoutEstimator = field(default_factory=FanoutEstimator)
    policy: BackupPolicy = field(default_factory=BackupPolicy)
    active: int = 0  # sequences currently decoding: the batch size the policy plans for


async def _timed(coro):
    t0 = time.perf_counter()
    r = await coro
    return r, time.perf_counter() - t0


class Generation:
    def __init__(self, client: WorkerClient, seq_id: str, prompt: list[int], params: SamplingParams,
                 seed: int, cfg: DecodeConfig, shared: SharedState | None = None):
        cfg.validate()
        self.c, self.seq_id, self.prompt, self.params, self.seed, self.cfg = client, seq_id, prompt, params, seed, cfg
        self.shared = shared or SharedState()
        self.stats = RequestStats(mode=cfg.mode, draft_len=0 if cfg.mode == "ar" else cfg.k)
        self.round = 0
        self.drafter_ok = True

    def _verify(self, prefix, draft, probs=None) -> VerifyCall:
        return VerifyCall(self.seq_id, prefix, draft, self.params, self.seed, self.round, probs)

    def _draft_call(self, prefix, fanout, c=1.0) -> DraftCall:
        return DraftCall(self.seq_id, prefix, self.cfg.k, self.params, self.seed, self.round, c, fanout)

    async def run(self) -> AsyncIterator[list[int]]:
        """Yields the target's tokens, a block per round. The caller stops iterating when done."""
        self.shared.active += 1
        try:
            t0 = time.perf_counter()
            first = await self.c.verify(self._verify(self.prompt, []))
            self.stats.prefill_s = time.perf_counter() - t0
            prefix = self.prompt + [first.token]
            self.round += 1
            self.stats.new_tokens = 1
            yield [first.token]
            t_dec = time.perf_counter()
            loop = {"ar": self._ar, "sd": self._sd, "ssd": self._ssd}[self.cfg.mode]
            async for block in loop(prefix):
                self.stats.decode_s = time.perf_counter() - t_dec
                self.stats.new_tokens += len(block)
                yield block
        finally:
            self.shared.active -= 1

    async def _ar(self, prefix):
        while True:
            r, dt = await _timed(self.c.verify(self._verify(prefix, [])))
            self.stats.t_verify += dt
            self.stats.record_round(1, "none")
            self.round += 1
            prefix = prefix + [r.token]
            yield [r.token]

    def _degrade(self, what: str, err: Exception) -> None:
        """A drafter failure costs speed, never correctness: drafts come from the n-gram backup
        (or nothing) from now on; the target alone decides every token either way."""
        self.drafter_ok = False
        self.stats.degraded = f"{what} failed ({type(err).__name__}: {err}); continuing without the drafter"

    async def _fallback_draft(self, prefix) -> DraftResult:
        try:
            return await self.c.fast_draft(self._draft_call(prefix, []))
        except Exception:  # noqa: BLE001 - no backup either: an AR step (empty draft)
            return DraftResult([], None)

    async def _sd(self, prefix):
        while True:
            t0 = time.perf_counter()
            try:
                if not self.drafter_ok:
                    raise RuntimeError("drafter unavailable")
                d = await self.c.draft(self._draft_call(prefix, []))
            except Exception as e:  # noqa: BLE001
                if self.drafter_ok:
                    self._degrade("draft", e)
                d = await self._fallback_draft(prefix)
            self.stats.t_draft += time.perf_counter() - t0
            r, dt = await _timed(self.c.verify(self._verify(prefix, d.tokens, d.probs)))
            self.stats.t_verify += dt
            block = d.tokens[:r.accepted] + [r.token]
            self.stats.record_round(len(block), "draft")
            self.shared.estimator.record_round(r.accepted, len(d.tokens))
            self.round += 1
            prefix = prefix + block
            yield block

    async def _backup(self, prefix, fanout) -> tuple[DraftResult, str]:
        pol = self.shared.policy
        if self.cfg.backup == "auto":
            kind, reason = pol.choose(self.shared.active)
            why = "forced by config" if pol.forced else "policy"
        else:
            kind, reason, why = self.cfg.backup, "requested", "request"
        self.stats.backup_reasons[f"{kind}: {why}"] += 1
        self.stats.last_policy_reason = reason
        call = self._draft_call(prefix, fanout, self.cfg.saguaro_c)
        if kind == "neural" and not self.drafter_ok:
            kind = "fast"
        t0 = time.perf_counter()
        if kind == "fast":
            d = await self._fallback_draft(prefix)
        else:
            try:
                d = await self.c.draft(call)
            except Exception as e:  # noqa: BLE001
                self._degrade("neural backup", e)
                kind, d = "fast", await self._fallback_draft(prefix)
        dt = time.perf_counter() - t0
        self.stats.t_backup += dt
        pol.t_b[kind].update(dt / max(pol_tv(self.stats), 1e-6))
        return d, kind

    async def _verify_and_speculate(self, prefix, draft, spec):
        """Both at once, in two processes. A failed speculation is a miss; a failed verify is fatal."""
        verify_out, spec_out = await asyncio.gather(
            _timed(self.c.verify(self._verify(prefix, draft.tokens, draft.probs))),
            _timed(self.c.speculate(spec)), return_exceptions=True)
        if isinstance(verify_out, BaseException):
            raise verify_out
        if isinstance(spec_out, BaseException):
            self._degrade("speculate", spec_out)
            spec_out = None
        return verify_out, spec_out

    async def _ssd(self, prefix):
        cfg, est, pol = self.cfg, self.shared.estimator, self.shared.policy
        fanout = allocate(cfg.fanout_shape, cfg.k, cfg.fanout_budget, est)
        draft, source = await self._backup(prefix, fanout)
        while True:
            fanout = allocate(cfg.fanout_shape, cfg.k, cfg.fanout_budget, est)
            spec = SpeculateCall(self.seq_id, prefix, draft.tokens, cfg.k, fanout, self.params, self.seed,
                                 self.round, cfg.saguaro_c)
            if self.drafter_ok:
                (r, tv), spec_out = await self._verify_and_speculate(prefix, draft, spec)
            else:
                (r, tv), spec_out = await _timed(self.c.verify(self._verify(prefix, draft.tokens, draft.probs))), None
            s, tp = spec_out if spec_out is not None else (SpeculateResult({}), 0.0)
            self.stats.t_verify += tv
            self.stats.t_speculate += tp
            block = draft.tokens[:r.accepted] + [r.token]
            self.stats.record_round(len(block), source)
            est.record_round(r.accepted, len(draft.tokens))
            # what the n-gram backup would have proposed here: its E_miss, measured for free
            guess = propose(prefix, cfg.k)
            n_ok = next((i for i, (a, b) in enumerate(zip(guess, block)) if a != b), min(len(guess), len(block) - 1))
            pol.e_miss["fast"].update(n_ok + 1)
            if source == "cache":
                pol.e_hit.update(len(block))
            elif source == "neural":
                pol.e_miss["neural"].update(len(block))
            pol.t_p.update(tp / max(tv, 1e-6))
            key = (r.accepted, r.token)
            hit = key in s.branches
            est.record_lookup(fanout[r.accepted], hit)
            pol.p_hit.update(float(hit))
            if hit:
                self.stats.hits += 1
            else:
                self.stats.misses += 1
            self.round += 1
            prefix = prefix + block
            yield block
            if hit and not self.params.greedy:
                try:  # sampled: the verifier needs the q' rows the branch was drawn from
                    probs = (await self.c.fetch(FetchCall(self.seq_id, key))).probs
                except Exception as e:  # noqa: BLE001
                    self._degrade("fetch", e)
                    hit = False
            if hit:
                draft, source = DraftResult(s.branches[key], None if self.params.greedy else probs), "cache"
            else:
                draft, source = await self._backup(prefix, fanout)


def pol_tv(stats: RequestStats) -> float:  # mean verify time so far
    return stats.t_verify / stats.rounds if stats.rounds else 0.0
