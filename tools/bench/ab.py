"""Served A/B of request knobs, interleaved prompt by prompt (how the shipped defaults are checked).

A sweep of the bench measures each point on one prompt per dataset, minutes apart, and this VM's
speed drifts by up to 40% within half an hour. An A/B runs every variant on the same prompt back
to back, alternating their order from prompt to prompt (A B, B A, ...) so that a drift within a
pair favours neither, and reports each variant's ratio to the first one per prompt: geometric
mean, range and wins, beside its acceptance and hit rate.

  tools/bench/ab.py --variants '{"fanout_budget": 12}' '{"fanout_budget": 8}' --prompts 4

Every variant starts from the bench's SSD knobs (plan.SSD_BASE: the shipped defaults, step_aside
off) and overrides some. One tritonserver in the split layout (target on core 0, drafter on core
1), warmed up like the bench's. Writes the rows and the summary to --out (JSON).
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from ssd_tools import markdown_report as md
from ssd_tools.bench.plan import PIN, held_out_prompt, prompt_rows, set_server_defaults
from ssd_tools.bench.report import mean
from ssd_tools.bench.run import Progress, run_served
from ssd_tools.triton_launcher import REPO


def plan(variants: list[dict], prompts: list[dict], mode: str) -> list[tuple[dict, dict]]:
    """Served jobs (tags, request overrides): every variant on each prompt, the order reversed on
    every other prompt."""
    jobs = []
    for n, p in enumerate(prompts):
        order = list(enumerate(variants))
        for i, v in order if n % 2 == 0 else order[::-1]:
            jobs.append(({**p, "phase": "ab", "mode": mode, "variant": i}, {"mode": mode, **PIN.get(mode, {}), **v}))
    return jobs


def summarize(rows: list[dict], n_variants: int) -> list[dict]:
    """Per variant: mean decode tok/s, acceptance and p_hit, and its per-prompt ratio to variant 0
    (geometric mean, min, max, how many prompts it beat variant 0 on)."""
    by_prompt: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        by_prompt.setdefault((r["dataset"], r["prompt"]), {})[r["variant"]] = r
    out = []
    for i in range(n_variants):
        mine = [p[i] for p in by_prompt.values() if i in p]
        ratios = [p[i]["decode_tokens_per_s"] / p[0]["decode_tokens_per_s"] for p in by_prompt.values()
                  if i in p and 0 in p and p[0]["decode_tokens_per_s"] > 0]
        out.append({
            "variant": i, "n": len(mine),
            "tok_s": mean(r["decode_tokens_per_s"] for r in mine),
            "accept": mean(r["acceptance_length"] for r in mine),
            "p_hit": mean(r["p_hit"] for r in mine),
            "ratio_geomean": math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios else float("nan"),
            "ratio_min": min(ratios, default=float("nan")), "ratio_max": max(ratios, default=float("nan")),
            "wins": sum(x > 1 for x in ratios),
        })
    return out


def table(summary: list[dict], variants: list[dict]) -> str:
    return md.table(["variant", "decode tok/s", "accept len", "p_hit", "vs variant 0 (geomean)", "range", "wins"],
                    [[json.dumps(variants[s["variant"]]), f"{s['tok_s']:.2f}", f"{s['accept']:.2f}", f"{s['p_hit']:.2f}",
                      f"{s['ratio_geomean']:.3f}", f"{s['ratio_min']:.2f}-{s['ratio_max']:.2f}", f"{s['wins']}/{s['n']}"]
                     for s in summary])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", required=True, help="JSON objects of request knobs; the first is the reference")
    ap.add_argument("--datasets", default="humaneval,gsm8k")
    ap.add_argument("--prompts", type=int, default=4, help="per dataset")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--mode", default="ssd")
    ap.add_argument("--config", type=Path, default=REPO / "engines/default.yaml")
    ap.add_argument("--engine-root", type=Path, default=REPO / "engines")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "ab.json")
    a = ap.parse_args()
    variants = [json.loads(v) for v in a.variants]
    for v in variants:
        if not isinstance(v, dict):
            ap.error(f"--variants: each must be a JSON object of request knobs, got {v!r}")
    set_server_defaults(a, a.max_tokens)
    prompts = prompt_rows(a.datasets.split(","), a.prompts)
    warm_text = held_out_prompt(a.prompts)
    jobs = plan(variants, prompts, a.mode)
    prog = Progress(len(jobs))
    print(f"[ab] {len(variants)} variants x {len(prompts)} prompts, {a.max_tokens} tokens, mode {a.mode}", flush=True)
    rows = run_served("split", jobs, a, prog, warm_text)
    summary = summarize(rows, len(variants))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"variants": variants, "max_tokens": a.max_tokens, "rows": rows, "summary": summary},
                                indent=1))
    print("\n" + table(summary, variants))
    print(f"[ab] rows and summary in {a.out}")


if __name__ == "__main__":
    main()
