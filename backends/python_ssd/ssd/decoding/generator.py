"""The per-request decoding loops: AR, SD and SSD, over any WorkerClient.

All three start with the same prefill (a verify with an empty draft), so the first token and every
later greedy token are the target's own; they differ only in where the drafts come from:
- ar:  no draft; one target step per token.
- sd:  the drafter drafts K tokens, then the target verifies them (serially).
- ssd: verify(round T) and speculate(round T+1 for likely outcomes) run at the same time in two
       processes; a cache hit starts the next round at once, a miss calls a backup (neural drafter
       or n-gram) chosen by the policy for the current batch size.
One loop runs them all: each round asks the mode policy what to do (a request in mode "ssd" with
step_aside lets it pick SSD, SD or AR per round; "ar" and "sd" requests are pinned). Every round is
a complete lossless verification whatever produced its draft, so switching between rounds is exact.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from ..algorithm.fanout import FanoutEstimator, allocate
from ..algorithm.ngram import propose
from ..algorithm.policy import Decision, ModePolicy
from ..algorithm.sampling import SamplingParams
from ..algorithm.speedup_model import free_switch
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
    fanout_budget: int = 12  # bench sweeps at batch 1: B = 12 beat 8 in 3 of 3 runs (README)
    fanout_shape: str = "geometric"
    saguaro_c: float = 1.0
    backup: str = "auto"
    step_aside: bool = True  # ssd only: the policy may run SD or AR rounds when they predict more
    adaptive_k: bool = True  # ssd only: k is the most a round drafts; the policy picks K <= k per choice

    def allowed(self) -> tuple[str, ...]:
        """The choices the policy may make for this request."""
        if self.mode != "ssd":
            return (self.mode,)
        ssd = ("ssd+neural", "ssd+fast") if self.backup == "auto" else (f"ssd+{self.backup}",)
        return ssd + (("sd", "ar") if self.step_aside else ())

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
    policy: ModePolicy = field(default_factory=ModePolicy)
    active: int = 0  # sequences currently decoding: the batch size the policy plans for
    # Verify rows the target runs at one tile's cost (0: no limit). The batch-invariant CPU target
    # runs its GEMMs in tiles of up to 32 rows: 8 sequences x (K=4 + 1) = 40 rows cost two tiles,
    # ~1.5x of 32 rows for 10% more tokens. So a round's K is lowered until b (K + 1) fits (never
    # below 1): every round is verified in full whatever its K, so this is exact.
    max_verify_rows: int = 0
    # Prefills in flight, and a counter bumped when one starts or ends: a round that a prefill
    # overlapped waited for it (a long prompt stalls the target for a second or two), whatever the
    # choice, so it says nothing about the choice and is kept out of the policy's calibration.
    prefilling: int = 0
    prefill_epoch: int = 0

    def prefill_mark(self) -> int | None:
        return None if self.prefilling else self.prefill_epoch

    def round_k(self, k: int) -> int:
        if self.max_verify_rows <= 0:
            return k
        return max(1, min(k, self.max_verify_rows // max(self.active, 1) - 1))


def _truncate(d: DraftResult, k: int) -> DraftResult:
    if len(d.tokens) <= k:
        return d
    return DraftResult(d.tokens[:k], d.probs[:k] if d.probs is not None else None, d.timing)


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
        self.k = cfg.k  # this round's draft length (SharedState.round_k, SpeedupModel.best_k)
        self.drafter_ok = True
        self.last_choice = ""  # the policy's choice for the previous round

    def _verify(self, prefix, draft, probs=None) -> VerifyCall:
        return VerifyCall(self.seq_id, prefix, draft, self.params, self.seed, self.round, probs)

    def _draft_call(self, prefix, fanout, c=1.0) -> DraftCall:
        return DraftCall(self.seq_id, prefix, self.k, self.params, self.seed, self.round, c, fanout)

    async def run(self) -> AsyncIterator[list[int]]:
        """Yields the target's tokens, a block per round. The caller stops iterating when done."""
        self.shared.active += 1
        try:
            t0 = time.perf_counter()
            self.shared.prefilling += 1
            self.shared.prefill_epoch += 1
            try:
                first, _ = await asyncio.gather(self.c.verify(self._verify(self.prompt, [])), self._warm_drafter())
            finally:
                self.shared.prefilling -= 1
                self.shared.prefill_epoch += 1
            self.shared.policy.model.observe_timing("target", first.timing)
            self.stats.prefill_s = time.perf_counter() - t0
            prefix = self.prompt + [first.token]
            self.round += 1
            self.stats.new_tokens = 1
            yield [first.token]
            t_dec = time.perf_counter()
            async for block in self._rounds(prefix):
                self.stats.decode_s = time.perf_counter() - t_dec
                self.stats.new_tokens += len(block)
                yield block
        finally:
            self.shared.active -= 1

    async def take(self, n: int) -> list[int]:
        """The first ``n`` tokens, with no stop conditions (tests and tools that want exactly
        ``n``), then frees the sequence in the engines."""
        out: list[int] = []
        agen = self.run()
        try:
            async for block in agen:
                out += block
                if len(out) >= n:
                    break
        finally:
            await agen.aclose()
            await self.c.release(self.seq_id)
        return out[:n]

    # -- drafting ----------------------------------------------------------------------------------
    async def _warm_drafter(self) -> None:
        """The drafter prefills the prompt on its own core while the target prefills it on its
        own. Left to the first draft or speculation, that prefill stalled a whole batch's round
        on the drafter (every request joining a 16-user batch). A failure here is left for those
        calls to meet (and degrade on)."""
        if self.cfg.mode == "ar" or not self.drafter_ok:
            return
        try:
            await self.c.draft(DraftCall(self.seq_id, self.prompt, 0, self.params, self.seed, 0))
        except Exception:  # noqa: BLE001
            pass

    def _degrade(self, what: str, err: Exception) -> None:
        """A drafter failure costs speed, never correctness: drafts come from the n-gram backup
        (or nothing) from now on; the target alone decides every token either way."""
        self.drafter_ok = False
        self.stats.degraded = f"{what} failed ({type(err).__name__}: {err}); continuing without the drafter"

    async def _fast_draft(self, prefix) -> DraftResult:
        t0 = time.perf_counter()
        try:
            d = await self.c.fast_draft(self._draft_call(prefix, []))
        except Exception:  # noqa: BLE001 - no backup either: an AR step (empty draft)
            return DraftResult([], None)
        self.shared.policy.model.t_fast.update(time.perf_counter() - t0)
        return d

    async def _neural_draft(self, prefix, fanout, c) -> tuple[DraftResult, str]:
        if not self.drafter_ok:
            return await self._fast_draft(prefix), "fast"
        try:
            d = await self.c.draft(self._draft_call(prefix, fanout, c))
        except Exception as e:  # noqa: BLE001
            self._degrade("draft", e)
            return await self._fast_draft(prefix), "fast"
        self.shared.policy.model.observe_timing("drafter", d.timing)
        return d, "neural"

    async def _draft_for(self, d: Decision, prefix, fanout) -> tuple[DraftResult, str]:
        """The draft of a round that has no cached speculation: SD's, or an SSD backup's."""
        t0 = time.perf_counter()
        if d.mode == "sd":
            draft, source = await self._neural_draft(prefix, [], 1.0)
            source = "draft" if source == "neural" else source
            self.stats.t_draft += time.perf_counter() - t0
            return draft, source
        self.stats.backup_reasons[f"{d.backup}: {d.reason}"] += 1
        if d.backup == "fast":
            draft, source = await self._fast_draft(prefix), "fast"
        else:
            draft, source = await self._neural_draft(prefix, fanout, self.cfg.saguaro_c)
        self.stats.t_backup += time.perf_counter() - t0
        return draft, source

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

    def _decide(self, k_max: int) -> Decision:
        """This round's choice and K. An ssd request with ``adaptive_k`` lets the policy pick each
        choice's K up to the request's (``SpeedupModel.best_k``); sd and ar requests are baselines
        and draft exactly the K they asked for (lowered only by ``SharedState.round_k``)."""
        cfg, pol, active = self.cfg, self.shared.policy, self.shared.active
        allowed = cfg.allowed()
        if not self.drafter_ok:  # only the target and the n-gram backup are left
            allowed = ("ar",) if cfg.mode == "ar" else ("ssd+fast", "ar")
        adaptive = cfg.adaptive_k and cfg.mode == "ssd"
        budget = cfg.fanout_budget if adaptive else pol.model.tree_budget(active, k_max, cfg.fanout_budget)
        d = pol.choose(active, k_max, budget, allowed, self.seq_id, adaptive_k=adaptive)
        self.k = min(d.ks.get(d.choice, k_max), k_max) if adaptive else k_max
        if not self.drafter_ok:
            d.reason = "drafter down"
        return d

    # -- the rounds ---------------------------------------------------------------------------------
    async def _rounds(self, prefix):
        cfg, est, pol = self.cfg, self.shared.estimator, self.shared.policy
        cached: DraftResult | None = None  # this round's draft, pre-drafted by the last speculation
        while True:
            t_round, mark = time.perf_counter(), self.shared.prefill_mark()
            d = self._decide(self.shared.round_k(cfg.k))
            budget = pol.model.tree_budget(self.shared.active, self.k, cfg.fanout_budget)
            self.stats.record_decision(d.choice, d.reason, d.rates, 0 if d.mode == "ar" else self.k)
            fanout = allocate(cfg.fanout_shape, self.k, budget, est)
            if d.mode == "ar":
                draft, source = DraftResult([], None), "none"
            elif cached is not None:
                # pre-drafted at last round's K: a prefix of it is as good a draft at a lower K
                draft, source = _truncate(cached, self.k), "cache"
            else:
                draft, source = await self._draft_for(d, prefix, fanout)
            speculate = d.mode == "ssd" and self.drafter_ok
            if speculate:
                spec = SpeculateCall(self.seq_id, prefix, draft.tokens, self.k, fanout, self.params, self.seed,
                                     self.round, cfg.saguaro_c)
                (r, tv), spec_out = await self._verify_and_speculate(prefix, draft, spec)
            else:
                (r, tv), spec_out = await _timed(self.c.verify(self._verify(prefix, draft.tokens, draft.probs))), None
            s, tp = spec_out if spec_out is not None else (SpeculateResult({}), 0.0)
            pol.model.observe_timing("target", r.timing)
            pol.model.observe_timing("drafter", s.timing)
            self.stats.t_verify += tv
            self.stats.record_verify_call(tv, r.timing)
            self.stats.t_speculate += tp
            block = draft.tokens[:r.accepted] + [r.token]
            self.stats.record_round(len(block), source)
            if draft.tokens:
                est.record_round(r.accepted, len(draft.tokens))
            self._learn(prefix, block, source, len(draft.tokens))
            key = (r.accepted, r.token)
            hit = key in s.branches
            if speculate:
                self.stats.budgets[budget] += 1
                est.record_lookup(fanout[r.accepted], hit)
                pol.model.observe_lookup(source, hit)
                self.stats.hits += hit
                self.stats.misses += not hit
            self.round += 1
            prefix = prefix + block
            # A round right after a change of choice pays for the change (the drafter catches up on
            # the tokens of the rounds it sat out; SSD's first round has no cached draft): it says
            # what switching costs, not what the choice yields, so the policy does not see it (a
            # move between the SSD choices costs nothing: speedup_model.free_switch). A
            # request's first round and one that another request's prefill overlapped are part of
            # what the choice yields under load, but not of what the formula prices (see
            # ModePolicy.observe_round).
            first = not self.last_choice
            switched = not first and self.last_choice != d.choice and not free_switch(self.last_choice, d.choice)
            self.last_choice = d.choice
            if not switched:
                clean = not first and mark is not None and mark == self.shared.prefill_mark()
                pol.observe_round(d.choice, len(block), time.perf_counter() - t_round, self.shared.active, self.k,
                                  budget, clean, first, source)
            yield block
            cached = None
            if hit and not self.params.greedy:
                try:  # sampled: the verifier needs the q' rows the branch was drawn from
                    cached = DraftResult(s.branches[key], (await self.c.fetch(FetchCall(self.seq_id, key))).probs)
                except Exception as e:  # noqa: BLE001
                    self._degrade("fetch", e)
            elif hit:
                cached = DraftResult(s.branches[key], None)

    def _learn(self, prefix, block, source, drafted: int) -> None:
        """Acceptance per draft source; and what the n-gram backup would have proposed here, scored
        against the target's tokens: its acceptance, measured for free."""
        model = self.shared.policy.model
        guess = propose(prefix, self.k)
        n_ok = next((i for i, (a, b) in enumerate(zip(guess, block)) if a != b), min(len(guess), len(block) - 1))
        model.e_miss["fast"].update(n_ok, max(len(guess), 1))  # no guess: a round of one token
        if source == "cache":
            model.e_hit.update(len(block) - 1, drafted)
        elif source in ("neural", "draft"):
            model.e_miss["neural"].update(len(block) - 1, drafted)
