"""A burst: N requests sent at once to a fresh server, each request's own statistics printed.

Where a Locust sweep gives steady throughput, a burst shows how a batch forms: every prompt arrives
together, so the table splits each request's time into prefill (admission to its first token) and
decode, with its rounds and the target's forward time. Greedy, the default pair.

    .venv/bin/python loadtest/burst.py --users 16 [--param force_mode=ar@wide] [--out results/burst.json]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time
from pathlib import Path

from ssd_loadtest.traffic import prompts
from ssd_tools.prompts import ALL as ALL_DATASETS
from ssd_tools.runner import config_pair, generate, ssd_params, start_pair

REPO = Path(__file__).resolve().parents[1]

COLUMNS = ("latency_s", "prefill_s", "decode_s", "rounds", "prefill_threads", "verify_forward_ms",
           "verify_outside_forward_ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=16, help="requests sent at once")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--datasets", default=ALL_DATASETS)
    ap.add_argument("--config", type=Path, default=REPO / "engines/default.yaml")
    ap.add_argument("--engine-root", type=Path, default=REPO / "engines")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="a parameter of the ssd model (ServerConfig), e.g. force_mode=ar@wide")
    ap.add_argument("--out", type=Path, help="also write the requests' statistics as JSON")
    a = ap.parse_args()
    params = {"max_active_requests": max(16, a.users), **ssd_params(a.param)}
    texts = prompts(a.datasets.split(","), a.users)[: a.users]
    if len(texts) < a.users:
        raise SystemExit(f"--users {a.users}: the datasets hold {len(texts)} prompts")
    srv = start_pair(config_pair(a.config, a.engine_root), "burst", "split", params)
    url = f"http://{srv.http_url}"
    try:
        body = {"max_tokens": a.max_tokens, "mode": "ssd", "temperature": 0.0}
        generate(url, dict(body, text_input="Say hi.", max_tokens=8))  # load-time work out of the burst
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(a.users) as ex:
            results = list(ex.map(lambda text: generate(url, dict(body, text_input=text)), texts))
        wall = time.perf_counter() - t0
    finally:
        srv.stop()
    tokens = sum(r["stats"]["new_tokens"] for r in results)
    rows = [{c: r["latency_s"] if c == "latency_s" else r["stats"].get(c) for c in COLUMNS} for r in results]
    print(f"{a.users} requests at once: {wall:.1f} s, {tokens} tokens, {tokens / wall:.2f} tok/s")
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(str(round(v, 2) if isinstance(v, float) else v) for v in row.values()) + " |")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"users": a.users, "wall_s": wall, "tokens": tokens, "params": params,
                                     "requests": rows}, indent=1))


if __name__ == "__main__":
    main()
