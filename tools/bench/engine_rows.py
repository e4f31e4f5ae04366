"""Micro-bench: the cost of exactly the forwards SSD runs, per engine runtime and thread count.

Forwards (after a prefill of ``--context`` tokens): one decode row; a verify of K + 1 rows; a tree
of ``--tree`` rows over the shared prefix (one speculation step of a fan-out); ``--batch``
sequences of one row each and of K + 1 rows each. Every (model, runtime, threads) runs in its own
process (torch's thread pool is per process) and reports the median of ``--reps`` timings and its
resident memory after loading. Prints a markdown table; ``--json`` also writes the raw figures.

    .venv/bin/python tools/bench/engine_rows.py --models target drafter --threads 1 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MODELS = {"target": "qwen2.5-coder-1.5b", "drafter": "qwen2.5-coder-0.5b"}
# runtime label -> how the served configuration builds it (target: exact rows; drafter: its served options)
# llamacpp: the target only (the GGUF file, model.gguf in the engine folder; no tree rows)
RUNTIMES = ("torch", "torch-bf16", "openvino-bf16", "openvino-f32", "openvino-int8", "llamacpp")


def served_engine(runtime: str, folder: Path, role: str, threads: int, streams: int, max_len: int):
    if runtime == "llamacpp":
        from ssd.engine.llamacpp_engine import LlamaCppEngine
        return LlamaCppEngine(folder, threads=threads, exact=role == "target", max_sequences=streams, max_len=max_len)
    if runtime == "torch":
        from ssd.engine.engine import TorchEngine
        if role == "target":
            return TorchEngine(folder, threads=threads, exact=True)
        return TorchEngine(folder, threads=threads, exact=False, head_vocab=32768, weight_quant="int8_full")
    if runtime == "torch-bf16":  # a drafter without int8: packed bf16 GEMMs, flat in rows
        from ssd.engine.engine import TorchEngine
        return TorchEngine(folder, threads=threads, exact=role == "target", head_vocab=0 if role == "target" else 32768)
    from ssd.engine.ov_engine import OpenVinoEngine
    return OpenVinoEngine(folder, weights=runtime.split("-")[1], threads=threads, exact=role == "target")


def round_robin_ms(forwards: dict, reps: int, reset=None) -> dict:
    """Median ms of each of ``forwards`` (key -> callable) over ``reps`` rounds that run every
    forward once in turn, so a drift of the machine's speed hits them alike; a first round warms
    up. ``reset`` runs after each forward (a rollback to the shared prefix)."""
    times: dict = {key: [] for key in forwards}
    for rep in range(reps + 1):
        for key, fn in forwards.items():
            t = time.perf_counter()
            fn()
            if rep:
                times[key].append(time.perf_counter() - t)
            if reset:
                reset()
    return {key: 1000 * statistics.median(v) for key, v in times.items()}


def _rss_gb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 1e9


def measure(runtime: str, folder: Path, role: str, threads: int, context: int, k: int, tree: int, batch: int,
            reps: int) -> dict:
    from ssd.engine.engine import ExtendCall, TreeCall

    t0 = time.perf_counter()
    eng = served_engine(runtime, folder, role, threads, batch, context + k + tree + 8)
    load_s = time.perf_counter() - t0
    rss = _rss_gb()
    prompts = [[1000 + (37 * i + 11 * j) % 20000 for j in range(context)] for i in range(batch)]
    eng.extend([ExtendCall(f"s{i}", p, 1) for i, p in enumerate(prompts)])
    extra = list(range(200, 200 + k + 1))

    def timed(fn) -> float | None:
        if fn() is None:  # warm-up (and shapes seen once); None: not a forward this engine runs
            return None
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
            for i, p in enumerate(prompts):  # roll back to the prefix
                eng.truncate(f"s{i}", len(p))
        return round(1000 * statistics.median(out), 1)

    def rows(n_seqs: int, n: int):
        return lambda: eng.extend([ExtendCall(f"s{i}", prompts[i] + extra[:n], n) for i in range(n_seqs)])

    def tree_rows():
        if not hasattr(eng, "tree"):
            return None
        c = len(prompts[0])
        return eng.tree([TreeCall("s0", [300 + j for j in range(tree)], [c] * tree, [c] * tree, [-1] * tree)])

    figures = {"1 row": timed(rows(1, 1)), f"{k + 1} rows (verify)": timed(rows(1, k + 1)),
               f"{tree} tree rows": timed(tree_rows), f"{batch} seqs x 1 row": timed(rows(batch, 1)),
               f"{batch} seqs x {k + 1} rows": timed(rows(batch, k + 1))}
    return {"runtime": runtime, "role": role, "threads": threads, "load_s": round(load_s, 1),
            "rss_gb": round(rss, 2), "ms": figures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--runtimes", nargs="+", choices=RUNTIMES, default=list(RUNTIMES))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--engines", type=Path, default=REPO / "engines")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--tree", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", nargs=3, metavar=("RUNTIME", "ROLE", "THREADS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:  # the child process: one configuration, one JSON line
        runtime, role, threads = a.one[0], a.one[1], int(a.one[2])
        print(json.dumps(measure(runtime, a.engines / MODELS[role], role, threads, a.context, a.k, a.tree,
                                 a.batch, a.reps)), flush=True)
        return
    results = []
    for role in a.models:
        for runtime in a.runtimes:
            if runtime == "openvino-int8" and role == "target":
                continue  # int8 rows are not batch-invariant: never an exact target
            if runtime == "llamacpp" and role != "target":
                continue
            for threads in a.threads:
                cmd = [sys.executable, __file__, "--one", runtime, role, str(threads), "--engines", str(a.engines),
                       "--context", str(a.context), "--k", str(a.k), "--tree", str(a.tree),
                       "--batch", str(a.batch), "--reps", str(a.reps)]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"[engine_rows] {role} {runtime} {threads}t failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                    continue
                results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"[engine_rows] {results[-1]}", file=sys.stderr, flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    if results:
        cols = list(results[0]["ms"])
        print("| model | runtime | threads | " + " | ".join(cols) + " | RSS GB |")
        print("|---|---|---|" + "---|" * (len(cols) + 1))
        for r in results:
            print(f"| {MODELS[r['role']]} | {r['runtime']} | {r['threads']} | "
                  + " | ".join("-" if r["ms"][c] is None else str(r["ms"][c]) for c in cols) + f" | {r['rss_gb']} |")


if __name__ == "__main__":
    main()
