"""The OpenAI-compatible endpoint with the official `openai` client, streamed chat.

    python examples/openai_client.py "Write a haiku about caches."  [--url http://127.0.0.1:9000/v1]

SSD's knobs go in `extra_body`; the request's statistics come back in the last chunk's `ssd_stats`.
"""
import argparse

from openai import OpenAI

ap = argparse.ArgumentParser()
ap.add_argument("prompt")
ap.add_argument("--url", default="http://127.0.0.1:9000/v1")
ap.add_argument("--max-tokens", type=int, default=128)
a = ap.parse_args()

client = OpenAI(base_url=a.url, api_key="not-needed")
model = client.models.list().data[0].id
stream = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": a.prompt}], max_tokens=a.max_tokens,
    temperature=0, stream=True, extra_body={"mode": "ssd", "num_draft_tokens": 4})
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
    stats = (chunk.model_extra or {}).get("ssd_stats")
print()
if stats:
    print(f"[{stats['new_tokens']} tokens, {stats['acceptance_length']} per round, p_hit {stats['p_hit']}]")
