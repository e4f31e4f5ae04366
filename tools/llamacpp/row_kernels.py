"""Which row counts per forward keep a row's logits equal to one-row forwards, on llama.cpp as the
engine loads it (the facts behind LlamaCppEngine's `logit_rows`; docs/cpu_engine.md), and what a
forward of that many rows of one sequence costs (median of --reps, after a 64-token context).

    .venv/bin/python tools/llamacpp/row_kernels.py engines/qwen2.5-coder-1.5b --rows 1 2 3 4 5 7 8 12
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ssd.engine.engine import ExtendCall
from ssd.engine.llamacpp_engine import LlamaCppEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 5, 7, 8, 12])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    eng = LlamaCppEngine(a.folder, threads=a.threads, max_sequences=2, max_len=256)
    own = eng.logit_rows
    n_max = max(a.rows)
    ids = [(7919 * i) % (eng.vocab_size - 10) + 10 for i in range(64 + n_max)]
    eng.logit_rows = 1
    eng.extend([ExtendCall("ref", ids[:64], 1)])
    ref = torch.cat([eng.extend([ExtendCall("ref", ids[: 64 + i + 1], 1)])[0] for i in range(n_max)])
    print(f"{a.threads} threads; the engine's load check chose logit_rows = {own}")
    print("| rows per forward | rows equal to one-row forwards | largest difference | ms a forward | x one row |")
    print("|---|---|---|---|---|")
    one = None
    for n in a.rows:
        eng.logit_rows = n
        eng.release("s")
        eng.extend([ExtendCall("s", ids[:64], 1)])
        got = torch.cat([eng.extend([ExtendCall("s", ids[: 64 + lo + n], n)])[0] for lo in range(0, n_max - n + 1, n)])
        diff = (got - ref[: got.shape[0]]).abs().max().item()
        ms = []
        for _ in range(a.reps):
            eng.truncate("s", 64)
            t0 = time.perf_counter()
            eng.extend([ExtendCall("s", ids[: 64 + n], n)])
            ms.append(1000 * (time.perf_counter() - t0))
        ms = statistics.median(ms)
        one = one or ms
        print(f"| {n} | {'yes' if diff == 0 else 'no'} | {diff:.3g} | {ms:.1f} | {ms / one:.2f} |")


if __name__ == "__main__":
    main()
