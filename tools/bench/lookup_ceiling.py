"""What lookup rounds make on a free-draft run's outputs, priced at the target's measured row costs.

The bench's outputs are the target's greedy tokens, so a lookup round's outcome is known without
running it: the draft ``FreeDrafter`` proposes from the prompt, the output so far and the suffix
cache (fed in the run's order), accepted as far as it agrees with the output. Each round is priced
at the llama.cpp target's forward cost for its rows at 2 threads (docs/design.md, free drafts:
27.3 / 33.6 / 40.4 / 54.3 ms for 1 / 2 / 3 / 5 rows, 6.75 ms a row past; ``--row-ms`` gives another
machine's curve), each AR token at one row.
The ratio is the most lookup rounds alone can make over AR on a quiet machine, with no per-round
overhead and no choice between lookup and AR (the served scheduler takes AR where lookup loses).

    .venv/bin/python tools/bench/lookup_ceiling.py results/free_drafts/raw.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ssd.algorithm.free_draft import FreeDrafter
from ssd.algorithm.suffix_cache import SuffixCache
from ssd_tools.bench.workloads import WORKLOADS

REPO = Path(__file__).resolve().parents[2]
# the llama.cpp target's forward at 2 threads, ms by rows (the Zen 5 EPYC's; --row-ms for another
# machine's): 6.75 ms a row past 5 rows, the slope its last two points carry on
ROW_MS = {1: 27.3, 2: 33.6, 3: 40.4, 5: 54.3, 6: 61.05}


def parse_row_ms(text: str) -> dict[int, float]:
    """``1:112,2:107,4:130``: milliseconds of a forward by its rows."""
    try:
        curve = {int(r): float(ms) for r, ms in (x.split(":") for x in text.split(",") if x)}
    except ValueError:
        raise SystemExit(f"--row-ms: expected rows:ms pairs such as 1:27.3,2:33.6, got {text!r}")
    if 1 not in curve or len(curve) < 2:
        raise SystemExit(f"--row-ms: needs the 1-row forward and one more size, got {text!r}")
    return curve


def forward_ms(rows: int, curve: dict[int, float] = ROW_MS) -> float:
    """The forward's cost at ``rows``: linear between the measured sizes, the last slope past them
    (the default curve: 6.75 ms a row past 5)."""
    pts = sorted(curve.items())
    if rows >= pts[-1][0]:
        (r0, m0), (r1, m1) = pts[-2], pts[-1]
        return m1 + (m1 - m0) / (r1 - r0) * (rows - r1)
    lo = max(p for p in pts if p[0] <= rows)
    hi = min(p for p in pts if p[0] >= rows)
    return lo[1] if hi[0] == lo[0] else lo[1] + (hi[1] - lo[1]) * (rows - lo[0]) / (hi[0] - lo[0])


def simulate(prompt: list[int], output: list[int], drafter: FreeDrafter, k: int,
             curve: dict[int, float] = ROW_MS) -> tuple[float, int]:
    """(milliseconds, rounds) of lookup rounds producing ``output`` after its first token."""
    seq, i, ms, rounds = prompt + output[:1], 1, 0.0, 0
    while i < len(output):
        draft = drafter.propose(seq, min(k, len(output) - i - 1) if len(output) - i > 1 else 0)
        accepted = next((j for j, t in enumerate(draft) if t != output[i + j]), len(draft))
        ms += forward_ms(1 + len(draft), curve)
        rounds += 1
        seq = seq + output[i:i + accepted + 1]
        i += accepted + 1
    return ms, rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("raw", type=Path)
    ap.add_argument("--side", default="ours-nofree", help="whose outputs (the target's greedy tokens)")
    ap.add_argument("--k", type=int, default=15, help="the longest draft (the served lookup_max_k)")
    ap.add_argument("--engine", type=Path, default=REPO / "engines" / "qwen2.5-coder-1.5b")
    ap.add_argument("--row-ms", type=parse_row_ms, default=ROW_MS,
                    help="the target's forward, rows:ms pairs (default: the Zen 5 EPYC's at 2 threads)")
    a = ap.parse_args()
    from ssd.decoding.text import TextCodec

    codec = TextCodec(a.engine)
    rows = [r for r in json.loads(a.raw.read_text()) if r["side"] == a.side]
    cache = SuffixCache(65536)
    n_prompts = {wl: 1 + max(r["prompt"] for r in rows if r["workload"] == wl) for wl in {r["workload"] for r in rows}}
    prompts = {wl: WORKLOADS[wl](n) for wl, n in n_prompts.items()}
    print("| workload | prompt | tokens | lookup rounds | tokens a round | lookup / AR (row costs) |\n|---|---|---|---|---|---|")
    totals: dict[str, list[float]] = {}
    for r in rows:
        ids = codec.encode_prompt(prompts[r["workload"]][r["prompt"]])
        ms, rounds = simulate(ids, r["ids"], FreeDrafter(cache), a.k, a.row_ms)
        cache.add(ids + r["ids"])
        ar_ms = forward_ms(1, a.row_ms) * (len(r["ids"]) - 1)
        t = totals.setdefault(r["workload"], [0.0, 0.0])
        t[0], t[1] = t[0] + ms, t[1] + ar_ms
        print(f"| {r['workload']} | {r['prompt']} | {len(r['ids'])} | {rounds} | {(len(r['ids']) - 1) / max(rounds, 1):.2f} "
              f"| {ar_ms / ms:.2f}x |")
    for wl, (ms, ar_ms) in totals.items():
        print(f"| {wl} | all | | | | {ar_ms / ms:.2f}x |")


if __name__ == "__main__":
    main()
