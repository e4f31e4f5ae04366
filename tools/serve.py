"""`make serve`: build the engines if missing, start tritonserver with the SSD models and the
OpenAI-compatible frontend (http://127.0.0.1:9000/v1, frontends/openai_api/) beside it, wait.

Prints the endpoints and an example request once every model is READY; Ctrl-C stops Triton and its
model processes. On CPU the target gets core 0 and the drafter core 1 (one thread each), which is
the paper's "own device per model" protocol on this machine; override with --target-cores etc.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import yaml

from ssd_tools.openai_launcher import OpenAIFrontend
from ssd_tools.triton_launcher import REPO, TritonServer, render_repository


def engines_by_role(config: Path) -> dict[str, str]:
    cfg = yaml.safe_load(config.read_text())
    return {spec["role"]: name for name, spec in cfg["engines"].items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", type=Path, default=REPO / "engines/default.yaml")
    ap.add_argument("--engine-root", type=Path, default=REPO / "engines")
    ap.add_argument("--http-port", type=int, default=8000)
    ap.add_argument("--grpc-port", type=int, default=8001)
    ap.add_argument("--metrics-port", type=int, default=8002)
    ap.add_argument("--address", default="127.0.0.1", help="listen address (default loopback only)")
    ap.add_argument("--target-cores", default="0")
    ap.add_argument("--drafter-cores", default="1")
    ap.add_argument("--threads", default="1", help="torch threads per engine process")
    ap.add_argument("--mode", default="ssd", choices=["ar", "sd", "ssd"], help="default decoding mode")
    ap.add_argument("--work-dir", type=Path, default=REPO / "build", help="rendered model repository and logs")
    ap.add_argument("--openai-port", type=int, default=9000, help="OpenAI-compatible frontend's port (0: none)")
    a = ap.parse_args()
    roles = engines_by_role(a.config)
    repo = render_repository(a.work_dir / "model_repository", {
        "ssd": {"tokenizer": roles["target"], "default_mode": a.mode},
        "target": {"engine": roles["target"], "cores": a.target_cores, "threads": a.threads},
        "drafter_primary": {"engine": roles["drafter"], "cores": a.drafter_cores, "threads": a.threads},
        "drafter_backup": {"cores": a.drafter_cores},
    })
    server = TritonServer(repo, a.engine_root, http_port=a.http_port, grpc_port=a.grpc_port,
                          metrics_port=a.metrics_port, address=a.address,
                          log_file=a.work_dir / "tritonserver.log")
    print(f"[serve] starting tritonserver (log: {server.log_file}) ...", flush=True)
    t0 = time.time()
    shown: dict[str, str] = {}

    def progress(states: dict[str, str]) -> None:
        engines_up = all(s == "READY" for m, s in states.items() if m != "ssd")
        for model, state in states.items():
            label = ("LOADING: measuring the engines' costs (its warmup request)"
                     if model == "ssd" and state == "LOADING" and engines_up else state or "waiting for the engines")
            if shown.get(model) != label:
                shown[model] = label
                print(f"[serve] {time.time() - t0:4.0f} s  {model}: {label}", flush=True)

    server.start(timeout=900, progress=progress)
    print(f"[serve] ready in {time.time() - t0:.0f} s: target={roles['target']} drafter={roles['drafter']}")
    print(f"[serve] HTTP    http://{server.http_url}   gRPC {server.grpc_url}   "
          f"metrics http://{server.address}:{server.metrics_port}/metrics")
    frontend = None
    if a.openai_port:
        frontend = OpenAIFrontend(a.engine_root / roles["target"], server.grpc_url, port=a.openai_port,
                                  host=a.address, log_file=a.work_dir / "openai_frontend.log")
        try:
            frontend.start()
        except (RuntimeError, TimeoutError):
            server.stop()
            raise
        print(f"[serve] OpenAI  {frontend.base_url}  (model '{roles['target']}', log: {frontend.log_file})")
    print(f"""[serve] try:
  curl -s {server.http_url}/v2/models/ssd/generate -d '{{"text_input": "Write a Python function that checks whether a number is prime.", "max_tokens": 64}}'
  .venv/bin/python examples/http_client.py --url http://{server.http_url} "Write a quicksort in Python."
  .venv/bin/python examples/grpc_stream_client.py --url {server.grpc_url} "Explain recursion in one paragraph."
  .venv/bin/python examples/openai_client.py --url http://{a.address}:{a.openai_port}/v1 "Write a haiku about caches."
  curl -sN http://{a.address}:{a.openai_port}/v1/chat/completions -H 'Content-Type: application/json' -d '{{"model": "{roles['target']}", "messages": [{{"role": "user", "content": "Write a haiku about caches."}}], "stream": true}}'
[serve] Ctrl-C to stop.""", flush=True)
    stop = {"now": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(now=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        while not stop["now"] and server.proc.poll() is None:
            time.sleep(0.5)
    finally:
        print("[serve] stopping ...", flush=True)
        if frontend is not None:
            frontend.stop()
        server.stop()
        print("[serve] stopped", flush=True)
    if not stop["now"]:  # tritonserver died on its own: a non-zero exit lets a supervisor (systemd, k8s) restart it
        sys.exit(f"[serve] tritonserver exited with code {server.proc.returncode}; see {server.log_file}")


if __name__ == "__main__":
    main()
