"""Locust users for llama.cpp's llama-server: the load peer of loadtest/locustfile.py.

The same prompts, closed loop, length (SSD_MAX_TOKENS), greedy, iteration limit (-i), TOKENS entries
and SSD_SUMMARY file as the `ssd` model's GenerateUser (it reuses that file's machinery), sent to
llama-server's OpenAI chat endpoint, which applies the GGUF's own chat template (the Qwen pair's is
the one our server applies). Start the server with as many slots as users:

  python tools/bench/llamacpp.py serve --parallel 4 --port 8090 [--spec]
  locust -f tools/llamacpp/llama_locustfile.py --headless -u 4 -r 4 -i 20 --host http://127.0.0.1:8090
"""
from __future__ import annotations

import time

from locust import FastHttpUser, constant, task

from ssd_loadtest import locustfile as ssd_load  # its listeners: -i, the host check, the summary


class LlamaServerUser(FastHttpUser):
    wait_time = constant(0)
    network_timeout = 600.0
    connection_timeout = 60.0

    @task
    def generate(self):
        ssd_load._begin(self)
        prompt = ssd_load.PROMPTS[next(ssd_load._next_prompt) % len(ssd_load.PROMPTS)]
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": ssd_load.MAX_TOKENS,
                "temperature": 0.0, "top_k": 1, "cache_prompt": False}
        t0 = time.perf_counter()
        ok, n = False, 0
        with self.client.post("/v1/chat/completions", json=body, name="chat", catch_response=True) as resp:
            try:
                if resp.status_code != 200:
                    resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
                else:
                    n, ok = int(resp.json()["usage"]["completion_tokens"]), True
            except Exception as e:  # noqa: BLE001 - a malformed body is a failure, not a crash
                resp.failure(f"{type(e).__name__}: {e}")
        ssd_load._end(self, ok, n, 1000 * (time.perf_counter() - t0))
