"""Paired: both servers up, each group of load-test prompts (one a user, sent at once) sent to
llama-server and to ours in turn (which goes first alternates), so the VM's drift between minutes
hits both sides alike. The load sweep's cells run one after the other and move +-15%; these pairs
compare the same prompts within seconds. Prints each pair's prefill, decode, latency and wall
time, and the totals' ratios.

    .venv/bin/python tools/llamacpp/paired.py --prompts 15 --out results/paired
    .venv/bin/python tools/llamacpp/paired.py --users 4 --prompts 32 --out results/paired4

With ``--users N`` llama-server has N slots, and a group's wall time (first request sent to last
answer) gives each side's tokens/s: a burst of N requests rather than the load test's closed loop,
the batched decode compared on the same prompts at the same minute.

Both sides with their default prompt caching (llama-server's `cache_prompt`, our target's kept
prefixes), greedy, the load test's prompts and chat template, llama-server with one slot on the
same cores and GGUF file. Prefill is each side's own figure (llama.cpp's `prompt_ms`, our
`prefill_s`); decode is llama.cpp's `predicted_ms` and, for ours, the request's latency after its
prefill (so ours also carries the HTTP answer); latency is the client's, for both.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time
import urllib.request
from pathlib import Path

from ssd_loadtest.traffic import body, llama_chat_body, prompts
from ssd_tools.bench.llamacpp import LlamaServer, PeerConfig, build, gguf_by_role
from ssd_tools.prompts import DATASETS
from ssd_tools.runner import config_pair, generate, start_pair

REPO = Path(__file__).resolve().parents[2]
REQUEST_FIELDS = ("prefill_s", "decode_s", "latency_s")  # each request's own; a group sums them
FIELDS = REQUEST_FIELDS + ("wall_s",)


def llama_request(url: str, prompt: str, max_tokens: int, cache_prompt: bool) -> dict:
    b = llama_chat_body(prompt, max_tokens, cache_prompt)
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(b).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=1800) as r:
        d = json.loads(r.read())
    t = d["timings"]
    return {"latency_s": time.perf_counter() - t0, "prefill_s": t["prompt_ms"] / 1000, "decode_s": t["predicted_ms"] / 1000,
            "tokens": t["predicted_n"], "prompt_tokens": t["prompt_n"] + t.get("cache_n", 0),
            "cached_prompt_tokens": t.get("cache_n", 0)}


def our_request(url: str, prompt: str, max_tokens: int) -> dict:
    d = generate(url, body(prompt, max_tokens, "ssd"))
    s = d["stats"]
    return {"latency_s": d["latency_s"], "prefill_s": s["prefill_s"], "decode_s": d["latency_s"] - s["prefill_s"],
            "tokens": s["new_tokens"], "prompt_tokens": s["prompt_tokens"],
            "cached_prompt_tokens": s["cached_prompt_tokens"], "choices": s["rounds_by_choice"]}


def run_group(request, prompts: list[str]) -> dict:
    """``request(prompt)`` for every prompt at once: the requests' sums of the per-request fields
    and tokens, the group's wall time, and the requests themselves."""
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        rs = list(pool.map(request, prompts))
    out = {f: sum(r[f] for r in rs) for f in REQUEST_FIELDS + ("tokens", "prompt_tokens", "cached_prompt_tokens")}
    return {**out, "wall_s": time.perf_counter() - t0, "requests": rs}


def summarize(pairs: list[dict]) -> dict:
    """Each side's totals of FIELDS and tokens and its tokens/s over the wall time; ours over
    llama.cpp's per field and for tokens/s."""
    tot = {}
    for side in ("llama", "ours"):
        t = {f: round(sum(p[side][f] for p in pairs), 3) for f in FIELDS + ("tokens",)}
        tot[side] = {**t, "tokens_per_s": round(t["tokens"] / t["wall_s"], 3) if t["wall_s"] else 0.0}
    ratios = {f: round(tot["ours"][f] / tot["llama"][f], 3) for f in FIELDS + ("tokens_per_s",) if tot["llama"][f]}
    return {**tot, "ours_over_llama": ratios}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=15, help="the load test's first N prompts (whole groups)")
    ap.add_argument("--users", type=int, default=1, help="prompts a group, sent at once; llama-server's slots")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-cache-prompt", action="store_true", help="llama-server without cache_prompt")
    ap.add_argument("--config", type=Path, default=REPO / "engines/default.yaml")
    ap.add_argument("--engine-root", type=Path, default=REPO / "engines")
    ap.add_argument("--out", type=Path, default=REPO / "results/paired")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    every = prompts(list(DATASETS), 16)
    chosen, warm = every[:a.prompts], every[-1]  # the warm-up prompt is none of the measured ones
    groups = [chosen[i:i + a.users] for i in range(0, len(chosen) - a.users + 1, a.users)]
    llama = lambda p, n=a.max_tokens: llama_request(peer.url, p, n, not a.no_cache_prompt)  # noqa: E731
    mine = lambda p, n=a.max_tokens: our_request(url, p, n)  # noqa: E731
    target = gguf_by_role(a.config, a.engine_root)["target"]
    ours = start_pair(config_pair(a.config, a.engine_root), "paired", "split")
    url, pairs = f"http://{ours.http_url}", []
    try:
        with LlamaServer(build(), PeerConfig(target, parallel=a.users, ctx_per_slot=2048),
                         log_file=a.out / "llama_server.log") as peer:
            run_group(lambda p: llama(p, 8), [warm] * a.users)
            run_group(lambda p: mine(p, 8), [warm] * a.users)
            for i, group in enumerate(groups):
                pair = {}
                for side in (("llama", "ours") if i % 2 == 0 else ("ours", "llama")):
                    pair[side] = run_group(llama if side == "llama" else mine, group)
                pairs.append(pair)
                l, o = pair["llama"], pair["ours"]
                print(f"group {i:2d}: {o['prompt_tokens']} prompt tokens ({l['cached_prompt_tokens']} / "
                      f"{o['cached_prompt_tokens']} cached), {l['tokens']} / {o['tokens']} new, prefill "
                      f"{l['prefill_s']:.2f} / {o['prefill_s']:.2f} s, decode {l['decode_s']:.2f} / "
                      f"{o['decode_s']:.2f} s, latency {l['latency_s']:.2f} / {o['latency_s']:.2f} s, wall "
                      f"{l['wall_s']:.2f} / {o['wall_s']:.2f} s (llama-server / ours; sums over the group)", flush=True)
    finally:
        ours.stop()
    summary = summarize(pairs)
    (a.out / "paired.json").write_text(json.dumps({"pairs": pairs, "summary": summary}, indent=1))
    print(f"| {a.users} user(s), sums over {len(pairs)} pairs | llama-server | ours | ours / llama-server |\n"
          "|---|---|---|---|")
    for f in FIELDS + ("tokens", "tokens_per_s"):
        print(f"| {f} | {summary['llama'][f]} | {summary['ours'][f]} | {summary['ours_over_llama'].get(f, '-')} |")


if __name__ == "__main__":
    main()
