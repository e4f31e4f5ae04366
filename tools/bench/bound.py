"""The most speculation can give this pair on this machine, from forwards measured in the same run.

The `bound` phase times the served engines' forwards (`measure`: the default's exact target on
llama.cpp and int8 drafter on torch, each at 1 and 2 threads, each in a process of its own, after a
256-token context): the target's forwards of 1 to K + 1 rows (a decode step, a verify), the
drafter's one-row step (and its forwards of up to K + 1 rows, for the table) and its tree steps of
B branch rows. With the acceptance this run measured (SD's tokens a round, `alpha_from`), the cost
model's formulas (ssd/algorithm/cost_model.py) give each choice's tokens/s at batch 1 with nothing
else counted (no Python, no IPC, no sampling, the drafter's catch-up free):

    AR@wide        1 / T2(1)
    SD@wide        E(K) / (K D2(1) + T2(K + 1))
    SD (1+1)       E(K) / (K D1(1) + T1(K + 1))
    SSD (1+1)      E(K) / max(T1(K + 1), D1(1) + K D1tree(B))         every round a hit, B = 1
                   the same + (1 - p) K D1(1) in the denominator       hit rate p measured at B

(SSD's glue pass is one row a round: the drafter ran the draft's other rows while drafting it.)

T: the target's forward, D: the drafter's, by rows, at 1 or 2 threads; E(K) = 1 + a + ... + a^K.
The first four are upper bounds on what each choice serves at batch 1 (SSD's with one branch hitting
every round bounds any fan-out), so the largest over choices and K bounds the served default, and
its ratio to AR@wide bounds what speculation adds to the target's own decoding on these cores.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from ssd.algorithm.estimators import Acceptance
from ssd_tools.bench.plan import SWEEPS_FULL

REPO = Path(__file__).resolve().parents[2]
CONTEXT = 256
K_MAX = 4
# branch rows a tree step: one branch (the bound) and the fan-outs whose hit rates the budget sweep measures
TREES = (1, *(v["fanout_budget"] for v in SWEEPS_FULL["budget"]))


def measure_one(role: str, folder: Path, threads: int, reps: int = 9) -> dict:
    """Median ms of each forward the bound needs, for one engine at one thread count (this process)."""
    from ssd.engine.engine import ExtendCall, TreeCall
    from ssd.engine.meta import engine_meta
    from ssd_tools.bench.engine_rows import round_robin_ms, served_engine

    # as served: the folder's runtime (the default target's is llama.cpp), torch otherwise
    runtime = "llamacpp" if engine_meta(folder).get("runtime") == "llamacpp" else "torch"
    eng = served_engine(runtime, folder, role, threads, 1, CONTEXT + K_MAX + max(TREES) + 8)
    prompt = [1000 + (37 * j) % 20000 for j in range(CONTEXT)]
    eng.extend([ExtendCall("s", prompt, 1)])
    extra = list(range(200, 200 + K_MAX + 1))

    forwards = {("rows", n): (lambda n=n: eng.extend([ExtendCall("s", prompt + extra[:n], n)]))
                for n in range(1, K_MAX + 2)}
    if role == "drafter":
        forwards.update({("tree", b): (lambda b=b: eng.tree([TreeCall("s", [300 + j for j in range(b)], [CONTEXT] * b,
                                                                      [CONTEXT] * b, [-1] * b)])) for b in TREES})
    med = round_robin_ms(forwards, reps, reset=lambda: eng.truncate("s", CONTEXT))
    rows = {n: round(v, 2) for (kind, n), v in med.items() if kind == "rows"}
    trees = {b: round(v, 2) for (kind, b), v in med.items() if kind == "tree"}
    return {"role": role, "threads": threads, "rows": rows, "tree": trees}


def measure(engines: Path, target: str, drafter: str, threads=(1, 2), passes: int = 2) -> dict:
    """{"target": {threads: figures}, "drafter": {...}}, each configuration in a process of its own
    (a thread pool is per process), every configuration once per pass; per forward the lowest of the
    passes' medians (the machine's speed drifts between minutes, and a drift only slows forwards)."""
    out: dict = {"target": {}, "drafter": {}}
    for _ in range(passes):
        for role, name in (("target", target), ("drafter", drafter)):
            for t in threads:
                cmd = [sys.executable, __file__, role, str(engines / name), str(t)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise RuntimeError(f"[bound] {role} at {t} threads failed:\n{proc.stderr[-2000:]}")
                got = json.loads(proc.stdout.strip().splitlines()[-1])
                have = out[role].setdefault(t, got)
                for kind in ("rows", "tree"):
                    have[kind] = {n: min(v, got[kind][n]) for n, v in have[kind].items()}
    return with_int_keys(out)


def with_int_keys(costs: dict) -> dict:
    """``costs`` with its thread counts, row counts and branch counts as ints (JSON makes them strings)."""
    return {role: {int(t): {**f, "rows": {int(n): v for n, v in f["rows"].items()},
                            "tree": {int(b): v for b, v in f["tree"].items()}} for t, f in by_t.items()}
            for role, by_t in costs.items()}


def alpha_from(tokens_per_round: float, k: int) -> float:
    """The per-position acceptance whose E(K) is ``tokens_per_round`` (bisection; E grows with a)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if Acceptance(mid).tokens(k) < tokens_per_round else (lo, mid)
    return (lo + hi) / 2


def rates(costs: dict, a: float, k: int, p_hit: dict | None = None) -> dict[str, float]:
    """Tokens/s of each choice at K (see the top), from ``costs`` as ``measure`` returns them; with
    ``p_hit`` (fan-out B -> the share of rounds that hit, as measured), SSD also with its misses,
    each waiting for the neural backup's K one-row steps."""
    def ms(role: str, threads: int, kind: str, n: int) -> float:
        return costs[role][threads][kind][n] / 1000

    e = Acceptance(a).tokens(k)
    out = {"AR@wide": 1 / ms("target", 2, "rows", 1),
           "SD@wide": e / (k * ms("drafter", 2, "rows", 1) + ms("target", 2, "rows", k + 1)),
           "SD (1+1)": e / (k * ms("drafter", 1, "rows", 1) + ms("target", 1, "rows", k + 1))}
    spec = ms("drafter", 1, "rows", 1) + k * ms("drafter", 1, "tree", 1)
    out["SSD (1+1), all hits, B=1"] = e / max(ms("target", 1, "rows", k + 1), spec)
    for b, p in sorted((p_hit or {}).items()):
        if b in costs["drafter"][1]["tree"]:
            spec = ms("drafter", 1, "rows", 1) + k * ms("drafter", 1, "tree", b)
            miss = (1 - p) * k * ms("drafter", 1, "rows", 1)
            out[f"SSD (1+1), p_hit {p:.2f}, B={b}"] = e / (max(ms("target", 1, "rows", k + 1), spec) + miss)
    return out


def ceiling(costs: dict, a: float, p_hit: dict | None = None, k_max: int = K_MAX) -> dict:
    """Per K the choices' rates; the best of all over AR@wide; SSD's best over SD's (1+1), with
    every round a hit (one branch: the bound) and with the measured hit rates."""
    costs = with_int_keys(costs)
    per_k = {k: rates(costs, a, k, p_hit) for k in range(1, k_max + 1)}
    ar = per_k[1]["AR@wide"]
    best = max(max(r.values()) for r in per_k.values())
    sd = max(r["SD (1+1)"] for r in per_k.values())
    ssd_ub = max(r["SSD (1+1), all hits, B=1"] for r in per_k.values())
    measured = [v for r in per_k.values() for name, v in r.items() if "p_hit" in name]
    return {"alpha": a, "per_k": per_k, "best_over_ar_wide": best / ar, "ssd_over_sd": ssd_ub / sd,
            "ssd_measured_over_sd": max(measured) / sd if measured else None}


def report(costs: dict, a: float, p_hit: dict | None = None, ar2_over_llama: float | None = None) -> str:
    """The ceiling as markdown: the forwards, each choice's bound per K, and the ratios."""
    from ssd_tools import markdown_report as md

    costs = with_int_keys(costs)
    c = ceiling(costs, a, p_hit)
    trees = costs["drafter"][1]["tree"]
    out = [md.table(["forward (ms)", "target 1 thread", "target 2 threads", "drafter 1 thread", "drafter 2 threads"],
                    [[f"{n} row{'s' * (n > 1)}"] + [f"{costs[r][t]['rows'][n]:.1f}" for r in ("target", "drafter")
                                                    for t in (1, 2)] for n in range(1, K_MAX + 2)]
                    + [[f"drafter tree step, {b} rows", "-", "-", f"{trees[b]:.1f}", "-"] for b in trees])]
    names = list(c["per_k"][1])
    out.append(md.table(["K"] + names, [[k] + [f"{r[n]:.1f}" for n in names] for k, r in c["per_k"].items()]))
    text = (f"Tokens/s at batch 1, per-position acceptance a = {a:.3f} (SD's tokens a round in this run). The best "
            f"choice at any K makes at most **{c['best_over_ar_wide']:.2f}x** AR@wide: speculation can lift the "
            "served default no further above the target's own decoding on both cores")
    if ar2_over_llama and not math.isnan(ar2_over_llama):
        text += (f", which runs llama-server's one-row kernel (our AR at 2 threads / llama.cpp's AR in this run: "
                 f"{ar2_over_llama:.2f})")
    text += (f". SSD on a core each makes at most **{c['ssd_over_sd']:.2f}x** SD on the same cores with every round "
             "a hit on a one-branch tree")
    if c["ssd_measured_over_sd"] is not None:
        text += (f", and **{c['ssd_measured_over_sd']:.2f}x** at the hit rates the budget sweep measured (taken "
                 "at every K, though they were measured at the K the scheduler ran: optimistic for longer K)")
    out.append(text + ".")
    return "\n\n".join(out)


if __name__ == "__main__":  # the child: one engine at one thread count, one JSON line
    print(json.dumps(measure_one(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]))), flush=True)
