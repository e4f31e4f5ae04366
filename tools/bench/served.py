"""A served `ssd` model for benchmarks: start tritonserver in a core layout, send one generate request.

Decode tokens/s (prefill excluded) come from the server's own per-request statistics. Layouts:
  split   target on core 0, drafter on core 1, one thread each (the paper's one-device-per-model)
  shared2 every engine with 2 threads on both cores (same hardware for everyone)
"""
from __future__ import annotations

import json
import time
import urllib.request

from ssd_tools.serve import engines_by_role
from ssd_tools.triton_launcher import REPO, TritonServer, render_repository

LAYOUTS = {"split": ("0", "1", "1"), "shared2": ("0,1", "0,1", "2")}


def start(layout: str, a) -> TritonServer:
    tcores, dcores, threads = LAYOUTS[layout]
    roles = engines_by_role(a.config)
    repo = render_repository(REPO / "build" / f"bench_repo_{layout}", {
        "ssd": {"tokenizer": roles["target"], "num_draft_tokens": str(a.k), "fanout_budget": str(a.budget),
                "saguaro_c": str(a.c), "backup": a.backup, "max_active_requests": "4"},
        "target": {"engine": roles["target"], "cores": tcores, "threads": threads},
        "drafter_primary": {"engine": roles["drafter"], "cores": dcores, "threads": threads},
        "drafter_backup": {"cores": dcores},
    })
    srv = TritonServer(repo, a.engine_root, log_file=REPO / "build" / f"bench_{layout}.log")
    return srv.start(timeout=900)


def generate(srv: TritonServer, prompt: str, mode: str, a, **extra) -> dict:
    body = {"text_input": prompt, "max_tokens": a.max_tokens, "mode": mode, "temperature": a.temperature, "seed": 1,
            **extra}
    t0 = time.perf_counter()
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/ssd/generate", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=1800) as r:
        d = json.loads(r.read())
    d["stats"] = json.loads(d["stats"])
    d["latency_s"] = time.perf_counter() - t0
    return d
