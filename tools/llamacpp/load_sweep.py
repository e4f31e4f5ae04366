"""llama.cpp's llama-server under the load test's Locust traffic: one server with N slots per
concurrency N (the load peer of `loadtest/sweep.py`; the same prompts, length, closed loop and
steady-rate estimate), printing a Markdown table of tokens/s per users.

    .venv/bin/python tools/llamacpp/load_sweep.py --concurrency 1,4,8,16 --run-time 40s --out results/llama_load
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from ssd_loadtest.sweep_report import steady_rate
from ssd_tools.bench.llamacpp import LlamaServer, PeerConfig, build, gguf_by_role
from ssd_tools.runner import locust_cmd

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--run-time", default="40s")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--spec", action="store_true", help="llama.cpp's speculative decoding with the drafter")
    ap.add_argument("--config", type=Path, default=REPO / "engines/default.yaml")
    ap.add_argument("--engine-root", type=Path, default=REPO / "engines")
    ap.add_argument("--out", type=Path, default=REPO / "results/llama_load")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    ggufs = gguf_by_role(a.config, a.engine_root)
    rows = []
    for users in [int(u) for u in a.concurrency.split(",")]:
        cfg = PeerConfig(ggufs["target"], draft=ggufs["drafter"] if a.spec else None, parallel=users, ctx_per_slot=2048)
        summary = a.out / f"{cfg.mode}_u{users}_summary.json"
        summary.unlink(missing_ok=True)
        with LlamaServer(build(), cfg, log_file=a.out / f"{cfg.mode}_u{users}_server.log") as srv:
            cmd = locust_cmd() + ["-f", str(REPO / "tools/llamacpp/llama_locustfile.py"), "--headless", "-u",
                                  str(users), "-r", str(users), "--run-time", a.run_time, "--host", srv.url,
                                  "--only-summary"]
            env = dict(os.environ, SSD_MAX_TOKENS=str(a.max_tokens), SSD_SUMMARY=str(summary))
            with open(a.out / f"{cfg.mode}_u{users}.log", "w") as log:
                subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
        s = json.loads(summary.read_text()) if summary.exists() else {}
        rows.append({"users": users, "mode": cfg.mode, "requests": len(s.get("latency_ms") or []),
                     "steady_tokens_per_s": steady_rate(users, int(s.get("tokens", 0)), s.get("latency_ms") or []),
                     "output_tokens_per_s": round(s.get("output_tokens_per_s", 0.0), 2)})
        print(json.dumps(rows[-1]), flush=True)
    (a.out / "sweep.json").write_text(json.dumps(rows, indent=1))
    print("| users | llama.cpp | requests | steady tok/s | tok/s over the run |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['users']} | {r['mode']} | {r['requests']} | {r['steady_tokens_per_s']} | {r['output_tokens_per_s']} |")


if __name__ == "__main__":
    main()
