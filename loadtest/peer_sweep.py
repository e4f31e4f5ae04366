"""Under load, one workload: our server against llama-server's AR and n-gram speculation at each
user count (`make loadtest-edits`).

For each user count N of --concurrency, fresh servers on the same GGUF file and the same 2 cores:
ours (the served default, `mode: ssd`, split layout, as loadtest/sweep.py starts it) and one
llama-server with N slots per --peers side (default llama-ar, llama-ngram-simple and llama-ngram-mod:
its draft-free --spec-types with the flags tools/bench/free_drafts.py gives them). Each side's cell
is Locust's closed loop, N users, greedy, --max-tokens a request, the --workload's prompts
(loadtest/traffic.py: edits, agent or mix); the cells run one after the other, each split into
--repeat parts of --run-time / repeat with the sides' order rotating part by part, so the shared
machine's drift weighs on every side alike. A side's figure is its steady tokens/s over all its
parts (users x tokens / the requests' total latency: sweep_report.steady_rate).

    .venv/bin/python loadtest/peer_sweep.py --workload edits --concurrency 1,4,16 --run-time 240s --repeat 2

Outputs under --out (default results/loadtest_<workload>/): report.md (ours / llama-server AR and
ours / its best n-gram per user count, then every side's cell), peer_sweep.json, and per part
cells/<side>_u<N>_r<part>{.log,_summary.json} plus the servers' logs.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

from ssd_loadtest import sweep
from ssd_loadtest.sweep_report import latency_fields, peer_markdown, policy_fields, side_rows, steady_rate
from ssd_loadtest.traffic import WORKLOAD_DATASETS, workload_datasets
from ssd_tools import markdown_report as md
from ssd_tools.bench.llamacpp import LLAMA_SIDES, build, gguf_by_role, peer_config, start_peers
from ssd_tools.llamacpp.load_sweep import run_cell as llama_cell
from ssd_tools.runner import warm_up

REPO = Path(__file__).resolve().parent.parent
OURS = "ours"


def parse_sides(peers: str) -> list[str]:
    """``ours`` first, then the --peers sides in the order given (each a llama-server side)."""
    names = [p for p in peers.split(",") if p]
    bad = [p for p in names if p not in LLAMA_SIDES]
    if bad or not names:
        raise SystemExit(f"--peers: expected llama-server sides from {', '.join(LLAMA_SIDES)}, got {peers!r}")
    return [OURS, *dict.fromkeys(names)]


def part_order(sides: list[str], part: int) -> list[str]:
    """The sides of one part, rotated by the part's number (every side takes every place in turn)."""
    k = part % len(sides)
    return sides[k:] + sides[:k]


def ours_cell(a, url: str, metrics_url: str, users: int, part: int) -> dict:
    r = sweep.run_cell(a, url, metrics_url, "ssd", users, part)
    return {"tokens": r["output_tokens"], "latency_ms": r["_lat"], "failures": r["failures"], "span_s": r["_span"],
            "locust_rc": r["locust_rc"], "kinds": r["_kinds"]}


def merged(side: str, users: int, parts: list[dict]) -> dict:
    """A side's row at one user count from its parts: tokens and latencies of them all."""
    tokens, lat = sum(p["tokens"] for p in parts), [x for p in parts for x in p["latency_ms"]]
    span = sum(p["span_s"] for p in parts)
    kinds: dict[str, float] = {}
    for p in parts:
        for k, v in (p.get("kinds") or {}).items():
            kinds[k] = kinds.get(k, 0.0) + v
    return {"side": side, "users": users, "requests": len(lat), "failures": sum(p["failures"] for p in parts),
            "tokens": tokens, "steady_tokens_per_s": steady_rate(users, tokens, lat),
            "output_tokens_per_s": round(tokens / span, 2) if span else 0.0,
            "parts_steady_tok_s": " ".join(f"{steady_rate(users, p['tokens'], p['latency_ms']):.2f}" for p in parts),
            "locust_rc": max(p["locust_rc"] for p in parts), **latency_fields(lat, []),
            **(policy_fields(kinds) if side == OURS else {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=WORKLOAD_DATASETS, default="edits")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--peers", default="llama-ar,llama-ngram-simple,llama-ngram-mod",
                    help=f"llama-server sides, comma-separated, from {', '.join(LLAMA_SIDES)}")
    ap.add_argument("--run-time", default="240s", help="per side and user count (Locust --run-time), over all parts")
    ap.add_argument("--repeat", type=int, default=2, help="parts a cell runs in, the sides' order rotating")
    ap.add_argument("--stop-timeout", type=int, default=600, help="seconds users get to finish the request in flight")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompts-per-dataset", type=int, default=16)
    ap.add_argument("--max-active", type=int, default=64, help="max_active_requests of our server")
    ap.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                    help="a parameter of our ssd model (ServerConfig); repeatable")
    ap.add_argument("--config", type=Path, default=REPO / "engines/default.yaml")
    ap.add_argument("--engine-root", type=Path, default=REPO / "engines")
    ap.add_argument("--out", type=Path, help="default: results/loadtest_<workload>")
    a = ap.parse_args()
    sides = parse_sides(a.peers)
    a.out = a.out or REPO / "results" / f"loadtest_{a.workload}"
    a.out.mkdir(parents=True, exist_ok=True)
    a.datasets = workload_datasets(a.workload)
    part_time = f"{max(1, sweep._seconds(a.run_time) // a.repeat)}s"
    # what sweep.run_cell and sweep.start_server read
    cell_args = argparse.Namespace(**{**vars(a), "run_time": part_time, "run_seconds": sweep._seconds(part_time),
                                      "user_class": "GenerateUser", "tiny": False, "modes": "ssd"})
    ggufs, binary = gguf_by_role(a.config, a.engine_root), build()
    levels = [int(x) for x in a.concurrency.split(",") if x]
    rows: list[dict] = []
    t0 = time.time()
    for users in levels:
        parts: dict[str, list[dict]] = {s: [] for s in sides}
        with contextlib.ExitStack() as stack:
            peers = start_peers(stack, binary, {s: peer_config(s, ggufs, parallel=users, ctx_per_slot=2048)
                                                for s in sides[1:]}, a.out, f"_u{users}_server")
            srv, url, metrics_url = sweep.start_server(cell_args)
            stack.callback(srv.stop)
            warm_up(url, ["ssd"])
            for peer in peers.values():
                peer.complete([1, 2, 3], 8)
            for part in range(a.repeat):
                for side in part_order(sides, part):
                    tag = f"{side}_u{users}_r{part + 1}"
                    print(f"[peer-sweep] {a.workload}, {users} users, part {part + 1}/{a.repeat}: {side} "
                          f"({part_time}) | {(time.time() - t0) / 60:.1f} min", flush=True)
                    if side == OURS:
                        c = ours_cell(cell_args, url, metrics_url, users, part)
                    else:
                        c = llama_cell(peers[side].url, users, part_time, a.max_tokens, a.datasets,
                                       a.prompts_per_dataset, a.out / "cells", tag, a.stop_timeout)
                    parts[side].append(c)
                    print(f"[peer-sweep]   {len(c['latency_ms'])} requests, {c['failures']} failures, "
                          f"{steady_rate(users, c['tokens'], c['latency_ms']):.2f} steady tok/s", flush=True)
        rows += [merged(s, users, parts[s]) for s in sides]
        (a.out / "peer_sweep.json").write_text(json.dumps(rows, indent=1))  # rewritten after every level
    title = (f"Under load, {a.workload}: ours against llama-server, {a.concurrency} users, {a.run_time} a side and "
             f"user count in {a.repeat} parts, {a.max_tokens} tokens a request, greedy")
    md.write(a.out / "report.md", title, [
        ("Steady tokens/s and ratios", peer_markdown(rows, sides)),
        ("Every side's cells", side_rows(rows))])
    print("\n" + peer_markdown(rows, sides) + f"\n\n[peer-sweep] {a.out / 'report.md'}")


if __name__ == "__main__":
    main()
