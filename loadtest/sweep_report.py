"""What a load-test sweep reports: per-cell figures (percentiles, steady tokens/s, the policy's
rounds), the merge of a cell's interleaved parts (--repeat), and the outputs (plots, report.md,
written with the bench's Markdown writer, ssd_tools.markdown_report)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ssd_tools import markdown_report as md


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_fields(lat: list[float], ttft: list[float]) -> dict:
    """Percentiles from the locustfile's exact record of latencies (ms); none when it has none."""
    out = {"ttft_p50_ms": round(percentile(ttft, 50), 1) if ttft else ""}
    if lat:
        out.update(latency_p50_ms=round(percentile(lat, 50), 1), latency_p99_ms=round(percentile(lat, 99), 1),
                   latency_avg_ms=round(sum(lat) / len(lat), 1))
    return out


def policy_fields(kinds: dict[str, float]) -> dict:
    """The policy's rounds per choice (ssd_policy_decisions_total deltas): the commonest and all."""
    return {"policy_choice": max(kinds, key=kinds.get) if kinds else "-",
            "policy_decisions": "; ".join(f"{k}={int(v)}" for k, v in sorted(kinds.items()))}


def hit_rate(hits: float, misses: float) -> float | str:
    return round(hits / (hits + misses), 3) if hits + misses else ""


def steady_rate(users: int, tokens: int, latencies_ms: list[float]) -> float:
    """Tokens/s at a steady ``users`` requests in flight (Little's law: each user always has one
    request running, so the rate is users x tokens / the requests' total latency). Unlike tokens
    over the cell's span it leaves out the drain after Locust stops sending, when the last
    requests run at falling concurrency and the mode whose requests vary most in length scores
    lowest (SD at 8 users can read 11.7 tok/s over the span and 15.4 in the steady part)."""
    total = sum(latencies_ms) / 1000
    return round(users * tokens / total, 2) if total > 0 else 0.0


def merge(parts: list[dict]) -> dict:
    """One row for a mode and concurrency from its interleaved parts (``--repeat``): counts add up,
    tokens/s is all tokens over all the parts' spans, percentiles come from all latencies."""
    if len(parts) == 1:
        return parts[0]
    row = dict(parts[0])
    for k in ("requests", "failures", "output_tokens", "server_requests_ok", "server_requests_failed",
              "server_output_tokens", "cache_hits", "cache_misses", "backup_neural", "backup_fast", "rejected_busy"):
        row[k] = sum(int(p[k]) for p in parts)
    row["rps"] = round(sum(p["rps"] for p in parts) / len(parts), 3)
    span = sum(p["_span"] for p in parts)
    row["output_tokens_per_s"] = round(row["output_tokens"] / span, 2) if span else 0.0
    lat, ttft = [x for p in parts for x in p["_lat"]], [x for p in parts for x in p["_ttft"]]
    row["steady_tokens_per_s"] = steady_rate(row["users"], row["output_tokens"], lat)
    row.update(latency_fields(lat, ttft))
    row["p_hit"] = hit_rate(row["cache_hits"], row["cache_misses"])
    kinds: dict[str, float] = defaultdict(float)
    for p in parts:
        for k, v in p["_kinds"].items():
            kinds[k] += v
    row.update(policy_fields(kinds))
    row["policy_rates"] = parts[-1]["policy_rates"]
    row["locust_rc"] = max(p["locust_rc"] for p in parts)
    row["wall_s"] = round(sum(p["wall_s"] for p in parts), 1)
    row["parts_tok_s"] = " ".join(p["parts_tok_s"] for p in parts)
    return row


# -- outputs ---------------------------------------------------------------------------------------------
def plot(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator, ScalarFormatter

    def log2_axis(ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["users"] for r in rows}))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())

    modes = list(dict.fromkeys(r["mode"] for r in rows))
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, m in enumerate(modes):  # steady (no drain) solid, over the span dashed: see steady_rate
        rs = sorted((r for r in rows if r["mode"] == m), key=lambda r: r["users"])
        xs = [r["users"] for r in rs]
        ax.plot(xs, [r["steady_tokens_per_s"] for r in rs], marker="o", color=f"C{i}", label=f"{m} steady")
        ax.plot(xs, [r["output_tokens_per_s"] for r in rs], marker=".", ls="--", color=f"C{i}", alpha=0.6,
                label=f"{m} span")
    log2_axis(ax)
    ax.set_xlabel("concurrent users")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "throughput.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, m in enumerate(modes):
        rs = sorted((r for r in rows if r["mode"] == m), key=lambda r: r["users"])
        xs = [r["users"] for r in rs]
        color = f"C{i}"
        ax.plot(xs, [r["latency_p50_ms"] / 1000 for r in rs], marker="o", color=color, label=f"{m} p50")
        ax.plot(xs, [r["latency_p99_ms"] / 1000 for r in rs], marker="s", ls="--", color=color, label=f"{m} p99")
    log2_axis(ax)
    ax.set_xlabel("concurrent users")
    ax.set_ylabel("request latency (s)")
    ax.set_title("Latency vs concurrency")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "latency.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def markdown(rows: list[dict]) -> str:
    return md.table(
        ["mode", "users", "requests", "failures", "out tok/s", "steady tok/s", "p50 ms", "p99 ms", "TTFT p50 ms",
         "p_hit", "backup (neural/fast)", "rounds by policy choice"],
        [[r["mode"], r["users"], r["requests"], r["failures"], f"{r['output_tokens_per_s']:.1f}",
          f"{r['steady_tokens_per_s']:.1f}", f"{r['latency_p50_ms']:.0f}", f"{r['latency_p99_ms']:.0f}",
          r["ttft_p50_ms"] or "-", r["p_hit"] if r["p_hit"] != "" else "-", f"{r['backup_neural']}/{r['backup_fast']}",
          r["policy_decisions"] or "-"] for r in rows])


def write_report(rows: list[dict], out: Path, title: str, plots: list[Path]) -> str:
    """results/loadtest/report.md: the sweep's table and where its figures and Locust's files are."""
    files = ", ".join(p.name for p in plots) + "; sweep.csv; per-cell Locust CSV/HTML in cells/"
    return md.write(out / "report.md", title, [("Per mode and concurrency", markdown(rows)), ("Files", files)])


# -- ours against llama-server sides (peer_sweep.py) -------------------------------------------------------
def ratio(ours: float, other: float) -> str:
    return f"{ours / other:.2f}" if ours and other else "-"


def peer_markdown(rows: list[dict], sides: list[str], ours: str = "ours") -> str:
    """Steady tokens/s of every side per user count, then ours / llama-server AR and ours / the
    best n-gram side at that user count (the fastest of the ``llama-ngram-*`` sides there, named)."""
    ngrams = [s for s in sides if s.startswith("llama-ngram")]
    out = []
    for users in sorted({r["users"] for r in rows}):
        tps = {r["side"]: r["steady_tokens_per_s"] for r in rows if r["users"] == users}
        best = max((s for s in ngrams if s in tps), key=lambda s: tps[s], default=None)
        out.append([users, *(md.fmt(tps.get(s)) for s in sides),
                    ratio(tps.get(ours), tps.get("llama-ar")) if "llama-ar" in sides else "-",
                    f"{ratio(tps.get(ours), tps[best])} ({best.removeprefix('llama-')})" if best else "-"])
    return md.table(["users", *(f"{s} tok/s" for s in sides), f"{ours} / llama-ar", f"{ours} / best n-gram"], out)


def side_rows(rows: list[dict]) -> str:
    """Every side's cell: requests, failures, steady tok/s (and per part), tokens/s over the span,
    latency percentiles, our policy's rounds by choice."""
    return md.table(
        ["side", "users", "requests", "failures", "steady tok/s", "parts' steady tok/s", "tok/s over the span",
         "p50 ms", "p99 ms", "rounds by policy choice"],
        [[r["side"], r["users"], r["requests"], r["failures"], md.fmt(r["steady_tokens_per_s"]),
          r["parts_steady_tok_s"], md.fmt(r["output_tokens_per_s"]), md.fmt(r.get("latency_p50_ms") or None, ".0f"),
          md.fmt(r.get("latency_p99_ms") or None, ".0f"), r.get("policy_decisions") or "-"] for r in rows])
