"""The per-request decoding loops: AR, SD and SSD, over any WorkerClient.

All three start with the same prefill (a verify with an empty draft), so the first token and every
later greedy token are the target's own; they differ only in where the drafts come from:
- ar:  no draft; one target step per token.
- sd:  the drafter drafts K tokens, then the target verifies them (serially).
- ssd: verify(round T) and speculate(round T+1 for likely outcomes) run at the same time in two
       processes; a cache hit starts the next round at once, a miss calls a backup (neural drafter
       or n-gram) chosen by the scheduler for the current batch size.
- lookup: SD whose drafts are free (free_drafts.py: the sequence's own text and the suffix cache
       of earlier requests), verified by the target alone; a round of an ssd request.
One loop runs them all, as gpt-fast's speculative loop does: decide, draft, verify, accept, record.
Each round asks the scheduler what to run (a request in mode "ssd" with step_aside lets it pick
SSD, SD or AR per round; "ar" and "sd" requests are pinned) and hands one RoundRecord to the
server's learner. Every round is a complete lossless verification whatever produced its draft, so
switching between rounds is exact.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Protocol

from ..algorithm.fanout import FanoutEstimator, allocate
from ..algorithm.lookup_estimate import LookupOutlook
from ..algorithm.ngram import propose
from ..algorithm.rounds import Choice, Learner, RoundRecord
from ..algorithm.sampling import SamplingParams
from ..algorithm.scheduler import Decision, Scheduler
from ..algorithm.stats import RequestStats
from ..algorithm.suffix_cache import SuffixCache
from ..config import DecodeConfig
from ..workers.protocol import (DraftCall, DraftResult, FetchCall, SpeculateCall, SpeculateResult,
                                VerifyCall, VerifyResult)
from .free_drafts import LookupRounds, agreeing

class WorkerClient(Protocol):
    async def verify(self, call: VerifyCall) -> VerifyResult: ...
    async def draft(self, call: DraftCall) -> DraftResult: ...
    async def speculate(self, call: SpeculateCall) -> SpeculateResult: ...
    async def fetch(self, call: FetchCall) -> DraftResult: ...
    async def fast_draft(self, call: DraftCall) -> DraftResult: ...
    async def release(self, seq_id: str) -> None: ...


@dataclass
class SharedState:
    """Server-wide state every request learns from (and feeds)."""

    policy: Scheduler = field(default_factory=Scheduler)
    # the fan-out's acceptance is the cost model's, read where the fan-out is allocated
    estimator: FanoutEstimator = field(init=False)
    # sequences currently decoding: the batch size the scheduler plans for, the coalescer's expected
    # callers and the server's admission count; Generation.run keeps it, ``on_active`` hears each change
    active: int = 0
    on_active: Callable[[int], None] | None = None
    # Verify rows the target runs at one tile's cost (0: no limit). The batch-invariant CPU target
    # runs its GEMMs in tiles of up to 32 rows: 8 sequences x (K=4 + 1) = 40 rows cost two tiles,
    # ~1.5x of 32 rows for 10% more tokens. So a round's K is lowered until b (K + 1) fits (never
    # below 1): every round is verified in full whatever its K, so this is exact.
    max_verify_rows: int = 0
    # threads of a wide round (Choice.wide: the engine at work on every core); 0: split rounds only
    wide_threads: int = 0
    # AR steps one target call may take for the whole batch (ServerConfig.ar_steps)
    ar_steps: int = 1
    # per decoding sequence: (tokens its drafter cache lacks, tokens it still has to make)
    backlog: dict = field(default_factory=dict)
    # free drafts (lookup rounds) offered to ssd requests, their longest draft, and the suffix cache
    # of earlier requests' text they also draft from (None: each request's own text only)
    free_drafts: bool = False
    lookup_max_k: int = 31
    suffix_cache: SuffixCache | None = None
    # per decoding sequence: how its free drafts fare (the lookup rounds' price is per request)
    lookup: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.estimator = FanoutEstimator(acceptance=lambda: self.policy.model.drafter_alpha())

    def add_active(self, n: int) -> None:
        self.active += n
        if self.on_active is not None:
            self.on_active(self.active)

    @property
    def learner(self) -> Learner:
        return Learner(self.policy, self.estimator)

    def catch_up(self) -> tuple[int, float]:
        """The batch's drafter backlog (rows a drafting round first runs) and the mean tokens its
        sequences have left: what a switch into drafting costs and the tokens it has to pay off."""
        if not self.backlog:
            return 0, 0.0
        owed = sum(o for o, _ in self.backlog.values())
        return owed, sum(left for _, left in self.backlog.values()) / len(self.backlog)

    def lookup_outlook(self) -> LookupOutlook:
        """The batch's free-draft outlook, its longest draft capped where the verify rows are."""
        k_max = self.lookup_max_k
        if self.max_verify_rows > 0:
            k_max = max(1, min(k_max, self.max_verify_rows // max(self.active, 1) - 1))
        return LookupOutlook.mean([e.outlook() for e in self.lookup.values()], k_max)

    def round_k(self, k: int) -> int:
        if self.max_verify_rows <= 0:
            return k
        return max(1, min(k, self.max_verify_rows // max(self.active, 1) - 1))


UNBOUNDED_TOKENS_LEFT = 128  # what a request without max_tokens is taken to have left (the server's default)


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
                 seed: int, cfg: DecodeConfig, shared: SharedState | None = None, max_tokens: int = 0):
        cfg.validate()
        self.max_tokens = max_tokens  # the request's (0: no limit); an AR round never decodes past it
        self.c, self.seq_id, self.prompt, self.params, self.seed, self.cfg = client, seq_id, prompt, params, seed, cfg
        self.shared = shared or SharedState()
        self.stats = RequestStats(mode=cfg.mode, draft_len=0 if cfg.mode == "ar" else cfg.k)
        self.round = 0
        self.k = cfg.k  # this round's draft length (SharedState.round_k, CostModel.best_k)
        self.drafter_ok = True
        self.last_choice: Choice | None = None  # the previous round's
        self.drafter_len = 0  # tokens of this sequence the drafter's cache holds
        self.threads = 0  # this round's layout (VerifyCall.threads): 0 split, else wide
        self.sequence = list(prompt)  # prompt and output so far: what the suffix cache keeps at the end
        self.lookup = LookupRounds(self.shared.suffix_cache, self.shared.lookup_max_k)

    def _verify(self, prefix, draft, probs=None, steps: int = 1) -> VerifyCall:
        return VerifyCall(self.seq_id, prefix, draft, self.params, self.seed, self.round, probs, self.threads, steps)

    def _ar_steps(self) -> int:
        """Steps of this AR round: the batch's sequences share a call's round trip, so together
        they take about ``ar_steps`` steps a call; never past the request's max_tokens."""
        steps = -(-self.shared.ar_steps // max(self.shared.active, 1))
        left = self.max_tokens - self.stats.new_tokens if self.max_tokens else steps
        return max(1, min(steps, left))

    def _draft_call(self, prefix, fanout, c=1.0) -> DraftCall:
        return DraftCall(self.seq_id, prefix, self.k, self.params, self.seed, self.round, c, fanout, self.threads)

    async def run(self) -> AsyncIterator[list[int]]:
        """Yields the target's tokens, a block per round. The caller stops iterating when done."""
        self.shared.add_active(1)
        self.shared.lookup[self.seq_id] = self.lookup.estimate
        try:
            t0 = time.perf_counter()
            first = await self._prefill()
            self.stats.prefill_s = time.perf_counter() - t0
            self.stats.prompt_tokens, self.stats.cached_prompt_tokens = len(self.prompt), first.cached_tokens
            prefix = self.prompt + [first.token]
            self.sequence = prefix
            self.round += 1
            self.stats.new_tokens = 1
            yield [first.token]
            t_dec = time.perf_counter()
            async for block in self._rounds(prefix):
                self.stats.decode_s = time.perf_counter() - t_dec
                self.stats.new_tokens += len(block)
                yield block
        finally:
            self.shared.backlog.pop(self.seq_id, None)
            self.shared.lookup.pop(self.seq_id, None)
            if self.shared.suffix_cache is not None and self.cfg.free_drafts:
                self.shared.suffix_cache.add(self.sequence)
            self.shared.add_active(-1)

    async def take(self, n: int) -> list[int]:
        """The first ``n`` tokens, with no stop conditions (tests and tools that want exactly
        ``n``), then frees the sequence in the engines."""
        out: list[int] = []
        self.max_tokens = self.max_tokens or n
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

    # -- the rounds: draft, verify, accept, record ----------------------------------------------------
    async def _rounds(self, prefix):
        cached: DraftResult | None = None  # this round's draft, pre-drafted by the last speculation
        while True:
            t0, batch = time.perf_counter(), self.shared.active
            self._report_backlog(len(prefix))
            d = self._decide(self.shared.round_k(self.cfg.k))
            if d.choice.uses_drafter:  # this round's draft or speculation brings the drafter up to the prefix
                self.drafter_len = len(prefix)
            budget = self.shared.policy.model.tree_budget(batch, self.k, self.cfg.fanout_budget)
            fanout = allocate(self.cfg.fanout_shape, self.k, budget, self.shared.estimator)
            draft, source, t_draft = await self._draft(d, prefix, fanout, cached)
            steps = self._ar_steps() if d.mode == "ar" else 1
            r, t_verify, spec, t_spec = await self._verify_round(d, prefix, draft, fanout, steps)
            block = draft.tokens[:r.accepted] + r.decoded + [r.token]
            hit = (r.accepted, r.token) in spec.branches if spec is not None else None
            longest = self.lookup.score(prefix, block) if self.shared.free_drafts else []
            # what the fast backup would have drafted (_fast_draft), scored for free
            guess = (longest[:self.k] if self.cfg.free_drafts else []) or propose(prefix, self.k)
            rec = RoundRecord(
                choice=d.choice, reason=d.reason, k=0 if d.mode == "ar" else self.k,
                budget=budget if spec is not None else 0, batch=batch, tokens=len(block), steps=1 + len(r.decoded),
                seconds=time.perf_counter() - t0, source=source, drafted=len(draft.tokens), hit=hit,
                target_timing=tuple(map(tuple, r.timing)),
                drafter_timing=tuple(map(tuple, list(draft.timing) + list(spec.timing if spec else []))),
                verify_seconds=t_verify, speculate_seconds=t_spec, draft_seconds=t_draft,
                prompt_seconds=min(r.prompt_seconds, t_verify), predicted_rate=d.prior.get(d.choice, 0.0),
                ngram_accepted=agreeing(guess, block), ngram_drafted=max(len(guess), 1),
                fanout_at_outcome=fanout[r.accepted] if spec is not None and r.accepted < len(fanout) else 0,
                after_switch=self.last_choice is not None and self.last_choice != d.choice
                and not self.last_choice.switch_is_free(d.choice))
            self.shared.learner.observe(rec)
            self.stats.add(rec, d.rates)
            self.last_choice = d.choice
            self.round += 1 + len(r.decoded)  # an AR round's step s sampled with round + s
            prefix = self.sequence = prefix + block
            yield block
            cached = await self._cached_draft(spec, (r.accepted, r.token)) if hit else None

    def _report_backlog(self, length: int) -> None:
        """What this sequence's drafter lacks of its ``length`` tokens, and the tokens it has left."""
        owed = length - self.drafter_len if self.drafter_ok and self.cfg.mode != "ar" else 0
        left = self.max_tokens - self.stats.new_tokens if self.max_tokens else UNBOUNDED_TOKENS_LEFT
        self.shared.backlog[self.seq_id] = (owed, max(left, 1))

    def _free_drafts(self) -> bool:
        """Whether this request drafts from seen text: the server offers it and the request did not
        opt out (an opted-out request is the served default without free drafts)."""
        return self.shared.free_drafts and self.cfg.free_drafts

    def _decide(self, k_max: int) -> Decision:
        """This round's choice and K. An ssd request with ``adaptive_k`` lets the scheduler pick each
        choice's K up to the request's (``CostModel.best_k``); sd and ar requests are baselines
        and draft exactly the K they asked for (lowered only by ``SharedState.round_k``)."""
        cfg, pol, active = self.cfg, self.shared.policy, self.shared.active
        allowed = self._allowed()
        if not self.drafter_ok:  # only the target, the n-gram backup and free drafts are left
            allowed = ("ar",) if cfg.mode == "ar" else ("ssd+fast", "ar") + tuple(c for c in allowed if "lookup" in c)
        adaptive = cfg.adaptive_k and cfg.mode == "ssd"
        budget = cfg.fanout_budget if adaptive else pol.model.tree_budget(active, k_max, cfg.fanout_budget)
        owed, left = self.shared.catch_up()
        outlook = self.shared.lookup_outlook() if self.shared.free_drafts else None
        d = pol.choose(active, k_max, budget, allowed, self.seq_id, adaptive_k=adaptive, owed_rows=owed,
                       tokens_left=left, lookup=outlook)
        if d.mode == "lookup":  # free drafts run their own K, up to what the verify keeps exact
            self.k = LookupRounds.k(d, pol.model, active, outlook or self.shared.lookup_outlook())
        else:
            self.k = min(d.ks.get(d.choice, k_max), k_max) if adaptive else k_max
        self.threads = self._threads(d.choice)
        if not self.drafter_ok:
            d.reason = "drafter down"
        return d

    def _allowed(self) -> tuple[str, ...]:
        """The choices this request's config allows, the wide ones where the server offers them."""
        return self.cfg.allowed(wide=self.shared.wide_threads > 0, lookup=self.shared.free_drafts)

    def _threads(self, choice: Choice) -> int:
        """VerifyCall.threads for a call in ``choice``'s layout: 0 split, else the wide count."""
        return self.shared.wide_threads if choice.wide else 0

    async def _draft(self, d: Decision, prefix, fanout, cached) -> tuple[DraftResult, str, float]:
        """This round's draft, where it came from and how long drafting took: none for AR, the last
        speculation's when it pre-drafted this outcome (cut to this round's K), else SD's draft or
        the SSD backup's."""
        if d.mode == "ar":
            return DraftResult([], None), "none", 0.0
        if d.mode == "lookup":
            draft, seconds = self.lookup.draft(prefix, self.k)
            return draft, "lookup", seconds
        if cached is not None:
            return _truncate(cached, self.k), "cache", 0.0
        t0 = time.perf_counter()
        if d.mode == "sd":
            draft, source = await self._neural_draft(prefix, [], 1.0)
            source = "draft" if source == "neural" else source
        elif d.backup == "fast":
            draft, source = await self._fast_draft(prefix), "fast"
        else:
            draft, source = await self._neural_draft(prefix, fanout, self.cfg.saguaro_c)
        return draft, source, time.perf_counter() - t0

    async def _verify_round(self, d: Decision, prefix, draft: DraftResult, fanout, steps: int = 1):
        """The target verifies the draft (an AR round: decodes up to ``steps`` tokens); an SSD round
        speculates the next round's outcomes at the same time, in the drafter's process. A failed
        speculation is a miss; a failed verify is fatal.
        Returns (verify result, its seconds, speculation result or None, its seconds)."""
        verify = _timed(self.c.verify(self._verify(prefix, draft.tokens, draft.probs, steps)))
        if d.mode != "ssd" or not self.drafter_ok:
            return (*await verify, None, 0.0)
        spec = SpeculateCall(self.seq_id, prefix, draft.tokens, self.k, fanout, self.params, self.seed,
                             self.round, self.cfg.saguaro_c)
        verify_out, spec_out = await asyncio.gather(verify, _timed(self.c.speculate(spec)), return_exceptions=True)
        if isinstance(verify_out, BaseException):
            raise verify_out
        if isinstance(spec_out, BaseException):
            self._degrade("speculate", spec_out)
            return (*verify_out, None, 0.0)
        return (*verify_out, *spec_out)

    async def _cached_draft(self, spec: SpeculateResult, key) -> DraftResult | None:
        """The pre-drafted branch for the verified outcome; sampled decoding also needs the q' rows
        it was drawn from, which stay on the drafter until asked for."""
        if self.params.greedy:
            return DraftResult(spec.branches[key], None)
        try:
            return DraftResult(spec.branches[key], (await self.c.fetch(FetchCall(self.seq_id, key))).probs)
        except Exception as e:  # noqa: BLE001
            self._degrade("fetch", e)
            return None

    async def _prefill(self) -> VerifyResult:
        """The target prefills the prompt (and gives the first token) in the layout the batch runs
        now: on a split layout the drafter prefills it beside, on its own core; on a wide layout
        the target takes every core (a prompt's GEMMs scale with threads) and the drafter, whose
        threads would contend for them, prefills at its first draft. The layout changes the
        time, not the bits: an exact target computes wide only where its rows keep their bits."""
        self.threads = self.stats.prefill_threads = self._threads(self.shared.policy.running(self._allowed()))
        # reported now: the batch's next decision may come before this request's first round. The
        # prompt is owed until the drafter has it: a split prefill's drafter half may still be queued
        # in the drafter process, and a drafting round would wait behind it
        self._report_backlog(len(self.prompt) + 1)
        first = self.c.verify(self._verify(self.prompt, []))
        if self.threads:
            return await first
        first, _ = await asyncio.gather(first, self._warm_drafter())
        return first

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
            return
        self.drafter_len = len(self.prompt)

    def _degrade(self, what: str, err: Exception) -> None:
        """A drafter failure costs speed, never correctness: drafts come from the n-gram backup
        (or nothing) from now on; the target alone decides every token either way."""
        self.drafter_ok = False
        self.stats.degraded = f"{what} failed ({type(err).__name__}: {err}); continuing without the drafter"

    async def _fast_draft(self, prefix) -> DraftResult:
        """SSD's fast backup after a miss: the lookup branch of the verified outcome, the free draft
        (the prompt, the output and the suffix cache; no model, microseconds, so holding one for
        every outcome costs nothing), else the n-gram worker's prompt lookup. Both are
        deterministic: the verifier's q is one-hot."""
        if self._free_drafts():
            own = self.lookup.up_to(prefix, self.k)
            if own:
                return DraftResult(own, None)
        try:
            return await self.c.fast_draft(self._draft_call(prefix, []))
        except Exception:  # noqa: BLE001 - no backup either: an AR step (empty draft)
            return DraftResult([], None)

    async def _neural_draft(self, prefix, fanout, c) -> tuple[DraftResult, str]:
        if not self.drafter_ok:
            return await self._fast_draft(prefix), "fast"
        try:
            return await self.c.draft(self._draft_call(prefix, fanout, c)), "neural"
        except Exception as e:  # noqa: BLE001
            self._degrade("draft", e)
            return await self._fast_draft(prefix), "fast"

