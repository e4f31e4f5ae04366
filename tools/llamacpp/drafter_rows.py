"""The drafter's forwards on llama.cpp: what a llama.cpp drafter would cost SSD (docs/cpu_engine.md,
"The drafter's runtime").

A drafter's tree rows over a shared prefix map onto llama.cpp as sequences: with one unified KV
cache, `llama_memory_seq_cp` gives each branch the prefix's cells without copying them, and one
`llama_decode` runs a row of every branch. Times (median ms, after a 256-token context) one row,
the glue pass of K + 1 rows and tree steps of B branch rows, for any GGUF file (the default
drafter's is mostly Q5_0: its 896-wide rows do not fit the K-quants' 256-value blocks; other types
via `llama-quantize --allow-requantize`, built from the same llama.cpp source).

    .venv/bin/python tools/llamacpp/drafter_rows.py engines/.cache/qwen2.5-coder-0.5b-instruct-awq.gguf --threads 1 2
"""
from __future__ import annotations

import argparse

from ssd_tools.bench.engine_rows import round_robin_ms

CONTEXT = 256


def measure(path: str, threads: int, k: int, trees: list[int], reps: int) -> dict[str, float]:
    import llama_cpp as L

    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_extra_bufts = True  # repacked weights where llama.cpp has them (Q4_0 on AVX2)
    model = L.llama_model_load_from_file(path.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 4096, 512, 512, max(trees) + 1
    cp.kv_unified = True  # branches share the prefix's cells
    cp.n_threads = cp.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(512, 0, 1)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    ids = [(7919 * i) % (vocab - 10) + 10 for i in range(CONTEXT + 64)]

    def decode(rows: list[tuple[int, int, int]]) -> None:  # (token, position, sequence), logits for every row
        for j, (tok, pos, seq) in enumerate(rows):
            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = tok, pos, 1, 1
            batch.seq_id[j][0] = seq
        batch.n_tokens = len(rows)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError(f"llama_decode failed on {len(rows)} rows")

    decode([(ids[p], p, 0) for p in range(CONTEXT)])

    def rows(n: int) -> None:
        L.llama_memory_seq_rm(mem, 0, CONTEXT, -1)
        decode([(ids[CONTEXT + i], CONTEXT + i, 0) for i in range(n)])

    def tree(b: int) -> None:
        for s in range(1, b + 1):
            L.llama_memory_seq_rm(mem, s, -1, -1)
            L.llama_memory_seq_cp(mem, 0, s, 0, CONTEXT)
        decode([(ids[s], CONTEXT, s) for s in range(1, b + 1)])

    forwards = {"1 row": lambda: rows(1), f"{k + 1} rows (glue)": lambda: rows(k + 1)}
    forwards.update({f"tree step, {b} rows": (lambda b=b: tree(b)) for b in trees})
    ms = round_robin_ms(forwards, reps)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return {name: round(v, 1) for name, v in ms.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", nargs="+")
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--trees", nargs="+", type=int, default=[4, 12])
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    header = None
    for path in a.gguf:
        for t in a.threads:
            ms = measure(path, t, a.k, a.trees, a.reps)
            if header is None:
                header = list(ms)
                print("| GGUF | threads | " + " | ".join(header) + " |")
                print("|---|---|" + "---|" * len(header))
            print(f"| {path.rsplit('/', 1)[-1]} | {t} | " + " | ".join(str(ms[h]) for h in header) + " |", flush=True)


if __name__ == "__main__":
    main()
