"""What a client that hangs up costs the server, endpoint by endpoint: a table.

    .venv/bin/python loadtest/hangups.py --url http://127.0.0.1:8000 --grpc 127.0.0.1:8001 \\
        --metrics-url http://127.0.0.1:8002/metrics --openai http://127.0.0.1:9000/v1 [--clients 4]

For each endpoint it sends --clients requests of --max-tokens tokens, waits until they all decode
(the `ssd_active_requests` gauge), hangs every client up at once (closes its connection; a gRPC
client is a process that is killed) and times how long the server takes to get back to where it
was: the active-requests gauge (the request slots) and every engine's live sequences (their KV).
The requests' outcomes (`ssd_requests_total` by status) say what ended them: `cancelled` (the
server saw the hang-up), `timeout` (the request's deadline, `timeout_s`) or `ok` (it ran to its end).
Run it on an idle server (other traffic moves the same gauges) whose `max_active_requests` is at
least --clients; a `generate` request must be decoding before its deadline (--generate-timeout-s).
"""
from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlsplit

ENGINES = ("target", "drafter_primary", "drafter_backup")
PROMPT = "Write a long story about a dragon who learns to cook."
ENDPOINTS = ("generate", "generate_stream", "grpc_stream", "openai_stream", "openai_whole")
# the generate inputs' Triton types, for the gRPC client
GRPC_TYPES = {"text_input": "BYTES", "mode": "BYTES", "max_tokens": "INT32", "stream": "BOOL",
              "step_aside": "BOOL", "timeout_s": "FP32", "temperature": "FP32", "apply_chat_template": "BOOL"}


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if ln and not ln.startswith("#")}


def load(url: str) -> dict[str, float]:
    """The gauges a hang-up must bring back: requests decoding, queued, and each engine's sequences."""
    m = metrics(url)
    out = {"active": m.get("ssd_active_requests", 0.0), "queued": m.get("ssd_queued_requests", 0.0)}
    out.update({e: m.get(f'ssd_engine_live_sequences{{model="{e}"}}', 0.0) for e in ENGINES})
    return out


def outcomes(url: str) -> dict[str, float]:
    """ssd_requests_total summed over modes, by status."""
    out: dict[str, float] = {}
    for k, v in metrics(url).items():
        if k.startswith("ssd_requests_total{") and 'status="' in k:
            status = k.split('status="', 1)[1].split('"', 1)[0]
            out[status] = out.get(status, 0.0) + v
    return out


class HttpClient:
    """One request on its own connection (Triton's generate endpoints or the OpenAI API); ``hang_up``
    closes the socket as a client process that dies would."""

    def __init__(self, base_url: str, path: str, body: dict):
        u = urlsplit(base_url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
        self.conn.request("POST", u.path.rstrip("/") + path, body=json.dumps(body),
                          headers={"Content-Type": "application/json"})

    def hang_up(self) -> None:
        if self.conn.sock is not None:
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()


class GrpcClient:
    """A tritonclient gRPC stream in a child process (``--grpc-client``); ``hang_up`` kills it."""

    def __init__(self, grpc_url: str, body: dict):
        self.proc = subprocess.Popen([sys.executable, __file__, "--grpc-client", grpc_url, json.dumps(body)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def hang_up(self) -> None:
        self.proc.kill()
        self.proc.wait()


def grpc_client(grpc_url: str, body: dict) -> None:
    """The child process of GrpcClient: streams one request and reads it until killed."""
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in body.items():
        dtype = GRPC_TYPES[name]
        arr = np.array([value.encode() if dtype == "BYTES" else value],
                       dtype={"BYTES": np.object_, "INT32": np.int32, "BOOL": np.bool_, "FP32": np.float32}[dtype])
        t = grpcclient.InferInput(name, [1], dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)
    client = grpcclient.InferenceServerClient(grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("ssd", inputs)
    while True:
        got.get()


def openai_model(openai_url: str) -> str:
    with urllib.request.urlopen(openai_url.rstrip("/") + "/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def start_clients(endpoint: str, n: int, urls: dict, max_tokens: int, generate_timeout_s: float,
                  mode: str = "ssd") -> list:
    """``n`` requests on ``endpoint`` (one of ENDPOINTS), each on its own connection."""
    body = {"text_input": PROMPT, "max_tokens": max_tokens, "mode": mode}
    if endpoint == "generate":
        if generate_timeout_s > 0:
            body["timeout_s"] = generate_timeout_s
        return [HttpClient(urls["http"], "/v2/models/ssd/generate", body) for _ in range(n)]
    if endpoint == "generate_stream":
        return [HttpClient(urls["http"], "/v2/models/ssd/generate_stream", {**body, "stream": True})
                for _ in range(n)]
    if endpoint == "grpc_stream":
        return [GrpcClient(urls["grpc"], {**body, "stream": True}) for _ in range(n)]
    chat = {"model": urls["openai_model"], "max_tokens": max_tokens, "mode": mode,
            "messages": [{"role": "user", "content": PROMPT}], "stream": endpoint == "openai_stream"}
    return [HttpClient(urls["openai"], "/chat/completions", chat) for _ in range(n)]


def wait_for(cond, what: str, timeout: float, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class Row:
    endpoint: str
    outcome: dict[str, int] = field(default_factory=dict)
    slot_free_s: float = 0.0  # hang-up -> the active-requests gauge back at its value before
    kv_free_s: float = 0.0  # hang-up -> every engine's live sequences back at their value before


def measure(endpoint: str, n: int, urls: dict, max_tokens: int, generate_timeout_s: float,
            timeout: float = 900.0, mode: str = "ssd") -> Row:
    """Hangs up ``n`` clients of ``endpoint`` while they decode; how long until the server is back."""
    murl = urls["metrics"]
    base, before = load(murl), outcomes(murl)
    clients = start_clients(endpoint, n, urls, max_tokens, generate_timeout_s, mode)
    try:
        def decoding():  # admitted, and past the prefill: the target holds their sequences
            now = load(murl)
            return now["active"] >= base["active"] + n and now["target"] >= base["target"] + n
        wait_for(decoding, f"{n} {endpoint} requests decoding", timeout)
    finally:
        t0 = time.monotonic()
        for c in clients:
            c.hang_up()
    row = Row(endpoint)
    slot = kv = None
    while slot is None or kv is None:
        now = load(murl)
        t = time.monotonic() - t0
        if slot is None and now["active"] <= base["active"] and now["queued"] <= base["queued"]:
            slot = t
        if kv is None and all(now[e] <= base[e] for e in ENGINES):
            kv = t
        if t > timeout:
            raise TimeoutError(f"{endpoint}: the server still holds the hung-up requests after {timeout:.0f} s ({now})")
        time.sleep(0.05)
    # the outcome counters move as each request ends, just before its slot is given back
    wait_for(lambda: sum(outcomes(murl).values()) >= sum(before.values()) + n, "the outcomes counted", 30)
    after = outcomes(murl)
    row.outcome = {k: int(after[k] - before.get(k, 0.0)) for k in after if after[k] > before.get(k, 0.0)}
    row.slot_free_s, row.kv_free_s = slot, kv
    return row


WHAT = {"cancelled": "stopped (the server saw the hang-up)", "timeout": "ran to its deadline (timeout_s)",
        "ok": "ran to its end"}


def markdown(rows: list[Row], n: int, max_tokens: int, generate_timeout_s: float) -> str:
    out = [f"{n} clients per endpoint hang up while decoding (max_tokens {max_tokens}"
           + (f"; `generate` sends timeout_s {generate_timeout_s:g}" if generate_timeout_s > 0 else "") + ")", "",
           "| endpoint | what a hang-up does | requests by outcome | slot free after (s) | KV free after (s) |",
           "|---|---|---|---|---|"]
    for r in rows:
        what = "; ".join(WHAT.get(k, k) for k in sorted(r.outcome, key=lambda k: -r.outcome[k]))
        counts = ", ".join(f"{k} {v}" for k, v in sorted(r.outcome.items()))
        out.append(f"| `{r.endpoint}` | {what} | {counts} | {r.slot_free_s:.2f} | {r.kv_free_s:.2f} |")
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--grpc-client":
        grpc_client(sys.argv[2], json.loads(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="Triton's HTTP endpoint")
    ap.add_argument("--grpc", default="127.0.0.1:8001", help="Triton's gRPC endpoint")
    ap.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    ap.add_argument("--openai", default="http://127.0.0.1:9000/v1", help="the OpenAI API ('' skips its rows)")
    ap.add_argument("--clients", type=int, default=4, help="clients hung up at once per endpoint")
    ap.add_argument("--max-tokens", type=int, default=512, help="long enough that a request outlives its client")
    ap.add_argument("--generate-timeout-s", type=float, default=10.0,
                    help="the deadline `generate` requests send (timeout_s); 0: the server's request_timeout_s")
    ap.add_argument("--mode", default="ssd")
    ap.add_argument("--endpoints", default=",".join(ENDPOINTS))
    ap.add_argument("--json", default=None, help="also write the rows here")
    a = ap.parse_args()
    urls = {"http": a.url, "grpc": a.grpc, "metrics": a.metrics_url, "openai": a.openai}
    endpoints = [e for e in a.endpoints.split(",") if e]
    if a.openai:
        urls["openai_model"] = openai_model(a.openai)
    else:
        endpoints = [e for e in endpoints if not e.startswith("openai")]
    # the first request waits for the engines' cost calibration: not a hang-up's cost
    req = urllib.request.Request(a.url.rstrip("/") + "/v2/models/ssd/generate",
                                 data=json.dumps({"text_input": "Hi", "max_tokens": 4, "mode": a.mode}).encode())
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    rows = []
    for e in endpoints:
        rows.append(measure(e, a.clients, urls, a.max_tokens, a.generate_timeout_s, mode=a.mode))
        print(f"[hangups] {e}: {rows[-1]}", file=sys.stderr, flush=True)
    print(markdown(rows, a.clients, a.max_tokens, a.generate_timeout_s))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([r.__dict__ for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
