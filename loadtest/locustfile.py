"""Locust users for the `ssd` model's generate endpoints (closed loop: each user sends the next
request as soon as its previous one finished, so -u N is the number of requests in flight).

  GenerateUser  POST /v2/models/ssd/generate         one JSON response; latency = whole request
  StreamUser    POST /v2/models/ssd/generate_stream  SSE ("data: {...}" lines); latency = whole
                stream, plus TTFT (first token), ITL (gap between streamed chunks; SD/SSD send a
                block of tokens per chunk) and TPOT ((last - first token) / (tokens - 1))

Both also fire a TOKENS/"output_tokens" entry per request whose content size is the number of
output tokens (len(output_ids)), so output tokens/s = its Requests/s x Average Content Size; with
SSD_SUMMARY set, a JSON summary (tokens, first start, last end, exact latencies) is written at exit.

Environment: SSD_MODE (ar|sd|ssd, default ssd), SSD_MAX_TOKENS (default 64), SSD_DATASETS
(default humaneval,gsm8k,mtbench; also edits, agent: the free-draft workloads),
SSD_PROMPTS_PER_DATASET (default 16), SSD_SUMMARY (path).
Greedy (temperature 0). Pick users with the class argument (`locust ... GenerateUser`); bound a run
with --run-time or --iterations/-i (total tasks over all users). Targets are 127.0.0.1 only.

  locust -f loadtest/locustfile.py --headless -u 4 -r 4 -i 20 --host http://127.0.0.1:8000 GenerateUser
"""
from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import gevent
from locust import FastHttpUser, constant, events, task
from locust import stats as locust_stats
from locust.exception import StopUser

from ssd_loadtest import traffic

MODE = os.environ.get("SSD_MODE", "ssd")
MAX_TOKENS = int(os.environ.get("SSD_MAX_TOKENS", "64"))
DATASETS = traffic.env_datasets()
PER_DATASET = int(os.environ.get("SSD_PROMPTS_PER_DATASET", "16"))
SUMMARY = os.environ.get("SSD_SUMMARY", "")
HEADERS = {"Accept-Encoding": "identity"}  # SSE lines must arrive as sent, uncompressed

PROMPTS = traffic.prompts(DATASETS, PER_DATASET)
_next_prompt = itertools.count()

STATE = {"started": 0, "done": 0, "quitting": False, "tokens": 0, "requests": 0, "failures": 0,
         "first_start": None, "last_end": None, "latency_ms": [], "ttft_ms": []}


@events.init_command_line_parser.add_listener
def _(parser):
    parser.add_argument("-i", "--iterations", type=int, default=0,
                        help="stop after this many tasks in total over all users (0: no limit)")


@events.init.add_listener
def _check_host(environment, **_kw):
    host = urlparse(environment.host or "").hostname
    if host not in traffic.LOOPBACK:
        raise SystemExit(f"loadtest: refusing host {environment.host!r}: only http://127.0.0.1:PORT targets")


@events.quitting.add_listener
def _write_summary(environment, **_kw):
    if getattr(environment.parsed_options, "csv_prefix", None):
        # Locust rewrites <prefix>_stats.csv once a second and not at exit: let it write the final numbers.
        gevent.sleep(locust_stats.CSV_STATS_INTERVAL_SEC + 0.3)
    if not SUMMARY:
        return
    s = dict(STATE, mode=MODE, max_tokens=MAX_TOKENS, prompts=len(PROMPTS))
    span = (s["last_end"] - s["first_start"]) if s["first_start"] and s["last_end"] else 0.0
    s["span_s"] = span
    s["output_tokens_per_s"] = s["tokens"] / span if span > 0 else 0.0
    Path(SUMMARY).parent.mkdir(parents=True, exist_ok=True)
    Path(SUMMARY).write_text(json.dumps(s))


def _begin(user) -> float:
    """Takes one iteration (StopUser once --iterations are all taken); returns the start time."""
    limit = user.environment.parsed_options.iterations
    if limit and STATE["started"] >= limit:
        raise StopUser()
    STATE["started"] += 1
    t = time.time()
    if STATE["first_start"] is None:
        STATE["first_start"] = t
    return t


def _end(user, ok: bool, tokens: int, latency_ms: float) -> None:
    STATE["done"] += 1
    STATE["requests"] += 1
    STATE["last_end"] = time.time()
    if ok:
        STATE["tokens"] += tokens
        STATE["latency_ms"].append(latency_ms)
        user.environment.events.request.fire(request_type="TOKENS", name="output_tokens",
                                             response_time=latency_ms, response_length=tokens,
                                             exception=None, context={})
    else:
        STATE["failures"] += 1
    limit = user.environment.parsed_options.iterations
    if limit and STATE["done"] >= limit and not STATE["quitting"]:
        STATE["quitting"] = True
        gevent.spawn_later(0.1, user.environment.runner.quit)  # not from inside this user's greenlet


def next_prompt() -> str:
    """The prompts in turn, shared by all users of this process."""
    return PROMPTS[next(_next_prompt) % len(PROMPTS)]


def _body(stream: bool) -> dict:
    return traffic.body(next_prompt(), MAX_TOKENS, MODE, stream)


class ClosedLoopUser(FastHttpUser):
    """A user that sends its next request as soon as the last one ended, each one counted
    (``_begin``/``_end``: the -i limit, the TOKENS entries, the summary)."""

    abstract = True
    wait_time = constant(0)
    network_timeout = 600.0
    connection_timeout = 60.0

    def post_counted(self, path: str, body: dict, name: str, count: Callable[[dict], int]) -> None:
        """POSTs ``body``; a 200 whose JSON ``count`` reads (the output tokens) is a success; any
        other status, or a body ``count`` raises on, is a failure."""
        _begin(self)
        t0 = time.perf_counter()
        ok, n = False, 0
        with self.client.post(path, json=body, headers=HEADERS, name=name, catch_response=True) as resp:
            try:
                if resp.status_code != 200:
                    resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
                else:
                    n, ok = count(resp.json()), True
            except Exception as e:  # noqa: BLE001 - a malformed body is a failure, not a crash
                resp.failure(f"{type(e).__name__}: {e}")
        _end(self, ok, n, 1000 * (time.perf_counter() - t0))


def _generated(d: dict) -> int:
    if "error" in d or "output_ids" not in d:
        raise ValueError(f"bad response: {str(d)[:200]}")
    return len(traffic.output_ids(d["output_ids"]))


class GenerateUser(ClosedLoopUser):
    @task
    def generate(self):
        self.post_counted(traffic.GENERATE, _body(False), "generate", _generated)


class StreamUser(FastHttpUser):
    wait_time = constant(0)
    network_timeout = 600.0
    connection_timeout = 60.0

    def _fire(self, name: str, ms: float) -> None:
        self.environment.events.request.fire(request_type="SSE", name=name, response_time=ms,
                                             response_length=0, exception=None, context={})

    @task
    def generate_stream(self):
        _begin(self)
        t0 = time.perf_counter()
        ok, n, chunks, stamps, error = False, 0, 0, [], None
        with self.client.post(traffic.GENERATE_STREAM, json=_body(True), headers=HEADERS,
                              name="generate_stream", stream=True, catch_response=True) as resp:
            try:
                if resp.status_code != 200:
                    error = f"HTTP {resp.status_code}: {(resp.text or '')[:200]}"
                else:
                    raw = resp._response  # geventhttpclient response: readline returns as lines arrive
                    while True:
                        line = raw.readline(b"\n")
                        if not line:
                            break
                        line = line.decode("utf-8", "replace").strip()
                        if not line.startswith("data:"):
                            continue
                        d = json.loads(line[5:])
                        if "error" in d:
                            error = f"stream error: {str(d['error'])[:200]}"
                            break
                        k = len(traffic.output_ids(d.get("output_ids")))
                        if k:
                            stamps.append(time.perf_counter())
                            n += k
                            chunks += 1
                    if error is None and n == 0:
                        error = "stream ended without tokens"
            except Exception as e:  # noqa: BLE001
                error = f"{type(e).__name__}: {e}"
            total_ms = 1000 * (time.perf_counter() - t0)
            resp.request_meta["response_time"] = total_ms  # whole stream, not just the headers
            resp.request_meta["response_length"] = n
            if error:
                resp.failure(error)
            else:
                ok = True
                resp.success()
        if ok:
            self._fire("TTFT", 1000 * (stamps[0] - t0))
            for a, b in zip(stamps, stamps[1:]):
                self._fire("ITL", 1000 * (b - a))
            if n > 1:
                self._fire("TPOT", 1000 * (stamps[-1] - stamps[0]) / (n - 1))
            STATE["ttft_ms"].append(1000 * (stamps[0] - t0))
        _end(self, ok, n, total_ms)
