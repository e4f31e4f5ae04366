"""Locust users for llama.cpp's llama-server: the load peer of loadtest/locustfile.py.

The same prompts, closed loop, length (SSD_MAX_TOKENS), greedy, iteration limit (-i), TOKENS entries
and SSD_SUMMARY file as the `ssd` model's GenerateUser (the same ClosedLoopUser), sent to
llama-server's OpenAI chat endpoint, which applies the GGUF's own chat template (the Qwen pair's is
the one our server applies). `cache_prompt` is on, llama-server's default: a slot reuses the KV of
the prompt prefix its last request shared (the chat template's system prompt), as our llama.cpp
target keeps a released sequence's prefix. Start the server with as many slots as users:

  python tools/bench/llamacpp.py serve --parallel 4 --port 8090 [--side llama-ngram-mod]
  locust -f tools/llamacpp/llama_locustfile.py --headless -u 4 -r 4 -i 20 --host http://127.0.0.1:8090
"""
from __future__ import annotations

from locust import task

# its listeners (-i, the host check, the summary) and its closed-loop user
from ssd_loadtest import locustfile as ssd_load
from ssd_loadtest.traffic import llama_chat_body


class LlamaServerUser(ssd_load.ClosedLoopUser):
    @task
    def generate(self):
        body = llama_chat_body(ssd_load.next_prompt(), ssd_load.MAX_TOKENS)
        self.post_counted("/v1/chat/completions", body, "chat", lambda d: int(d["usage"]["completion_tokens"]))
