"""Tables, the correctness pass, the defaults the sweeps choose, and the plots of a bench run."""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from ssd_tools import markdown_report as md
from ssd_tools.bench import bound
from ssd_tools.markdown_report import fmt as _fmt

# (label, source, phase/mode filter)
CONFIGS = [
    ("AR, 1 core", "split", "ar"), ("SD K=4, 1+1 cores (serial)", "split", "sd"),
    ("SSD K=4 B=12, 1+1 cores", "split", "ssd"),
    ("served default: ssd, the scheduler choosing", "split", "default"), ("AR, 2 threads", "shared2", "ar"),
    ("SD K=4, 2 threads", "shared2", "sd"), ("peer K=2, 2 threads", "peer", 2), ("peer K=4, 2 threads", "peer", 4),
    ("in-process AR", "inproc", "ar"), ("in-process SD", "inproc", "sd"), ("in-process SSD", "inproc", "ssd"),
    ("llama.cpp AR, 2 threads", "llamacpp", "ar"), ("llama.cpp spec K=4, 2+2 threads", "llamacpp", "spec"),
]
# ours against llama.cpp's llama-server (tools/bench/llamacpp.py)
OURS = [c for c in CONFIGS if c[1] in ("split", "shared2")]
LLAMACPP = [c for c in CONFIGS if c[1] == "llamacpp"]


def mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.mean(xs) if xs else float("nan")


def greedy_rows(raw: dict, source: str, key) -> list[dict]:
    rows = raw.get(source, [])
    if source == "peer":
        return [r for r in rows if r["mode"] == "assisted" and r["k"] == key]
    if source in ("split", "shared2"):
        return [r for r in rows if r["phase"] == "greedy" and r["mode"] == key]
    return [r for r in rows if r["mode"] == key]


def paired_ratio(num: list[dict], den: list[dict]) -> float:
    """Mean decode tok/s of the ``num`` rows over the ``den`` rows', both over the prompts both ran:
    configurations may cover different prompts (quick runs the 2-thread ones, full the in-process
    twins, on fewer), and one prompt's rate can be twice another's."""
    a, b = ({(r["dataset"], r["prompt"]): r["decode_tokens_per_s"] for r in rows} for rows in (num, den))
    both = a.keys() & b.keys()
    return mean(a[k] for k in both) / mean(b[k] for k in both) if both else float("nan")


def table(raw: dict, dataset: str | None) -> str:
    """Per configuration: its means, and its speed over AR's and SD's on the same prompts."""
    pick = lambda rows: [r for r in rows if dataset is None or r["dataset"] == dataset]  # noqa: E731
    ar, sd = pick(greedy_rows(raw, "split", "ar")), pick(greedy_rows(raw, "split", "sd"))
    out = []
    for label, source, key in CONFIGS:
        rows = pick(greedy_rows(raw, source, key))
        if not rows:
            continue
        p_hit = mean(r.get("p_hit") for r in rows) if key == "ssd" else None
        out.append([label, f"{mean(r['decode_tokens_per_s'] for r in rows):.2f}",
                    f"{mean(r['latency_s'] for r in rows):.1f}", f"{_fmt(paired_ratio(rows, ar))}x",
                    f"{_fmt(paired_ratio(rows, sd))}x", _fmt(mean(r.get("acceptance_length") for r in rows)),
                    _fmt(p_hit), len(rows)])
    return md.table(["configuration", "decode tok/s", "latency s", "vs AR", "vs SD", "accept len", "p_hit", "n"], out)


def _compare(rows: list[dict], ref: dict) -> tuple[int, list[str]]:
    same, firsts = 0, []
    for r in rows:
        a, b = r["ids"], ref[(r["dataset"], r["prompt"])]
        n = min(len(a), len(b))
        if a[:n] == b[:n]:
            same += 1
        else:
            firsts.append(f"{r['dataset']} #{r['prompt']} @ {next(i for i in range(n) if a[i] != b[i])}")
    return same, firsts


def correctness(raw: dict) -> str:
    """Greedy texts of every configuration against AR on the same prompt (served, split layout);
    and SD at 2 threads against AR at 2 threads (the thread count changes the GEMMs' last bits)."""
    ref = {(r["dataset"], r["prompt"]): r["ids"] for r in greedy_rows(raw, "split", "ar")}
    ref2 = {(r["dataset"], r["prompt"]): r["ids"] for r in greedy_rows(raw, "shared2", "ar")}
    out = []
    checks = [(label, source, key, ref) for label, source, key in CONFIGS if not (source == "split" and key == "ar")]
    checks.append(("SD K=4, 2 threads vs AR, 2 threads", "shared2", "sd", ref2))
    ref_llama = {(r["dataset"], r["prompt"]): r["ids"] for r in greedy_rows(raw, "llamacpp", "ar")}
    checks.append(("llama.cpp spec vs llama.cpp AR", "llamacpp", "spec", ref_llama))
    for label, source, key, against in checks:
        rows = [r for r in greedy_rows(raw, source, key) if (r["dataset"], r["prompt"]) in against]
        if rows:
            same, firsts = _compare(rows, against)
            out.append([label, f"{same}/{len(rows)}", ", ".join(firsts) or "-"])
    return md.table(["configuration", "same tokens as AR", "first divergence (dataset #prompt @ token)"], out)


SWEEP_KNOBS = {"k": "num_draft_tokens", "sd_k": "num_draft_tokens", "shape": "fanout_shape", "budget": "fanout_budget",
               "backup": "backup", "c": "saguaro_c", "adaptive_k": "adaptive_k"}


def repeat_spread(raw: dict, sampled: bool = False) -> float | None:
    """How far the shipped SSD configuration's rate moved between its two measurements of each sweep
    prompt (with the main table, then after the sweeps): the mean of |first - again| / their mean,
    greedy or at temperature 0.7 (``sampled``). ``None`` for runs without the repeat."""
    split = raw.get("split", [])
    again = {(r["dataset"], r["prompt"]): r["decode_tokens_per_s"] for r in split
             if r["phase"] == "repeat" and bool(r.get("temperature")) == sampled}
    first = {(r["dataset"], r["prompt"]): r["decode_tokens_per_s"] for r in split
             if r["phase"] == ("t0.7" if sampled else "greedy") and r["mode"] == "ssd"
             and (r["dataset"], r["prompt"]) in again}
    if not again or first.keys() != again.keys():
        return None
    return mean(abs(first[p] - again[p]) / ((first[p] + again[p]) / 2) for p in again)


def sweeps(raw: dict) -> tuple[str, dict]:
    """The sweep tables and each sweep's choice. A sweep compares each value with the shipped one
    (``meta.sweep_defaults``); the greedy SSD sweeps' shipped point is the shared baseline, measured
    twice a prompt. The best value is chosen only when it beats the shipped one by more than the
    baseline's two measurements differed (``repeat_spread``): a smaller gain is this machine's noise."""
    out, chosen = [], {}
    defaults = raw.get("meta", {}).get("sweep_defaults", {})
    spreads = {s: repeat_spread(raw, s) for s in (False, True)}
    by: dict[str, dict] = defaultdict(lambda: defaultdict(list))
    repeats = defaultdict(list)
    for r in raw.get("split", []):
        if r["phase"] == "repeat":
            repeats[bool(r.get("temperature"))].append(r)
        if r["phase"].startswith("sweep:"):
            name = r["phase"].split(":", 1)[1]
            by[name][r.get(SWEEP_KNOBS[name])].append(r)
    for name, variants in by.items():
        default = defaults.get(name)
        sampled = any(r.get("temperature") for rows in variants.values() for r in rows)
        spread = spreads[sampled]  # SD's K sweep: the greedy SSD baseline's spread, the machine's noise
        if name != "sd_k" and default in variants:
            variants[default] = variants[default] + repeats[sampled]
        out.append(f"\n**{name}** ({'SD' if name == 'sd_k' else 'SSD'}, decode tok/s / accept len / p_hit)\n")
        scores, cells = {}, []
        for v, rows in variants.items():
            scores[v] = mean(r["decode_tokens_per_s"] for r in rows)
            cells.append([f"{v} (shipped)" if v == default else str(v), f"{scores[v]:.2f}",
                          f"{mean(r['acceptance_length'] for r in rows):.2f}",
                          _fmt(mean(r["p_hit"] for r in rows)) if name != "sd_k" else "-", len(rows)])
        out.append(md.table(["value", "decode tok/s", "accept len", "p_hit", "n"], cells))
        best = max(scores, key=scores.get)
        if default not in scores or best == default:
            chosen[name] = str(best)
            continue
        gain = scores[best] / scores[default] - 1
        if spread is not None and gain <= spread:
            chosen[name] = f"{default} ({best} ran {gain:+.0%}, within the {spread:.0%} the repeated baseline moved)"
        else:
            chosen[name] = f"{best} ({gain:+.0%} over the shipped {default})"
    moved = [f"{spreads[s]:.0%} {'at temperature 0.7' if s else 'greedy'}" for s in (False, True)
             if spreads[s] is not None]
    if moved:
        out.append(f"\nThe shipped SSD configuration, measured twice on each sweep prompt (with the main table, "
                   f"then after the sweeps), moved {' and '.join(moved)} between its two measurements.")
    return "\n".join(out), chosen


def budget_fit(raw: dict) -> tuple[list, list, float | None, float | None] | None:
    """The budget sweep's mean p_hit per budget and the power law miss = c B^-r fitted to it; r and c
    are None when fewer than two budgets missed a round (a short run can hit every round). None
    without a budget sweep."""
    pts = defaultdict(list)
    for r in raw.get("split", []):
        if r["phase"] == "sweep:budget":
            pts[r["fanout_budget"]].append(r["p_hit"])
    if not pts:
        return None
    bs = sorted(pts)
    hits = [mean(pts[b]) for b in bs]
    usable = [(b, 1 - h) for b, h in zip(bs, hits) if 0 < 1 - h < 1]
    if len(usable) < 2:
        return bs, hits, None, None
    xs, ys = [math.log(b) for b, _ in usable], [math.log(m) for _, m in usable]
    mx, my = mean(xs), mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return bs, hits, -slope, math.exp(my - slope * mx)  # miss ~ c B^-r


def plots(raw: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    datasets = raw["meta"]["datasets"] + ["overall"]
    labels = [c[0] for c in CONFIGS if greedy_rows(raw, c[1], c[2])]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    w = 0.8 / max(len(labels), 1)
    for j, (label, source, key) in enumerate(c for c in CONFIGS if c[0] in labels):
        rows = greedy_rows(raw, source, key)
        vals = [mean(r["decode_tokens_per_s"] for r in rows if ds == "overall" or r["dataset"] == ds) for ds in datasets]
        ax.bar([i + j * w for i in range(len(datasets))], vals, w, label=label)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(datasets))], datasets)
    ax.set_ylabel("decode tokens/s (batch 1, greedy)")
    ax.set_title("Throughput per configuration and dataset")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)
    plt.close(fig)
    made.append("throughput.png")

    fit = budget_fit(raw)
    if fit:
        bs, hits, r, c = fit
        fig, ax = plt.subplots(figsize=(5.5, 4))
        ax.plot(bs, hits, "o", label="measured p_hit")
        if r is not None:
            grid = [bs[0] + (bs[-1] - bs[0]) * i / 50 for i in range(51)]
            ax.plot(grid, [1 - c * b ** -r for b in grid], "-", label=f"fit: miss = {c:.2f} B^-{r:.2f}")
        ax.set_xlabel("fan-out budget B (branches per round)")
        ax.set_ylabel("cache hit rate")
        ax.set_title("Hit rate vs fan-out budget (K=4)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "hit_rate_vs_budget.png", dpi=110)
        plt.close(fig)
        made.append("hit_rate_vs_budget.png")

    sd = {(r["dataset"], r["prompt"]): r for r in greedy_rows(raw, "split", "sd")}
    pts = [(s["speedup_predicted"] / sd[k]["speedup_predicted"], s["decode_tokens_per_s"] / sd[k]["decode_tokens_per_s"])
           for s in greedy_rows(raw, "split", "ssd") if (k := (s["dataset"], s["prompt"])) in sd
           and sd[k]["speedup_predicted"] and sd[k]["decode_tokens_per_s"]]
    if pts:
        fig, ax = plt.subplots(figsize=(5, 4.5))
        ax.plot([p for p, _ in pts], [m for _, m in pts], "o")
        lo, hi = min(min(p) for p in pts) * 0.9, max(max(p) for p in pts) * 1.1
        ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="measured = predicted")
        ax.set_xlabel("SSD/SD predicted by the speedup model")
        ax.set_ylabel("SSD/SD measured (decode tok/s)")
        ax.set_title("Speedup model vs measurement, per prompt")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "ssd_over_sd_predicted_vs_measured.png", dpi=110)
        plt.close(fig)
        made.append("ssd_over_sd_predicted_vs_measured.png")

    crow = defaultdict(list)
    for r in raw.get("split", []):
        if r["phase"] == "sweep:c":
            crow[r["saguaro_c"]].append(r)
    if crow:
        cs = sorted(crow)
        fig, axs = plt.subplots(1, 3, figsize=(11, 3.5))
        for ax, key, name in zip(axs, ("decode_tokens_per_s", "acceptance_length", "p_hit"),
                                 ("decode tok/s", "acceptance length", "cache hit rate")):
            ax.plot(cs, [mean(r[key] for r in crow[c]) for c in cs], "o-")
            ax.set_xlabel("Saguaro C")
            ax.set_title(name)
        fig.suptitle("Saguaro C sweep (SSD, temperature 0.7)")
        fig.tight_layout()
        fig.savefig(out / "c_sweep.png", dpi=110)
        plt.close(fig)
        made.append("c_sweep.png")
    return made


def serving_ratio(raw: dict, mode: str) -> float:
    """Served over in-process decode tok/s on the same prompts (the in-process runs cover fewer)."""
    return paired_ratio(greedy_rows(raw, "split", mode), greedy_rows(raw, "inproc", mode))


def outside_forward(raw: dict) -> str:
    """Per verify call, the round trip minus the target's own forward time, served and in-process
    on the same requests: the serving cost measured inside each request, so unlike the tok/s ratio
    above it does not move with the machine's speed between the two runs."""
    # the verify call alone: an SD round also makes a draft call, an SSD miss a backup call
    out = []
    for mode in ("ar", "sd", "ssd"):
        served = [r for r in greedy_rows(raw, "split", mode) if r.get("verify_forward_ms") is not None]
        inproc = [r for r in greedy_rows(raw, "inproc", mode) if r.get("verify_forward_ms") is not None]
        if not served or not inproc:
            continue
        f_s, o_s = mean(r["verify_forward_ms"] for r in served), mean(r["verify_outside_forward_ms"] for r in served)
        f_i, o_i = mean(r["verify_forward_ms"] for r in inproc), mean(r["verify_outside_forward_ms"] for r in inproc)
        # a served round: tokens per round over decode tok/s
        round_ms = mean(1000 * r["acceptance_length"] / r["decode_tokens_per_s"] for r in served if r["decode_tokens_per_s"])
        out.append([mode, f"{f_s:.0f} / {o_s:.1f}", f"{f_i:.0f} / {o_i:.1f}", f"{100 * (o_s - o_i) / round_ms:.1f}%"])
    if not out:
        return "(no per-call timing in these rows)"
    return md.table(["mode", "served: forward / outside (ms per verify)", "in-process: forward / outside",
                     "the verify's serving cost, % of a served round"], out)


def _lowest(xs) -> float:
    """The ratio against the fastest rival: the lowest that was measured (nan if none was)."""
    xs = [x for x in xs if not math.isnan(x)]
    return min(xs) if xs else float("nan")


def against_llamacpp(raw: dict) -> str:
    """Each of our configurations' decode tok/s over llama.cpp's, on the prompts both ran."""
    theirs = [(label, greedy_rows(raw, src, key)) for label, src, key in LLAMACPP]
    theirs = [(label, rows) for label, rows in theirs if rows]
    if not theirs:
        return "(llama.cpp did not run)"
    out = []
    for label, src, key in OURS:
        ours = greedy_rows(raw, src, key)
        if ours:
            out.append([label] + [f"{_fmt(paired_ratio(ours, rows))}x" for _, rows in theirs])
    return md.table(["ours, over:"] + [label for label, _ in theirs], out)


def targets(raw: dict) -> str:
    ssd, sd, ar = (greedy_rows(raw, "split", m) for m in ("ssd", "sd", "ar"))
    sd2, peers = greedy_rows(raw, "shared2", "sd"), [greedy_rows(raw, "peer", k) for k in (2, 4)]
    rows = [("SSD / SD, paper protocol", paired_ratio(ssd, sd), 1.25),
            ("SSD / AR, paper protocol", paired_ratio(ssd, ar), 1.8),
            ("SSD (1+1) / best of SD 2 threads and peer", _lowest(paired_ratio(ssd, r) for r in [sd2, *peers]), 1.15),
            ("our SD 2 threads / peer 2 threads", _lowest(paired_ratio(sd2, p) for p in peers), 1.0)]
    llama_ar, llama_spec = greedy_rows(raw, "llamacpp", "ar"), greedy_rows(raw, "llamacpp", "spec")
    ar2 = greedy_rows(raw, "shared2", "ar")
    default = greedy_rows(raw, "split", "default")
    rows += [("our AR 2 threads / llama.cpp AR 2 threads", paired_ratio(ar2, llama_ar), 0.95),
             ("served default / llama.cpp AR", paired_ratio(default, llama_ar), 1.5),
             ("served default / llama.cpp speculative decoding", paired_ratio(default, llama_spec), 2.0)]
    for mode, label in (("ar", "AR"), ("sd", "SD"), ("ssd", "SSD")):
        rows.append((f"served / in-process {label} (serving overhead <= 10%)", serving_ratio(raw, mode), 0.9))
    mem = raw.get("meta", {}).get("peak_rss_gb", {})
    out = [[name, _fmt(v), f">= {goal}", "yes" if v >= goal else ("-" if math.isnan(v) else "no")]
           for name, v, goal in rows]
    if mem:
        peak = max(mem.values())
        out.append(["peak memory of the served default (GB)", f"{peak:.1f}", "<= 4.5", "yes" if peak <= 4.5 else "no"])
    return md.table(["target", "measured", "goal", "met"], out)


def ceiling(raw: dict) -> str:
    """What speculation can give at batch 1, from the bound phase's forwards and this run's acceptance
    (SD's tokens a round) and hit rates (the budget sweep): bound.py."""
    costs, sd = raw.get("bound"), greedy_rows(raw, "split", "sd")
    if not costs or not sd:
        return "(needs the bound phase and the split phase's SD rows)"
    a = bound.alpha_from(mean(r["acceptance_length"] for r in sd), sd[0].get("num_draft_tokens") or 4)
    fit = budget_fit(raw)
    ar2_over_llama = paired_ratio(greedy_rows(raw, "shared2", "ar"), greedy_rows(raw, "llamacpp", "ar"))
    return bound.report(costs, a, dict(zip(fit[0], fit[1])) if fit else None, ar2_over_llama)


def sampled_table(raw: dict) -> str:
    out = []
    for m in ("ar", "sd", "ssd"):
        rows = [r for r in raw.get("split", []) if r["phase"] == "t0.7" and r["mode"] == m]
        if rows:
            out.append([m, f"{mean(r['decode_tokens_per_s'] for r in rows):.2f}",
                        f"{mean(r['acceptance_length'] for r in rows):.2f}",
                        _fmt(mean(r["p_hit"] for r in rows)) if m == "ssd" else "-", len(rows)])
        elif m == "ar" and (greedy := greedy_rows(raw, "split", "ar")):
            out.append(["ar (greedy rows: one forward a token at any temperature)",
                        f"{mean(r['decode_tokens_per_s'] for r in greedy):.2f}", "1.00", "-", len(greedy)])
    return md.table(["mode", "decode tok/s", "accept len", "p_hit", "n"], out)


CORRECTNESS_NOTE = (
    "Our configurations run the batch-invariant target (a row's logits do not depend on the mode or the batch), "
    "so they are expected to agree token for token. Where a target's rows change with the thread count (the torch "
    "target where oneDNN splits a GEMM differently at 2 threads), AR at 2 threads may leave AR at 1 thread at a "
    "near-tied argmax, so SD at 2 threads is also checked against AR at 2 threads. The peer runs transformers on the "
    "bf16 conversion and llama-server computes with its own build's kernels, so their tokens may leave ours at any "
    "near tie; llama.cpp's speculative decoding is checked against its own AR.")


def write(raw: dict, out: Path) -> str:
    meta = raw["meta"]
    sections = [("Overall (greedy)", table(raw, None)), ("Targets", targets(raw)),
                ("Time outside the target's forward, per verify call", outside_forward(raw))]
    sections += [(f"{ds} (greedy)", table(raw, ds)) for ds in meta["datasets"]]
    sections += [("Against llama.cpp's llama-server (ours / theirs, decode tok/s, same prompts and GGUF files)",
                  against_llamacpp(raw)),
                 ("The ceiling at batch 1, from this run's forwards (tools/bench/bound.py)", ceiling(raw)),
                 ("Temperature 0.7 (served, 1+1 cores)", sampled_table(raw)),
                 ("Correctness pass (greedy, token ids vs served AR)", correctness(raw)), (None, "\n" + CORRECTNESS_NOTE)]
    sw, chosen = sweeps(raw)
    if sw:
        sections += [("Sweeps (served, 1+1 cores)", sw),
                     (None, "\n**Chosen per sweep:** " + ", ".join(f"{k} = {v}" for k, v in chosen.items()))]
    fit = budget_fit(raw)
    if fit and fit[2] is not None:
        sections.append((None, f"\nMiss rate vs fan-out budget: miss = {fit[3]:.3f} B^-{fit[2]:.2f}"))
    elif fit:
        sections.append((None, "\nMiss rate vs fan-out budget: no fit, fewer than two budgets missed a round (p_hit "
                         + " / ".join(f"{h:.2f}" for h in fit[1]) + f" at B = {' / '.join(map(str, fit[0]))})"))
    sections.append((None, "\nPlots: " + ", ".join(plots(raw, out))))
    title = f"Bench ({meta['preset']}): batch 1, {meta['max_tokens']} new tokens, {meta['wall_s'] / 60:.1f} min"
    return md.write(out / "report.md", title, sections)
