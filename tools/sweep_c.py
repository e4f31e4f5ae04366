"""Saguaro's C at temperature > 0: acceptance, cache hit rate and decode speed per value, one run.

Lower C moves the residual's mass onto the tokens the speculation cache holds (higher p_hit) at the
price of acceptance; C = 1 is plain speculative sampling. Every value is lossless (tests prove it),
so the default is simply the fastest measured here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import generate, start  # noqa: E402
from prompts import load  # noqa: E402
from triton_launcher import REPO  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", type=Path, default=REPO / "engines/default.yaml")
    ap.add_argument("--engine-root", type=Path, default=REPO / "engines")
    ap.add_argument("--values", default="1.0,0.7,0.4,0.0")
    ap.add_argument("--per-dataset", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "sweep_c.json")
    a = ap.parse_args()
    a.c, a.backup = 1.0, "auto"
    prompts = [p for ds in ("humaneval", "gsm8k") for p in load(ds, a.per_dataset)]
    srv = start("split", a)
    rows = []
    try:
        for c in [float(v) for v in a.values.split(",")]:
            for i, prompt in enumerate(prompts):
                d = generate(srv, prompt, "ssd", a, saguaro_c=c, seed=7)
                s = d["stats"]
                rows.append(dict(c=c, prompt=i, tps=s["decode_tokens_per_s"], acc=s["acceptance_length"],
                                 p_hit=s["p_hit"]))
                print(f"[sweep_c] C={c} #{i}: {s['decode_tokens_per_s']:.2f} tok/s accept {s['acceptance_length']:.2f} "
                      f"p_hit {s['p_hit']:.2f}", flush=True)
    finally:
        srv.stop()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(rows, indent=1))
    print("\n| C | decode tok/s | acceptance length | p_hit |\n|---|---|---|---|")
    for c in sorted({r["c"] for r in rows}, reverse=True):
        rs = [r for r in rows if r["c"] == c]
        m = lambda k: statistics.mean(r[k] for r in rs)  # noqa: E731
        print(f"| {c} | {m('tps'):.2f} | {m('acc'):.2f} | {m('p_hit'):.2f} |")


if __name__ == "__main__":
    main()
