"""A small client for the `ssd` model: HTTP (whole response) or gRPC (optionally streamed).

    python tools/client.py "Write a quicksort in Python."                 # HTTP, localhost:8000
    python tools/client.py --grpc --stream "Explain recursion."           # gRPC stream, localhost:8001
"""
from __future__ import annotations

import argparse
import json
import queue
import sys

import numpy as np


def _inputs(module, prompt: str, a) -> list:
    fields = [("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
              ("max_tokens", np.array([a.max_tokens], dtype=np.int32), "INT32"),
              ("temperature", np.array([a.temperature], dtype=np.float32), "FP32"),
              ("seed", np.array([a.seed], dtype=np.int64), "INT64"),
              ("mode", np.array([a.mode.encode()], dtype=np.object_), "BYTES"),
              ("stream", np.array([a.stream], dtype=bool), "BOOL")]
    out = []
    for name, arr, dt in fields:
        t = module.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def run_http(prompt: str, a) -> None:
    import tritonclient.http as http

    client = http.InferenceServerClient(a.url)
    res = client.infer("ssd", _inputs(http, prompt, a))
    print(res.as_numpy("text_output")[0].decode())
    if a.stats:
        print(json.dumps(json.loads(res.as_numpy("stats")[0]), indent=1), file=sys.stderr)


def run_grpc(prompt: str, a) -> None:
    import tritonclient.grpc as grpc

    client = grpc.InferenceServerClient(a.url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer("ssd", _inputs(grpc, prompt, a), enable_empty_final_response=True)
    while True:
        result, error = results.get()
        if error is not None:
            client.stop_stream()
            raise SystemExit(f"error: {error}")
        final = result.get_response().parameters.get("triton_final_response")
        text = result.as_numpy("text_output")
        if text is not None and len(text):
            print(text[0].decode(), end="", flush=True)
        stats = result.as_numpy("stats")
        if a.stats and stats is not None:
            print("\n" + json.dumps(json.loads(stats[0]), indent=1), file=sys.stderr)
        if final is not None and final.bool_param:
            break
    print()
    client.stop_stream()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt")
    ap.add_argument("--grpc", action="store_true")
    ap.add_argument("--url", default=None)
    ap.add_argument("--stream", action="store_true")
    ap.add_argument("--mode", default="ssd", choices=["ar", "sd", "ssd"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stats", action="store_true", help="print per-request statistics to stderr")
    a = ap.parse_args()
    if a.grpc:
        a.url = a.url or "localhost:8001"
        run_grpc(a.prompt, a)
    else:
        if a.stream:
            raise SystemExit("--stream needs --grpc (or use the HTTP endpoint /v2/models/ssd/generate_stream)")
        a.url = a.url or "localhost:8000"
        run_http(a.prompt, a)


if __name__ == "__main__":
    main()
