"""llama.cpp's llama-server under the load test's Locust traffic: one server with N slots per
concurrency N (the load peer of `loadtest/sweep.py`; the same prompts, length, closed loop and
steady-rate estimate), printing a Markdown table of tokens/s per users. --side picks the server:
the target alone (llama-ar), one of its draft-free n-gram --spec-types (llama-ngram-simple,
llama-ngram-map-k, llama-ngram-mod) or speculative decoding on the drafter (llama-spec);
--workload the prompts (loadtest/traffic.py: edits, agent or mix).

    .venv/bin/python tools/llamacpp/load_sweep.py --concurrency 1,4,8,16 --run-time 40s --out results/llama_load
    .venv/bin/python tools/llamacpp/load_sweep.py --side llama-ngram-mod --workload edits --max-tokens 256

loadtest/peer_sweep.py runs these cells beside ours, all sides at each user count.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from ssd_loadtest.sweep_report import steady_rate
from ssd_loadtest.traffic import WORKLOAD_DATASETS, workload_datasets
from ssd_tools.bench.llamacpp import LLAMA_SIDES, LlamaServer, build, gguf_by_role, peer_config
from ssd_tools.runner import locust_cmd

REPO = Path(__file__).resolve().parents[2]


def run_cell(url: str, users: int, run_time: str, max_tokens: int, datasets: str, per_dataset: int, out: Path,
             tag: str, stop_timeout: int = 600) -> dict:
    """One Locust cell (closed loop, ``users`` users) against the llama-server at ``url``: its
    summary (the locustfile's exact record: tokens, latencies, span) plus Locust's exit code."""
    out.mkdir(parents=True, exist_ok=True)
    summary = out / f"{tag}_summary.json"
    summary.unlink(missing_ok=True)
    cmd = locust_cmd() + ["-f", str(REPO / "tools/llamacpp/llama_locustfile.py"), "--headless", "-u", str(users),
                          "-r", str(users), "--run-time", run_time, "--stop-timeout", str(stop_timeout),
                          "--host", url, "--only-summary"]
    env = dict(os.environ, SSD_MAX_TOKENS=str(max_tokens), SSD_SUMMARY=str(summary), SSD_DATASETS=datasets,
               SSD_PROMPTS_PER_DATASET=str(per_dataset))
    with open(out / f"{tag}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    s = json.loads(summary.read_text()) if summary.exists() else {}
    return {"locust_rc": rc, "tokens": int(s.get("tokens", 0)), "latency_ms": s.get("latency_ms") or [],
            "failures": int(s.get("failures", 0)), "span_s": s.get("span_s", 0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--run-time", default="40s")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--side", choices=LLAMA_SIDES, default="llama-ar")
    ap.add_argument("--workload", choices=WORKLOAD_DATASETS, default="mix")
    ap.add_argument("--prompts-per-dataset", type=int, default=16)
    ap.add_argument("--config", type=Path, default=REPO / "engines/default.yaml")
    ap.add_argument("--engine-root", type=Path, default=REPO / "engines")
    ap.add_argument("--out", type=Path, default=REPO / "results/llama_load")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    ggufs = gguf_by_role(a.config, a.engine_root)
    rows = []
    for users in [int(u) for u in a.concurrency.split(",")]:
        cfg = peer_config(a.side, ggufs, parallel=users, ctx_per_slot=2048)
        tag = f"{a.side}_u{users}"
        with LlamaServer(build(), cfg, log_file=a.out / f"{tag}_server.log") as srv:
            c = run_cell(srv.url, users, a.run_time, a.max_tokens, workload_datasets(a.workload),
                         a.prompts_per_dataset, a.out, tag)
        rows.append({"users": users, "side": a.side, "workload": a.workload, "requests": len(c["latency_ms"]),
                     "failures": c["failures"], "steady_tokens_per_s": steady_rate(users, c["tokens"], c["latency_ms"]),
                     "output_tokens_per_s": round(c["tokens"] / c["span_s"], 2) if c["span_s"] else 0.0})
        print(json.dumps(rows[-1]), flush=True)
    (a.out / "sweep.json").write_text(json.dumps(rows, indent=1))
    print("| users | llama-server | requests | steady tok/s | tok/s over the run |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['users']} | {r['side']} | {r['requests']} | {r['steady_tokens_per_s']} | {r['output_tokens_per_s']} |")


if __name__ == "__main__":
    main()
