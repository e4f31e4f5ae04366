"""Sampled SD and SSD emit the target's distribution: exact unit checks plus chi-square tests.

* ``verify`` alone: with scripted uniforms (bisection on u finds the code's own acceptance
  probability) and the residual it actually samples from, the emitted token's law is computed
  exactly and must equal p to 1e-6, for q, Saguaro q' (C = 1, 0.5, 0) and one-hot drafts, at the
  first position and after an accepted one (plus the bonus token after full acceptance).
* End to end: N generations of L tokens from tiny random models (tests/tiny_models.py) through the
  real ``Generation`` loops and workers. Pearson chi-square goodness-of-fit tests per config:
  - the joint law of (t1, t2) against the target's exact law, enumerated (bins with expected
    count < 5 pooled; a token the target gives probability 0 fails at once);
  - randomized PIT of t2..tL: U = F(t-) + V p(t) under the target's p(. | actual prefix), tokens
    ordered by p. Under exactness the U are i.i.d. uniform whatever the block boundaries, so this
    covers later rounds too, where SSD drafts come from the speculation cache;
  - SSD only: the same PIT restricted to tokens of rounds whose draft was a cache hit.
* Negative controls: known-biased verifiers (argmax matching at temperature > 0, no residual) and a
  drafter that reports q instead of the Saguaro q' it sampled from must fail the same tests, same N.

False alarms: each test has level ALPHA = 0.001 (chi-square approximation). The default run has
8 configs: 2 SD x 2 tests + 4 SSD x 3 tests + lookup and switch x 2 tests = 20 tests, so the
family-wise false-alarm rate is <= 20 x 0.001 = 2% (union bound); SSD_EXACTNESS_FULL=1 (all 6
(C, backup) pairs under both sampling settings, 44 tests) gives <= 4.4%. Seeds are fixed, so CI is deterministic: these rates
are about the sampling process, i.e. the chance that another choice of seeds would flag a correct
implementation. SSD_EXACTNESS_N raises N for a deeper local check.
"""
from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch
from scipy import stats

from ssd.algorithm import verification
from ssd.algorithm.scheduler import Scheduler
from ssd.algorithm.stats import RequestStats
from ssd.algorithm.suffix_cache import SuffixCache
from ssd.algorithm.sampling import SamplingParams, probs_from_logits, sample, saguaro
from ssd.algorithm.verification import Outcome
from ssd.decoding.coalescer import CoalescingClient
from ssd.decoding.generator import DecodeConfig, Generation, SharedState
from ssd.decoding.local_client import LocalClient
from ssd.engine.engine import ExtendCall, TorchEngine
from ssd.workers import drafter as drafter_mod, target as target_mod
from ssd.workers.drafter import DrafterWorker
from ssd.workers.fast_backup import NgramWorker
from ssd.workers.target import TargetWorker

from policy_setup import CyclingPolicy
from tiny_models import load_weights, make_tiny_engine

ALPHA = 1e-3
N = int(os.environ.get("SSD_EXACTNESS_N", "1000"))  # generations per config (CI: ~2 min budget)
L = 5  # tokens per generation: t1 (prefill) + t2..t5 (rounds 1-3: cache hits happen from round 2)
K = 2
FANOUT = 8  # speculation budget: 2-3 pre-drafted outcomes per accepted length (enough hits)
V = 16
PROMPT = [3, 7, 1, 12]
T1 = SamplingParams(temperature=1.0)
TK = SamplingParams(temperature=0.7, top_p=0.9, top_k=8)
# (mode, params, saguaro C, backup). By default every C, both backups under each sampling setting;
# C = 0 with the neural backup runs in the q-not-q' negative control.
CONFIGS = [("sd", T1, 1.0, "auto"), ("sd", TK, 1.0, "auto"),
           ("ssd", T1, 1.0, "neural"), ("ssd", T1, 0.5, "fast"), ("ssd", TK, 0.5, "neural"), ("ssd", TK, 0.0, "fast")]
if os.environ.get("SSD_EXACTNESS_FULL") == "1":
    CONFIGS[2:] = [("ssd", p, c, b) for p in (T1, TK) for c in (1.0, 0.5, 0.0) for b in ("neural", "fast")]
# "lookup": every round drafts from free drafts (the sequence and a suffix cache of the earlier
# generations); "switch": an ssd request whose policy changes the choice every round (ssd+neural,
# sd, ssd+fast, lookup, ar)
CONFIGS.append(("lookup", TK, 1.0, "auto"))  # its drafts depend on which generations finished first: not seed-deterministic
CONFIGS.append(("switch", T1, 0.5, "auto"))
SWITCH_ORDER = ["ssd+neural", "ssd+neural", "sd", "ssd+fast", "lookup", "ssd+neural", "ar", "sd", "lookup", "ssd+neural"]


SWITCH_KS = [3, 1, 2, 3, 2]  # and K with it (a cached draft cut to a shorter K, a short one at a longer K)


# ------------------------------------------------------------------ fixtures and helpers
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: thread pools only add overhead (and contention)
    root = tmp_path_factory.mktemp("tiny")
    t = make_tiny_engine(root / "target", seed=1, logit_scale=0.2)
    d = make_tiny_engine(root / "drafter", seed=2, logit_scale=0.2, base=load_weights(t), noise=0.8)
    # the oracle is a separate engine: fresh prefills only, so it shares no KV reuse/rollback path
    yield {k: TorchEngine(f, dtype="float32") for k, f in (("target", t), ("drafter", d), ("oracle", t))}
    torch.set_num_threads(threads)


def next_probs(engine: TorchEngine, contexts: list[list[int]], params: SamplingParams, n_logits: int = 1) -> torch.Tensor:
    """[len(contexts), n_logits, V]: p(. | each of the last n_logits prefixes), fresh prefills."""
    out = []
    for s in range(0, len(contexts), 64):
        chunk = contexts[s:s + 64]
        logits = engine.extend([ExtendCall(f"oracle-{i}", c, n_logits) for i, c in enumerate(chunk)])
        out += [probs_from_logits(lg, params) for lg in logits]
        for i in range(len(chunk)):
            engine.release(f"oracle-{i}")
    return torch.stack(out)


def joint_truth(engine: TorchEngine, params: SamplingParams) -> np.ndarray:
    p1 = next_probs(engine, [PROMPT], params)[0, 0]
    p2 = next_probs(engine, [PROMPT + [a] for a in range(V)], params)[:, 0]
    return (p1[:, None] * p2).double().numpy()


def pooled_chisquare(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson chi-square p-value; bins with expected < 5 pooled into one (then into the smallest)."""
    observed, expected = observed.ravel().astype(float), expected.ravel().astype(float)
    if observed[expected <= 0].sum() > 0:  # a token the target can never emit
        return 0.0
    expected = expected * observed.sum() / expected.sum()
    big = expected >= 5
    obs, exp = list(observed[big]), list(expected[big])
    rest_o, rest_e = observed[~big].sum(), expected[~big].sum()
    if rest_e >= 5:
        obs, exp = obs + [rest_o], exp + [rest_e]
    elif rest_e > 0:  # still too small pooled: fold it into the smallest bin
        i = int(np.argmin(exp))
        obs[i], exp[i] = obs[i] + rest_o, exp[i] + rest_e
    return float(stats.chisquare(obs, exp).pvalue)


def pit_uniforms(engine: TorchEngine, seqs: list[list[int]], params: SamplingParams) -> np.ndarray:
    """[n, L-1] randomized PIT of t2..tL under p(. | actual prefix); NaN where p(token) = 0."""
    p = next_probs(engine, [PROMPT + s[:-1] for s in seqs], params, n_logits=L - 1).double()
    toks = torch.tensor([s[1:] for s in seqs])
    order = torch.argsort(-p, dim=-1, stable=True)  # likely tokens first: a tilt shows up as a slope
    rank = torch.argsort(order, dim=-1).gather(-1, toks[..., None])[..., 0]
    p_sorted = p.gather(-1, order)
    before = (p_sorted.cumsum(-1) - p_sorted).gather(-1, rank[..., None])[..., 0]
    p_tok = p.gather(-1, toks[..., None])[..., 0]
    jitter = torch.rand(p_tok.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    u = (before + jitter * p_tok).clamp(0, 1 - 1e-12)
    return torch.where(p_tok > 0, u, float("nan")).numpy()


def uniform_pvalue(u: np.ndarray, bins: int) -> float:
    if np.isnan(u).any():  # a token the target can never emit
        return 0.0
    counts = np.bincount((u * bins).astype(int), minlength=bins)
    return pooled_chisquare(counts, np.full(bins, len(u) / bins))


def from_cache(st: RequestStats) -> list[bool]:
    """Per token t2..tL: whether its round's draft came from the speculation cache."""
    out = [src == "cache" for n, src in zip(st.tokens_per_round, st.source_per_round) for _ in range(n)]
    return out[:L - 1]


def generate(tiny: dict, mode: str, params: SamplingParams, c: float, backup: str, seed0: int,
             tag: str, n: int = N, width: int = 32) -> tuple[list[list[int]], list[RequestStats]]:
    """n generations of L tokens (seeds seed0..seed0+n-1), width of them in flight at a time."""
    shared = SharedState()
    # concurrent generations share batched worker calls through the server's own round barrier
    client = CoalescingClient(LocalClient(TargetWorker(tiny["target"]), DrafterWorker(tiny["drafter"]), NgramWorker()),
                              expected=lambda: shared.active)
    cfg = DecodeConfig(mode="ssd" if mode in ("switch", "lookup") else mode, k=K, fanout_budget=FANOUT,
                       saguaro_c=c, backup=backup, step_aside=mode in ("switch", "lookup"))
    if mode in ("switch", "lookup"):
        shared.free_drafts, shared.suffix_cache = True, SuffixCache(65536)
    if mode == "switch":
        shared.policy = CyclingPolicy(SWITCH_ORDER, SWITCH_KS)
    if mode == "lookup":
        shared.policy = Scheduler(forced_mode="lookup")

    async def one(i: int, sem: asyncio.Semaphore):
        async with sem:
            g = Generation(client, f"{tag}-{i}", list(PROMPT), params, seed0 + i, cfg, shared)
            return await g.take(L), g.stats

    async def main():
        sem = asyncio.Semaphore(width)
        return await asyncio.gather(*(one(i, sem) for i in range(n)))

    res = asyncio.run(main())
    return [s for s, _ in res], [st for _, st in res]


def pvalues(tiny: dict, seqs: list[list[int]], st: list[RequestStats], params: SamplingParams) -> dict[str, float]:
    counts = np.zeros((V, V))
    np.add.at(counts, ([s[0] for s in seqs], [s[1] for s in seqs]), 1)
    u = pit_uniforms(tiny["oracle"], seqs, params)
    out = {"joint t1,t2": pooled_chisquare(counts, joint_truth(tiny["oracle"], params)),
           f"PIT t2..t{L}": uniform_pvalue(u.ravel(), 20)}
    # tokens of cache-hit rounds alone: whether a round uses the cache is fixed before its verify, so
    # this selection keeps them i.i.d. uniform, and a bias of the cache path is not diluted
    cached = u[np.array([from_cache(s) for s in st])]
    if len(cached) >= 100:
        out["PIT cache tokens"] = uniform_pvalue(cached, 10)
    return out


# ------------------------------------------------------------------ unit tests
def test_probs_from_logits_matches_reference():
    g = torch.Generator().manual_seed(0)
    for params in (T1, TK, SamplingParams(0.5, 0.6, 0), SamplingParams(1.3, 0.95, 3)):
        logits = torch.randn(5, V, generator=g) * 3
        for row, got in zip(logits.tolist(), probs_from_logits(logits, params).tolist()):
            x = [v / params.temperature for v in row]
            keep = sorted(range(V), key=lambda i: -x[i])[: params.top_k or V]
            w = {i: np.exp(x[i] - max(x)) for i in keep}
            z = sum(w.values())
            kept, mass = [], 0.0
            for i in sorted(w, key=lambda i: -w[i]):  # nucleus: smallest prefix reaching top_p
                if mass >= params.top_p:
                    break
                kept.append(i)
                mass += w[i] / z
            ref = np.zeros(V)
            ref[kept] = [w[i] for i in kept]
            np.testing.assert_allclose(got, ref / ref.sum(), atol=1e-6)


def test_tiny_models_are_non_degenerate(tiny):
    for params in (T1, TK):
        ctx = [PROMPT] + [PROMPT + [a] for a in range(V)]
        p = next_probs(tiny["oracle"], ctx, params)[:, 0]
        q = next_probs(tiny["drafter"], ctx, params)[:, 0]
        ent = -(p * p.clamp_min(1e-30).log()).sum(-1)
        assert 0.1 * np.log(V) < float(ent.mean()) < 0.95 * np.log(V), ent
        assert float((p[1:] - p[1:].mean(0)).abs().sum(-1).mean()) > 0.2  # p depends on the context
        acc = float(torch.minimum(p, q).sum(-1).mean())  # per-token acceptance of the drafter
        assert 0.2 < acc < 0.8, acc


class _ScriptedTorch:
    """Stands in for ``torch`` inside verification: rand() returns scripted uniforms."""

    def __init__(self):
        self.us: list[float] = []

    def rand(self, *args, **kwargs) -> torch.Tensor:
        return torch.tensor(self.us.pop(0), dtype=torch.float64)

    def __getattr__(self, name: str):
        return getattr(torch, name)


@pytest.mark.parametrize("params", [T1, TK], ids=["t1", "t0.7-k8-p0.9"])
@pytest.mark.parametrize("c", [1.0, 0.5, 0.0, None], ids=["C1", "C0.5", "C0", "onehot"])
def test_verify_emits_target_distribution_exactly(monkeypatch, params, c):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g) * 2  # target rows for positions 0, 1 and the bonus
    p = probs_from_logits(logits, params).double()
    q = probs_from_logits(logits[:2] + torch.randn(2, V, generator=g), params)  # a drafter that half agrees
    if c is not None:  # Saguaro q' over the drafter's top-3 per row, as the drafter sends it
        q = torch.stack([saguaro(r, torch.topk(r, 3).indices, c) for r in q])
    scripted, sampled = _ScriptedTorch(), []
    monkeypatch.setattr(verification, "torch", scripted)
    monkeypatch.setattr(verification, "sample", lambda probs, gen: sampled.append(probs.double()) or -1)

    def run(draft: list[int], us: list[float]) -> Outcome:
        scripted.us, sampled[:] = list(us), []
        return verification.verify(logits, draft, None if c is None else q[:len(draft)], params, g)

    def emitted(prefix: list[int], d: int) -> torch.Tensor:
        """Exact law of the token emitted at position len(prefix) when the prefix was accepted."""
        j = len(prefix)
        acc = [run(prefix + [d], [0.0] * j + [u]).accepted > j for u in np.linspace(0, 1, 65)[:-1]]
        assert acc == sorted(acc, reverse=True), "acceptance must be a threshold on u"
        lo, hi = 0.0, 1.0  # bisection: P(accept) = sup{u : accepted}, to 2^-50 (u=1 never drawn)
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if run(prefix + [d], [0.0] * j + [mid]).accepted > j else (lo, mid)
        a = hi if acc[0] else 0.0
        out = torch.zeros(V, dtype=torch.float64)
        out[d] = a
        last = run(prefix + [d], [0.0] * j + [np.nextafter(1.0, 0.0)])  # the largest u
        if a < 1.0:  # rejected there: the sample taken is the residual
            assert last.accepted == j
            out += (1 - a) * sampled[-1]
        else:  # accepted for sure: the next sample must be the bonus, from p[j + 1]
            assert last.accepted == j + 1
            torch.testing.assert_close(sampled[-1], p[j + 1], atol=1e-7, rtol=0)
        return out

    d0 = int(torch.argmax(p[0] * (1.0 if c is None else q[0].double())))  # a draft that can be accepted
    assert p[0, d0] > 0 and (c is None or q[0, d0] > 0)
    for prefix in ([], [d0]):  # position 0, and position 1 after accepting d0
        j = len(prefix)
        if c is None:  # one-hot q': each deterministic draft on its own must be exact
            for d in range(V):
                torch.testing.assert_close(emitted(prefix, d), p[j], atol=1e-6, rtol=0)
        else:
            mix = sum(float(q[j, d]) * emitted(prefix, d) for d in range(V) if q[j, d] > 0)
            torch.testing.assert_close(mix, p[j], atol=1e-6, rtol=0)


# ------------------------------------------------------------------ end to end
@pytest.mark.parametrize("mode,params,c,backup", CONFIGS,
                         ids=[f"{m}-{'t1' if p is T1 else 'tk'}-C{c}-{b}" for m, p, c, b in CONFIGS])
def test_sampled_output_follows_target(tiny, mode, params, c, backup):
    seed0 = 100_000 * (1 + CONFIGS.index((mode, params, c, backup)))
    seqs, st = generate(tiny, mode, params, c, backup, seed0, tag=f"{mode}{c}{backup}")
    # the speculative path was exercised: drafts both accepted and rejected
    accepted = [t - 1 for s in st for t, src in zip(s.tokens_per_round, s.source_per_round) if src != "none"]
    assert sum(a > 0 for a in accepted) > N // 10 and sum(a < K for a in accepted) > N // 10
    sources = [src for s in st for src in s.source_per_round]
    if mode == "ssd":  # cache hits feed tokens in the window, and misses call the chosen backup
        assert sources.count("cache") > N // 20 and sources.count(backup) > N
        assert sum(s.hits for s in st) > N // 20 and sum(s.misses for s in st) > N // 20
    if mode == "switch":  # every kind of round ran, cache hits included
        assert all(sources.count(src) > N // 20 for src in ("cache", "neural", "fast", "draft", "lookup", "none"))
    if mode == "lookup":  # free drafts, from the suffix cache of earlier generations too
        assert set(sources) == {"lookup"}
    ps = pvalues(tiny, seqs, st, params)
    assert mode != "ssd" or "PIT cache tokens" in ps
    hits, misses = sum(s.hits for s in st), sum(s.misses for s in st)
    print(f"\n{mode} {params} C={c} {backup}: hits={hits} misses={misses} "
          f"rounds={len(accepted)} mean accepted={np.mean(accepted):.2f}: "
          + ", ".join(f"p({k})={v:.4g}" for k, v in ps.items()))
    assert min(ps.values()) > ALPHA, ps


def _biased_verify(kind: str):
    """Known-biased verifiers. argmax-match: greedy matching while sampling (accept iff the draft is
    the target's argmax). no-residual: the right accept test, but t* ~ p instead of max(0, p - q')."""
    def verify(target_logits, draft, draft_probs, params, generator) -> Outcome:
        p = probs_from_logits(target_logits, params)
        for j, d in enumerate(draft):
            q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
            u = float(torch.rand((), generator=generator))
            if (d != int(p[j].argmax())) if kind == "argmax-match" else (u >= min(1.0, float(p[j, d]) / q_d)):
                return Outcome(j, sample(p[j], generator))
        return Outcome(len(draft), sample(p[len(draft)], generator))
    return verify


def _pick_reporting_q(logits, params, top_f, c, g):
    """Drafter bug: samples from Saguaro q' but reports the unshaped q to the verifier."""
    q = probs_from_logits(logits[None], params)[0]
    q_shaped = saguaro(q, torch.topk(q, top_f).indices, c) if c < 1.0 and top_f > 0 else q
    return sample(q_shaped, g), q


BUGS = {"argmax-match": ("sd", 1.0, "auto", target_mod, "verify", _biased_verify("argmax-match")),
        "no-residual": ("sd", 1.0, "auto", target_mod, "verify", _biased_verify("no-residual")),
        "lookup-no-residual": ("lookup", 1.0, "auto", target_mod, "verify", _biased_verify("no-residual")),
        "q-not-q'": ("ssd", 0.0, "neural", drafter_mod, "_pick", _pick_reporting_q)}


@pytest.mark.parametrize("bug", list(BUGS))
def test_biased_sampler_is_caught(tiny, monkeypatch, bug):
    mode, c, backup, owner, name, replacement = BUGS[bug]
    monkeypatch.setattr(owner, name, replacement)
    seqs, st = generate(tiny, mode, T1, c, backup, seed0=5_000_000, tag=f"bug-{bug}")
    ps = pvalues(tiny, seqs, st, T1)
    print(f"\nnegative control {bug}: " + ", ".join(f"p({k})={v:.3g}" for k, v in ps.items()))
    assert min(ps.values()) < ALPHA  # the same tests that must pass for the exact samplers
