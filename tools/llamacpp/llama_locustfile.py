"""Locust users for llama.cpp's llama-server: the load peer of loadtest/locustfile.py.

The same prompts, closed loop, length (SSD_MAX_TOKENS), greedy, iteration limit (-i), TOKENS entries
and SSD_SUMMARY file as the `ssd` model's GenerateUser (the same ClosedLoopUser), sent to
llama-server's OpenAI chat endpoint, which applies the GGUF's own chat template (the Qwen pair's is
the one our server applies). `cache_prompt` is on, llama-server's default: a slot reuses the KV of
the prompt prefix its last request shared (the chat template's system prompt), as our llama.cpp
target keeps a released sequence's prefix. Start the server with as many slots as users:

  python tools/bench/llamacpp.py serve --parallel 4 --port 8090 [--spec]
  locust -f tools/llamacpp/llama_locustfile.py --headless -u 4 -r 4 -i 20 --host http://127.0.0.1:8090
"""
from __future__ import annotations

from locust import task

# its listeners (-i, the host check, the summary) and its closed-loop user
from ssd_loadtest import locustfile as ssd_load


class LlamaServerUser(ssd_load.ClosedLoopUser):
    @task
    def generate(self):
        body = {"messages": [{"role": "user", "content": ssd_load.next_prompt()}], "max_tokens": ssd_load.MAX_TOKENS,
                "temperature": 0.0, "top_k": 1, "cache_prompt": True}
        self.post_counted("/v1/chat/completions", body, "chat", lambda d: int(d["usage"]["completion_tokens"]))
