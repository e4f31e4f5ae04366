"""`make bench-free`: free drafts on the workloads where they win, side by side in one run.

Sides, all up at once on the same GGUF files and cores, each prompt sent to every side in turn
(the order rotates prompt by prompt, so the shared machine's drift hits every side alike):
  ours          the served default (tritonserver, `mode: ssd`: the scheduler picks lookup, SSD, SD
                or AR per round)
  ours-nofree   the same server, the request's `free_drafts: false` (the served default without
                free drafts: what the mix must not lose against)
  llama-ar      llama-server, the target alone on both cores
  llama-<type>  llama-server with a draft-free `--spec-type` (its n-gram speculation, flags as
                llama.cpp's docs/speculative.md suggests: tools/bench/llamacpp.py's NGRAM_FLAGS)
  lcpp-lookup-<n>  llama-cpp-python's prompt lookup (LlamaPromptLookupDecoding, num_pred_tokens n:
                10 is the library's default, 2 its README's advice for CPU-only machines) on the
                project's build of the library, a process of its own (tools/bench/lcpp_lookup.py)
Workloads (tools/bench/workloads.py): edits (HumanEval code edits), agent (repeated tool-call
tasks), mix (HumanEval / GSM8K / MT-Bench). Greedy, batch 1, --max-tokens (256) a request. Decode
tokens/s is each side's own figure over the tokens after the first: llama.cpp's
`predicted_per_second`, our stats' `decode_tokens_per_s`; a workload's figure is its tokens over
its decode seconds. The outputs' agreement with ours-nofree (token ids) is reported per side.

    .venv/bin/python tools/bench/free_drafts.py --prompts 6 --out results/free_drafts
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

from ssd_loadtest.traffic import body
from ssd_tools.bench.lcpp_lookup import PromptLookupPeer
from ssd_tools.bench.llamacpp import LLAMA_SIDES, LlamaServer, build, gguf_by_role, peer_config, start_peers
from ssd_tools.bench.workloads import WORKLOADS
from ssd_tools.runner import config_pair, generate, start_pair

REPO = Path(__file__).resolve().parents[2]
LLAMA_DEFAULT = ("llama-ar", "llama-ngram-simple", "llama-ngram-map-k", "llama-ngram-mod")
LOOKUP = "lcpp-lookup-"
LOOKUP_DEFAULT = (f"{LOOKUP}10", f"{LOOKUP}2")


def parse_sides(text: str) -> list[str]:
    """``ours`` first, then the named sides in order; each one this bench knows how to run."""
    sides = ["ours"] + list(dict.fromkeys(x for x in text.split(",") if x and x != "ours"))
    for side in sides[1:]:
        n = side.removeprefix(LOOKUP)
        if side != "ours-nofree" and side not in LLAMA_SIDES and not (side.startswith(LOOKUP) and n.isdigit()
                                                                       and int(n) > 0):
            raise SystemExit(f"--sides: unknown side {side!r} (ours-nofree, {', '.join(LLAMA_SIDES)} or "
                             f"{LOOKUP}<num_pred_tokens>)")
    return sides


def lookup_ctx(prompt_lens: list[int], max_tokens: int, pred_tokens: int) -> int:
    """llama-cpp-python's context for the lookup peer: the longest prompt, its output and a last
    draft fit (it keeps logits for every position of it), rounded up to 256."""
    need = max(prompt_lens) + max_tokens + pred_tokens + 1
    return -(-need // 256) * 256


def ours(url: str, prompt: str, max_tokens: int, free: bool) -> dict:
    d = generate(url, {**body(prompt, max_tokens, "ssd"), "free_drafts": free})
    s = d["stats"]
    ids = d["output_ids"] if isinstance(d["output_ids"], list) else [d["output_ids"]]
    return {"ids": ids, "tokens": s["new_tokens"], "decode_tps": s["decode_tokens_per_s"],
            "choices": s.get("rounds_by_choice"), "acceptance_length": s.get("acceptance_length")}


def llama(srv: LlamaServer, ids: list[int], max_tokens: int) -> dict:
    r = srv.complete(ids, max_tokens)
    t = r["timings"]
    return {"ids": list(r["tokens"]), "tokens": t["predicted_n"], "decode_tps": t["predicted_per_second"],
            "draft_n": t.get("draft_n"), "draft_n_accepted": t.get("draft_n_accepted")}


def lookup(peer: PromptLookupPeer, ids: list[int], max_tokens: int) -> dict:
    r = peer.complete(ids, max_tokens)
    return {k: r[k] for k in ("ids", "tokens", "decode_tps", "draft_n", "draft_n_accepted")}


def summarize(rows: list[dict], sides: list[str]) -> dict:
    out = {}
    for wl in dict.fromkeys(r["workload"] for r in rows):
        per = {}
        for side in sides:
            rs = [r for r in rows if r["workload"] == wl and r["side"] == side]
            tokens = sum(max(r["tokens"] - 1, 0) for r in rs)
            seconds = sum(max(r["tokens"] - 1, 0) / r["decode_tps"] for r in rs if r["decode_tps"])
            per[side] = {"tokens": tokens, "decode_s": round(seconds, 2),
                         "decode_tps": round(tokens / seconds, 2) if seconds else 0.0}
        ref_side = "ours-nofree" if "ours-nofree" in sides else sides[0]
        ref = {r["prompt"]: r["ids"] for r in rows if r["workload"] == wl and r["side"] == ref_side}
        for side in sides:
            rs = [r for r in rows if r["workload"] == wl and r["side"] == side]
            per[side]["same_ids_as_nofree"] = f"{sum(r['ids'] == ref.get(r['prompt']) for r in rs)}/{len(rs)}"
        best = {kind: max((s for s in sides if s.startswith(prefix)), key=lambda s: per[s]["decode_tps"], default=None)
                for kind, prefix in (("best_ngram", "llama-ngram"), ("best_lookup", LOOKUP))}
        tps = {s: per[s]["decode_tps"] for s in sides}
        ratios = {f"ours/{s}": round(tps["ours"] / tps[s], 3) for s in sides if s != "ours" and tps[s]}
        out[wl] = {"sides": per, "ratios": ratios, **best}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="edits,agent,mix")
    ap.add_argument("--prompts", type=int, default=6, help="prompts a workload")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--sides", default=",".join(["ours", "ours-nofree", *LLAMA_DEFAULT, *LOOKUP_DEFAULT]),
                    help="which sides run (ours always does): ours-nofree, llama-<ar|ngram-...>, "
                         f"{LOOKUP}<num_pred_tokens>")
    ap.add_argument("--config", type=Path, default=REPO / "engines/default.yaml")
    ap.add_argument("--engine-root", type=Path, default=REPO / "engines")
    ap.add_argument("--out", type=Path, default=REPO / "results/free_drafts")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    from ssd.decoding.text import TextCodec

    pair = config_pair(a.config, a.engine_root)
    codec = TextCodec(a.engine_root / pair.target)
    sides = parse_sides(a.sides)
    prompts = {wl: WORKLOADS[wl](a.prompts) for wl in a.workloads.split(",")}
    ggufs = gguf_by_role(a.config, a.engine_root)
    peers = {name: peer_config(name, ggufs) for name in sides if name.startswith("llama-")}
    binary = build() if peers else None
    n_ctx = lookup_ctx([len(codec.encode_prompt(p)) for ps in prompts.values() for p in ps], a.max_tokens,
                       max([int(x.removeprefix(LOOKUP)) for x in sides if x.startswith(LOOKUP)], default=0))
    rows: list[dict] = []
    server = start_pair(pair, "free_drafts", "split")
    url = f"http://{server.http_url}"
    try:
        with contextlib.ExitStack() as stack:
            srvs = start_peers(stack, binary, peers, a.out)
            for name in sides:
                if name.startswith(LOOKUP):
                    srvs[name] = stack.enter_context(PromptLookupPeer(
                        ggufs["target"], pred_tokens=int(name.removeprefix(LOOKUP)), n_ctx=n_ctx,
                        log_file=a.out / f"{name}.log"))
            warm = "Say hello."
            for name, srv in srvs.items():
                srv.complete(codec.encode_prompt(warm), 8)
            ours(url, warm, 8, True)
            run = {"ours": lambda p: ours(url, p, a.max_tokens, True),
                   "ours-nofree": lambda p: ours(url, p, a.max_tokens, False)}
            run |= {name: (lambda p, s=srv, f=lookup if name.startswith(LOOKUP) else llama:
                           f(s, codec.encode_prompt(p), a.max_tokens)) for name, srv in srvs.items()}
            t0, n = time.time(), 0
            for wl, wl_prompts in prompts.items():
                for i, prompt in enumerate(wl_prompts):
                    order = sides[i % len(sides):] + sides[:i % len(sides)]
                    for side in order:
                        r = run[side](prompt)
                        rows.append({"workload": wl, "prompt": i, "side": side, **r})
                        n += 1
                        print(f"[free] {wl} #{i} {side}: {r['tokens']} tokens at {r['decode_tps']:.2f} tok/s"
                              + (f" {r['choices']}" if r.get("choices") else "")
                              + f" | {(time.time() - t0) / 60:.1f} min", flush=True)
                    (a.out / "raw.json").write_text(json.dumps(rows))
    finally:
        server.stop()
    summary = summarize(rows, sides)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"Greedy, batch 1, {a.max_tokens} tokens a request, {a.prompts} prompts a workload; decode tok/s "
             "(each side's tokens after the first over its decode seconds); ratios of ours to each side.", "",
             "| workload | " + " | ".join(sides) + " | " + " | ".join(f"ours / {s}" for s in sides[1:]) + " |",
             "|---" * (2 * len(sides)) + "|"]
    for wl, s in summary.items():
        lines.append(f"| {wl} | " + " | ".join(str(s["sides"][x]["decode_tps"]) for x in sides) + " | "
                     + " | ".join(str(s["ratios"].get(f"ours/{x}", "-")) for x in sides[1:]) + " |")
    lines += ["", "Same output ids as ours-nofree: " + "; ".join(
        f"{wl}: " + ", ".join(f"{x} {s['sides'][x]['same_ids_as_nofree']}" for x in sides) for wl, s in summary.items())]
    (a.out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
