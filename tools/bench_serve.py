"""Decode speed of AR, SD and SSD through the served `ssd` model, side by side in one run.

Starts tritonserver on the built default engines (or --engine-root/--config), sends each prompt in
each mode (greedy unless --temperature), and reports decode tokens/s (prefill excluded, from the
server's own per-request statistics), acceptance length, p_hit, the speedup model's prediction and
whether every mode produced the same text as AR. Layouts:
  split   target on core 0, drafter on core 1, one thread each (the paper's one-device-per-model)
  shared2 every engine with 2 threads on both cores (same hardware for everyone)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from prompts import load  # noqa: E402
from serve import engines_by_role  # noqa: E402
from triton_launcher import REPO, TritonServer, render_repository  # noqa: E402

LAYOUTS = {"split": ("0", "1", "1"), "shared2": ("0,1", "0,1", "2")}


def start(layout: str, a) -> TritonServer:
    tcores, dcores, threads = LAYOUTS[layout]
    roles = engines_by_role(a.config)
    repo = render_repository(REPO / "build" / f"bench_repo_{layout}", {
        "ssd": {"tokenizer": roles["target"], "num_draft_tokens": str(a.k), "fanout_budget": str(a.budget),
                "saguaro_c": str(a.c), "backup": a.backup, "max_active_requests": "4"},
        "target": {"engine": roles["target"], "cores": tcores, "threads": threads},
        "drafter_primary": {"engine": roles["drafter"], "cores": dcores, "threads": threads},
        "drafter_backup": {"cores": dcores},
    })
    srv = TritonServer(repo, a.engine_root, log_file=REPO / "build" / f"bench_{layout}.log")
    return srv.start(timeout=900)


def generate(srv: TritonServer, prompt: str, mode: str, a, **extra) -> dict:
    body = {"text_input": prompt, "max_tokens": a.max_tokens, "mode": mode, "temperature": a.temperature, "seed": 1,
            **extra}
    t0 = time.perf_counter()
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/ssd/generate", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=1800) as r:
        d = json.loads(r.read())
    d["stats"] = json.loads(d["stats"])
    d["latency_s"] = time.perf_counter() - t0
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=REPO / "engines/default.yaml")
    ap.add_argument("--engine-root", type=Path, default=REPO / "engines")
    ap.add_argument("--layouts", default="split")
    ap.add_argument("--modes", default="ar,sd,ssd")
    ap.add_argument("--datasets", default="humaneval,gsm8k")
    ap.add_argument("--per-dataset", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--c", type=float, default=1.0)
    ap.add_argument("--backup", default="auto")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench_serve.json")
    a = ap.parse_args()
    prompts = [(ds, p) for ds in a.datasets.split(",") for p in load(ds, a.per_dataset)]
    rows = []
    for layout in a.layouts.split(","):
        print(f"[bench] layout {layout}: starting tritonserver ...", flush=True)
        srv = start(layout, a)
        try:
            generate(srv, "Say hi.", "ssd", a)  # warm-up: first-call allocations, lazy imports
            for i, (ds, prompt) in enumerate(prompts):
                for mode in a.modes.split(","):
                    d = generate(srv, prompt, mode, a)
                    s = d["stats"]
                    rows.append(dict(layout=layout, dataset=ds, prompt=i, mode=mode, ids=d["output_ids"],
                                     latency_s=d["latency_s"], **{k: s[k] for k in (
                                         "decode_tokens_per_s", "acceptance_length", "p_hit", "new_tokens",
                                         "speedup_predicted", "speedup_measured_vs_ar_step", "t_verify_ms", "t_p",
                                         "t_b", "backup_used", "e_hit", "e_miss")}))
                    print(f"[bench] {layout} {ds} #{i} {mode:3s}: {s['decode_tokens_per_s']:.2f} tok/s, "
                          f"accept len {s['acceptance_length']:.2f}, p_hit {s['p_hit']:.2f}, "
                          f"T_v {s['t_verify_ms']:.0f} ms, T_p {s['t_p']:.2f}", flush=True)
        finally:
            srv.stop()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=1))
    print("\n| layout | mode | decode tok/s | vs AR | accept len | p_hit | T_p | T_b | predicted | same text as AR |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for layout in a.layouts.split(","):
        ar = {r["prompt"]: r for r in rows if r["layout"] == layout and r["mode"] == "ar"}
        ar_tps = statistics.mean(r["decode_tokens_per_s"] for r in ar.values()) if ar else 0
        for mode in a.modes.split(","):
            rs = [r for r in rows if r["layout"] == layout and r["mode"] == mode]
            tps = statistics.mean(r["decode_tokens_per_s"] for r in rs)
            same = sum(1 for r in rs if r["prompt"] in ar and r["ids"] == ar[r["prompt"]]["ids"])
            m = lambda k: statistics.mean(r[k] for r in rs)  # noqa: E731
            print(f"| {layout} | {mode} | {tps:.2f} | {tps / ar_tps if ar_tps else 0:.2f}x | {m('acceptance_length'):.2f} "
                  f"| {m('p_hit'):.2f} | {m('t_p'):.2f} | {m('t_b'):.2f} | {m('speedup_predicted'):.2f} | {same}/{len(rs)} |")
    print(f"\n[bench] raw figures: {a.out}")


if __name__ == "__main__":
    main()
