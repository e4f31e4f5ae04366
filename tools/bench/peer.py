"""The peer: Hugging Face transformers on the same pair, prompts and cores (run as a subprocess).

`python tools/bench/peer.py --cores 0,1 --threads 2 --k 2 --prompts P.json --out R.json` runs the
target alone (transformers AR) and with `assistant_model=<drafter>` (assisted generation, constant
K, no confidence cut-off: plain SD as transformers ships it), greedy, on the same token ids our
server decodes (the same chat template). Decode tokens/s excludes the prefill: a streamer stamps each
round's tokens, and the rate is the tokens after the first round over the time after it (assisted
generation's first target forward is the prefill and the first verify at once).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from ssd.engine.engine import load_dtype
from ssd.engine.meta import engine_meta


class ForwardCount:
    """Counts the target's forwards: the prefill, then one per round (AR step or verify)."""

    def __init__(self, model):
        self.n = 0
        model.register_forward_hook(self)

    def __call__(self, *_):
        self.n += 1


class Stamps:
    """A generation streamer that only records when tokens arrive (the first put() is the prompt)."""

    def __init__(self):
        self.times: list[float] = []
        self.counts: list[int] = []

    def put(self, value):
        self.times.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self):
        self.times.append(time.perf_counter())


def run(target, assistant, ids: list[int], max_tokens: int, k: int, eos: list[int], calls: ForwardCount) -> dict:
    inp = torch.tensor([ids])
    calls.n = 0
    st = Stamps()
    kw = dict(max_new_tokens=max_tokens, do_sample=False, streamer=st, eos_token_id=eos,
              pad_token_id=eos[0] if eos else None, attention_mask=torch.ones_like(inp))
    if assistant is not None:
        # transformers (5.x) reads K, its schedule and the confidence cut-off from the assistant's own
        # generation_config: passed to generate() they are ignored, and the assistant's defaults
        # (K = 20, cut-off 0.4, tuned on the fly) run instead
        assistant.generation_config.update(num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                                           assistant_confidence_threshold=0.0)
        kw.update(assistant_model=assistant)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(inp, **kw)
    t_end = time.perf_counter()
    new = out[0, len(ids):].tolist()
    # stamps: [prompt, first round, ..., end]. AR's first round is the prefill's one token; an assisted
    # first round is one target forward over the prompt and K drafts, so it yields up to K + 1 tokens,
    # and the decode rate counts only the tokens after it
    t_first = st.times[1] if len(st.times) > 2 else t_end
    per_round = st.counts[1:]
    after_first = len(new) - (per_round[0] if per_round else len(new))
    rounds = calls.n if assistant is not None else max(calls.n - 1, 0)  # AR: forwards after the prefill
    return {"ids": new, "new_tokens": len(new), "prefill_s": t_first - t0, "latency_s": t_end - t0,
            "decode_tokens_per_s": after_first / (t_end - t_first) if after_first > 0 and t_end > t_first else 0.0,
            "acceptance_length": len(new) / rounds if assistant is not None and rounds else None,
            "tokens_per_round": per_round, "target_forwards": rounds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, required=True, help="JSON: [{dataset, index, ids}]")
    ap.add_argument("--cores", default="0,1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", default="2", help="assistant tokens per round; several: 2,4")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--modes", default="ar,assisted")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    os.sched_setaffinity(0, {int(c) for c in a.cores.split(",")})
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    # the dtype our engines compute in on this CPU (engine.load_dtype: float32 where bf16 has no
    # native GEMM), so the peer and we do the same arithmetic
    meta = engine_meta(a.target)
    dtypes = [load_dtype(None, m.get("dtype")) for m in (meta, engine_meta(a.drafter))]
    target = AutoModelForCausalLM.from_pretrained(a.target, dtype=dtypes[0]).eval()
    assistant = AutoModelForCausalLM.from_pretrained(a.drafter, dtype=dtypes[1]).eval()
    print(f"[peer] transformers loaded both models in {time.perf_counter() - t0:.0f} s "
          f"({a.threads} threads on cores {a.cores}, {dtypes[0]} / {dtypes[1]})", file=sys.stderr, flush=True)
    eos = list(meta.get("eos_token_ids", [])) or [target.generation_config.eos_token_id]
    prompts = json.loads(a.prompts.read_text())
    calls = ForwardCount(target)
    run(target, assistant, prompts[0]["ids"][:16], 4, 2, eos, calls)  # warm-up
    rows = []
    variants = [("ar", 0)] if "ar" in a.modes else []
    variants += [("assisted", int(k)) for k in a.k.split(",")] if "assisted" in a.modes else []
    for i, p in enumerate(prompts):
        for mode, k in variants:
            r = run(target, assistant if mode == "assisted" else None, p["ids"], a.max_tokens, k, eos, calls)
            rows.append({"dataset": p["dataset"], "prompt": p["index"], "mode": mode, "k": k, **r})
            print(f"[peer] {p['dataset']} #{p['index']} {mode} K={k}: {r['decode_tokens_per_s']:.2f} tok/s, "
                  f"{r['target_forwards']} target forwards", file=sys.stderr, flush=True)
    a.out.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
