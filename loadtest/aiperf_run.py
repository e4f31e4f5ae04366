"""NVIDIA AIPerf (a standard LLM benchmark client) against the OpenAI-compatible endpoint.

    python loadtest/aiperf_run.py --url http://127.0.0.1:9000 --tokenizer engines/qwen2.5-coder-1.5b \
        --concurrency 2 --requests 16

AIPerf lives in its own virtualenv (build/aiperf-venv, pinned in loadtest/aiperf-requirements.txt):
it needs numpy 2, the serving stack numpy 1.26. It sends the same prompts as the Locust users
(tools/prompts.py: HumanEval, GSM8K, MT-Bench interleaved) as one-message chats, greedy, with the
same max_tokens, streamed, at a fixed concurrency (closed loop, like Locust's -u N), and counts
output tokens from the server's `usage`. Writes AIPerf's own artifacts under --out and prints its
summary: output tokens/s, request latency, TTFT, inter-token latency.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from ssd_loadtest.traffic import prompts as interleaved_prompts
from ssd_tools.prompts import ALL as ALL_DATASETS

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

AIPERF = REPO / "build" / "aiperf-venv" / "bin" / "aiperf"


def write_dataset(path: Path, datasets: list[str], per_dataset: int) -> int:
    prompts = interleaved_prompts(datasets, per_dataset)  # the Locust users' prompts, in their order
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": p}) + "\n" for p in prompts))
    return len(prompts)


def model_id(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:9000")
    ap.add_argument("--tokenizer", type=Path, required=True, help="the target's engine folder")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mode", default="ssd", choices=["ar", "sd", "ssd"])
    ap.add_argument("--datasets", default=ALL_DATASETS)
    ap.add_argument("--prompts-per-dataset", type=int, default=16)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "aiperf")
    a = ap.parse_args()
    if not AIPERF.exists():
        raise SystemExit(f"{AIPERF} not found: run `make aiperf` (it installs AIPerf into build/aiperf-venv)")
    dataset = a.out / "prompts.jsonl"
    n = write_dataset(dataset, a.datasets.split(","), a.prompts_per_dataset)
    cell = a.out / f"{a.mode}_c{a.concurrency}"
    cmd = [str(AIPERF), "profile", "--url", a.url, "--endpoint-type", "chat", "--streaming",
           "--model", model_id(a.url), "--tokenizer", str(a.tokenizer.resolve()),
           "--input-file", str(dataset), "--custom-dataset-type", "single_turn",
           "--dataset-sampling-strategy", "sequential",
           "--concurrency", str(a.concurrency), "--request-count", str(a.requests),
           "--extra-inputs", f"max_tokens:{a.max_tokens}", "--extra-inputs", "temperature:0",
           "--extra-inputs", f"mode:{a.mode}", "--use-server-token-count",
           "--request-timeout-seconds", "900", "--artifact-dir", str(cell), "--ui", "none"]
    print(f"[aiperf] {n} prompts, {a.requests} requests at concurrency {a.concurrency}, mode {a.mode}", flush=True)
    print("[aiperf] " + " ".join(cmd), flush=True)
    sys.exit(subprocess.run(cmd).returncode)


if __name__ == "__main__":
    main()
