"""Triton's HTTP endpoint: the generate extension, whole (`generate`) or streamed (`generate_stream`).

    python examples/http_client.py "Write a quicksort in Python."  [--url http://localhost:8000] [--stream]

The `ssd` model is decoupled (it can stream), and Triton's HTTP `infer` (tritonclient.http) serves
only non-decoupled models, so HTTP clients use the generate extension: plain JSON in and out.
"""
import argparse
import json

import requests

ap = argparse.ArgumentParser()
ap.add_argument("prompt")
ap.add_argument("--url", default="http://localhost:8000")
ap.add_argument("--max-tokens", type=int, default=128)
ap.add_argument("--stream", action="store_true")
a = ap.parse_args()

body = {"text_input": a.prompt, "max_tokens": a.max_tokens, "temperature": 0.0,
        "mode": "ssd"}  # ar | sd | ssd; also num_draft_tokens, saguaro_c, ...
if a.stream:
    with requests.post(f"{a.url}/v2/models/ssd/generate_stream", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data:"):
                event = json.loads(line[5:])
                print(event["text_output"], end="", flush=True)
                stats = event.get("stats")
    print()
else:
    r = requests.post(f"{a.url}/v2/models/ssd/generate", json=body, timeout=600)
    if not r.ok:
        raise SystemExit(f"error {r.status_code}: {r.json()['error']}")
    event = r.json()
    print(event["text_output"])
    stats = event["stats"]
stats = json.loads(stats)
print(f"[{stats['new_tokens']} tokens, {stats['acceptance_length']} per round, p_hit {stats['p_hit']}]")
