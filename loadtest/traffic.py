"""What every Locust user here sends and reads (loadtest/locustfile.py, loadtest/soak_locustfile.py,
tools/llamacpp/llama_locustfile.py): the prompts, the `ssd` model's and llama-server's request bodies, a response's ids.
No Locust listeners, so any locustfile imports it without taking on another's options."""
from __future__ import annotations

import itertools
import os

from ssd_tools.prompts import ALL, load

GENERATE = "/v2/models/ssd/generate"
GENERATE_STREAM = "/v2/models/ssd/generate_stream"
LOOPBACK = ("127.0.0.1", "localhost")  # the load tests target this machine only
# a workload's datasets (SSD_DATASETS): the free-draft workloads of tools/bench/workloads.py, and the
# mix, the load test's usual traffic (HumanEval / GSM8K / MT-Bench interleaved)
WORKLOAD_DATASETS = {"edits": "edits", "agent": "agent", "mix": ALL}


def prompts(datasets: list[str], per_dataset: int) -> list[str]:
    """The first ``per_dataset`` prompts of each dataset, interleaved, so consecutive requests (and
    concurrent users) get different kinds. ``edits`` and ``agent`` are the free-draft workloads
    (tools/bench/workloads.py: HumanEval code edits, repeated tool-call tasks)."""
    from ssd_tools.bench.workloads import WORKLOADS

    sets = [WORKLOADS[ds](per_dataset) if ds in ("edits", "agent") else load(ds, per_dataset) for ds in datasets]
    return [p for group in itertools.zip_longest(*sets) for p in group if p]


def workload_datasets(workload: str) -> str:
    """The SSD_DATASETS value of a named workload (edits, agent, mix)."""
    if workload not in WORKLOAD_DATASETS:
        raise ValueError(f"workload: expected one of {', '.join(WORKLOAD_DATASETS)}, got {workload!r}")
    return WORKLOAD_DATASETS[workload]


def env_datasets() -> list[str]:
    """A locustfile's datasets: SSD_DATASETS, comma-separated, every dataset by default."""
    return [d for d in os.environ.get("SSD_DATASETS", ALL).split(",") if d]


def body(prompt: str, max_tokens: int, mode: str, stream: bool = False, **sampling) -> dict:
    """A generate(_stream) request; greedy unless ``sampling`` sets temperature (and top_p, seed)."""
    return {"text_input": prompt, "max_tokens": max_tokens, "mode": mode, "temperature": 0.0, "stream": stream,
            **sampling}


def llama_chat_body(prompt: str, max_tokens: int, cache_prompt: bool = True) -> dict:
    """llama-server's OpenAI chat request for the same prompt (its GGUF's chat template is the one
    our server applies), greedy; ``cache_prompt`` on is llama-server's default."""
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.0,
            "top_k": 1, "cache_prompt": cache_prompt}


def output_ids(v) -> list[int]:
    """Triton's JSON writes a one-element output_ids as a bare number, not a list."""
    return [] if v is None else (v if isinstance(v, list) else [v])
