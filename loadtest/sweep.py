"""Load-test sweep: Locust (headless) at each concurrency level x decoding mode against the `ssd` model.

Against a running server (--url http://127.0.0.1:8000, metrics from --metrics-url) or one started
here: --engine-root/--config like tools/bench/run.py (target on core 0, drafter on core 1), or
--tiny (the CI engines in build/test_engines: smollm2-135m fp32 target, the same weights in bf16 as
drafter) for quick smoke runs. The prompts: --datasets, or --workload (edits, agent, mix; loadtest/traffic.py). Each cell runs `locust -f loadtest/locustfile.py --headless -u N -r N
--run-time T` (users finish the request in flight, up to --stop-timeout), scrapes /metrics before
and after, and records requests, failures, output tokens/s (over the span and steady: see
steady_rate), p50/p99 latency, TTFT p50 (StreamUser), and the mode policy's per-round choices
(ssd_policy_decisions_total deltas by choice: ssd+neural, ssd+fast, sd, ar) and its predicted
tokens/s per choice at the end of the cell. With --repeat N each cell runs as N parts of run-time/N,
interleaved across modes (ar, sd, ssd, ar, sd, ssd, ...), and its row adds them up (tokens over the
parts' time, percentiles over all latencies; parts_tok_s lists each part's rate): this VM's speed
drifts by tens of percent within minutes, and a mode whose whole cell fell in a slow stretch would
otherwise read as the slower mode.

Outputs under --out (default results/loadtest/): report.md, sweep.csv, throughput.png, latency.png, and per
cell cells/<mode>_u<N>{_stats.csv,_failures.csv,.html,_summary.json,.log}. The figures, the merge
and the outputs are in sweep_report.py; the server, the metrics and the warm-up are the bench's
(ssd_tools.runner).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlparse

from ssd_loadtest.sweep_report import (hit_rate, latency_fields, markdown, merge, plot, policy_fields, steady_rate,
                                       write_report)
from ssd_loadtest.traffic import WORKLOAD_DATASETS, workload_datasets
from ssd_tools.prompts import ALL as ALL_DATASETS
from ssd_tools.runner import config_pair, locust_cmd, ssd_params, start_pair, tiny_pair, wait_idle, warm_up

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

LOOPBACK = ("127.0.0.1", "localhost")
FIELDS = ["mode", "users", "user_class", "requests", "failures", "rps", "output_tokens", "output_tokens_per_s",
          "steady_tokens_per_s",
          "latency_p50_ms", "latency_p99_ms", "latency_avg_ms", "ttft_p50_ms", "itl_p50_ms",
          "server_requests_ok", "server_requests_failed", "server_output_tokens", "cache_hits", "cache_misses",
          "p_hit", "backup_neural", "backup_fast", "policy_choice", "policy_decisions", "policy_rates", "rejected_busy",
          "locust_rc", "wall_s", "parts_tok_s"]


# -- Prometheus ---------------------------------------------------------------------------------------
def by_label(before: dict, after: dict, name: str, label: str | None = None, **match) -> dict[str, float]:
    """Delta of counter ``name`` summed per value of ``label`` (or under "" when label is None)."""
    out: dict[str, float] = defaultdict(float)
    for (n, labels), v in after.items():
        if n != name:
            continue
        d = dict(labels)
        if any(d.get(k) != val for k, val in match.items()):
            continue
        out[d.get(label, "") if label else ""] += v - before.get((n, labels), 0.0)
    return {k: v for k, v in out.items() if v}


def start_server(a):
    """The server of a sweep or soak run here: the --tiny CI engines or --config's pair, split layout."""
    pair = tiny_pair() if a.tiny else config_pair(a.config, a.engine_root)
    params = {"max_active_requests": a.max_active, **ssd_params(getattr(a, "param", []))}
    srv = start_pair(pair, "loadtest", "split", params)
    return srv, f"http://{srv.http_url}", f"http://{srv.address}:{srv.metrics_port}/metrics"


# -- one cell ---------------------------------------------------------------------------------------------
def read_stats(path: Path) -> dict[str, dict]:
    if not path.exists():
        return {}
    with path.open() as f:
        return {r["Name"]: r for r in csv.DictReader(f)}


def _num(row: dict | None, key: str) -> float:
    try:
        return float(row[key]) if row and row.get(key) not in (None, "", "N/A") else 0.0
    except ValueError:
        return 0.0


def run_cell(a, url: str, metrics_url: str, mode: str, users: int, part: int = 0) -> dict:
    cells = a.out / "cells"
    cells.mkdir(parents=True, exist_ok=True)
    tag = f"{mode}_u{users}" + (f"_r{part + 1}" if a.repeat > 1 else "")
    prefix, summary = cells / tag, cells / f"{tag}_summary.json"
    for stale in (summary, Path(f"{prefix}_stats.csv")):
        stale.unlink(missing_ok=True)
    before = wait_idle(metrics_url)
    cmd = locust_cmd() + ["-f", str(HERE / "locustfile.py"), "--headless", "-u", str(users), "-r", str(users),
                           "--run-time", a.run_time, "--stop-timeout", str(a.stop_timeout), "--host", url,
                           "--csv", str(prefix), "--html", str(cells / f"{tag}.html"), "--only-summary",
                           *a.user_class.split(",")]
    env = dict(os.environ, SSD_MODE=mode, SSD_MAX_TOKENS=str(a.max_tokens), SSD_SUMMARY=str(summary),
               SSD_DATASETS=a.datasets, SSD_PROMPTS_PER_DATASET=str(a.prompts_per_dataset))
    t0 = time.time()
    with open(cells / f"{tag}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=a.run_seconds + a.stop_timeout + 300).returncode
    wall = time.time() - t0
    after = wait_idle(metrics_url)
    stats = read_stats(Path(f"{prefix}_stats.csv"))
    names = [n for cls, n in (("GenerateUser", "generate"), ("StreamUser", "generate_stream"))
             if cls in a.user_class.split(",")]
    mains = [stats[n] for n in names if n in stats]
    s = json.loads(summary.read_text()) if summary.exists() else {}
    tokens_row = stats.get("output_tokens")
    tps = s.get("output_tokens_per_s") or _num(tokens_row, "Requests/s") * _num(tokens_row, "Average Content Size")
    # exact percentiles from the locustfile's own record (Locust's CSV rounds to 2 significant digits)
    lat, ttft = s.get("latency_ms") or [], s.get("ttft_ms") or []
    main = mains[0] if len(mains) == 1 else None
    kinds = by_label(before, after, "ssd_policy_decisions_total", "choice")  # rounds per choice
    rates = {dict(labels).get("choice"): v for (n, labels), v in after.items()
             if n == "ssd_policy_predicted_tokens_per_s"}
    backup = by_label(before, after, "ssd_backup_used_total", "kind")
    lookups = by_label(before, after, "ssd_cache_lookups_total", "result")
    hits, misses = lookups.get("hit", 0.0), lookups.get("miss", 0.0)
    req_by_status = by_label(before, after, "ssd_requests_total", "status")
    return {
        "mode": mode, "users": users, "user_class": a.user_class,
        "requests": int(sum(_num(r, "Request Count") for r in mains)),
        "failures": int(sum(_num(r, "Failure Count") for r in mains)),
        "rps": round(sum(_num(r, "Requests/s") for r in mains), 3),
        "output_tokens": int(s.get("tokens", 0)), "output_tokens_per_s": round(tps, 2),
        "steady_tokens_per_s": steady_rate(users, int(s.get("tokens", 0)), lat),
        # Locust's own figures only where the locustfile wrote no record
        "latency_p50_ms": _num(main, "50%"), "latency_p99_ms": _num(main, "99%"),
        "latency_avg_ms": round(_num(main, "Average Response Time"), 1), **latency_fields(lat, ttft),
        "itl_p50_ms": _num(stats.get("ITL"), "50%") if "ITL" in stats else "",
        "server_requests_ok": int(req_by_status.get("ok", 0)),
        "server_requests_failed": int(sum(v for k, v in req_by_status.items() if k != "ok")),
        "server_output_tokens": int(sum(by_label(before, after, "ssd_output_tokens_total").values())),
        "cache_hits": int(hits), "cache_misses": int(misses),
        "p_hit": hit_rate(hits, misses),
        "backup_neural": int(backup.get("neural", 0)), "backup_fast": int(backup.get("fast", 0)),
        **policy_fields(kinds),
        "policy_rates": "; ".join(f"{k}={v:.2f}" for k, v in sorted(rates.items())) if mode == "ssd" else "",
        "rejected_busy": int(sum(by_label(before, after, "ssd_rejected_busy_total").values())),
        "locust_rc": rc, "wall_s": round(wall, 1), "parts_tok_s": f"{tps:.2f}",
        "_lat": lat, "_ttft": ttft, "_span": s.get("span_s", 0.0), "_kinds": kinds,
    }


def _seconds(t: str) -> int:
    total, num = 0, ""
    for ch in t.strip():
        if ch.isdigit():
            num += ch
        else:
            total += int(num) * {"h": 3600, "m": 60, "s": 1}[ch]
            num = ""
    return total + int(num or 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000 (default: start one here)")
    ap.add_argument("--metrics-url", help="its Prometheus endpoint (default: same host, port 8002, /metrics)")
    ap.add_argument("--tiny", action="store_true", help="start a server on the CI engines (build/test_engines)")
    ap.add_argument("--config", type=Path, default=REPO / "engines/default.yaml")
    ap.add_argument("--engine-root", type=Path, default=REPO / "engines")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--modes", default="ar,sd,ssd")
    ap.add_argument("--run-time", default="60s", help="per cell (Locust --run-time)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="split each cell into this many parts, run interleaved (ar, sd, ssd, ar, sd, ssd, ...) "
                         "so that a machine drifting during a concurrency level weighs on every mode alike")
    ap.add_argument("--stop-timeout", type=int, default=600, help="seconds users get to finish the request in flight")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--user-class", default="GenerateUser", help="GenerateUser, StreamUser or both (comma)")
    ap.add_argument("--datasets", default=ALL_DATASETS, help="comma-separated (also edits, agent)")
    ap.add_argument("--workload", choices=WORKLOAD_DATASETS,
                    help="the prompts by workload: edits, agent or mix (sets --datasets; loadtest/traffic.py)")
    ap.add_argument("--prompts-per-dataset", type=int, default=16)
    ap.add_argument("--max-active", type=int, default=64, help="max_active_requests of a server started here")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="a parameter of the ssd model of a server started here (ServerConfig), e.g. "
                         "force_mode=ar@wide; repeatable")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "loadtest")
    a = ap.parse_args()
    a.run_seconds = _seconds(a.run_time)
    if a.workload:
        a.datasets = workload_datasets(a.workload)
    levels = [int(x) for x in a.concurrency.split(",") if x]
    modes = [m for m in a.modes.split(",") if m]
    a.out.mkdir(parents=True, exist_ok=True)

    srv = None
    if a.url:
        host = urlparse(a.url)
        if host.hostname not in LOOPBACK:
            raise SystemExit(f"--url must be a loopback address (127.0.0.1), got {a.url}")
        url = a.url.rstrip("/")
        metrics_url = a.metrics_url or f"{host.scheme}://{host.hostname}:8002/metrics"
    else:
        srv, url, metrics_url = start_server(a)
    rows: list[dict] = []
    try:
        warm_up(url, modes)
        n_cells, done = len(levels) * len(modes) * a.repeat, 0
        part_time = f"{max(1, a.run_seconds // a.repeat)}s"
        for n in levels:
            parts: dict[str, list[dict]] = {m: [] for m in modes}
            for part in range(a.repeat):
                for mode in modes:
                    done += 1
                    print(f"[loadtest] cell {done}/{n_cells}: mode={mode} users={n} run-time={part_time}"
                          + (f" (part {part + 1}/{a.repeat})" if a.repeat > 1 else "") + " ...", flush=True)
                    r = run_cell(argparse.Namespace(**{**vars(a), "run_time": part_time}), url, metrics_url,
                                 mode, n, part)
                    parts[mode].append(r)
                    print(f"[loadtest]   {r['requests']} requests, {r['failures']} failures, "
                          f"{r['output_tokens_per_s']:.1f} out tok/s ({r['steady_tokens_per_s']:.1f} steady), "
                          f"p50 {r['latency_p50_ms']:.0f} ms, "
                          f"p99 {r['latency_p99_ms']:.0f} ms, policy: {r['policy_decisions'] or '-'} "
                          f"({r['wall_s']:.0f} s)", flush=True)
            rows += [merge(parts[m]) for m in modes]
            with (a.out / "sweep.csv").open("w", newline="") as f:  # rewritten after every level
                w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
                w.writeheader()
                w.writerows(rows)
    finally:
        if srv is not None:
            srv.stop()
    plots = plot(rows, a.out) if rows else []
    write_report(rows, a.out, f"Load sweep: {a.modes} at {a.concurrency} users, {a.run_time} a cell, "
                 f"{a.max_tokens} tokens a request, prompts: {a.workload or a.datasets}", plots)
    print("\n" + markdown(rows))
    print(f"\n[loadtest] {a.out / 'report.md'}, {a.out / 'sweep.csv'}; plots: {', '.join(str(p) for p in plots)}; "
          f"per-cell Locust CSV/HTML: {a.out / 'cells'}")


if __name__ == "__main__":
    main()
