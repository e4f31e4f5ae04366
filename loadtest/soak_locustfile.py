"""The soak's Locust user: a mix of what real clients do, each outcome counted.

Per iteration one of (weights in brackets):
  good [6]    generate or generate_stream (half each), mode ar | sd | ssd, greedy (2 in 3) or
              sampled (temperature 0.7, top_p 0.95, a seed); must answer 200 with tokens. Greedy
              outputs of one prompt must be identical in every mode and under any load (the
              target is batch-invariant): a different one is a failure ("greedy_mismatch").
  cancel [1]  generate_stream, then the client hangs up after the first chunk.
  bad [1]     a malformed request; must get an error that names the bad field.
Closed loop (-u N: N requests in flight). At exit the counts go to SSD_SOAK_SUMMARY (JSON).
Environment: SSD_MAX_TOKENS (default 32), SSD_DATASETS, SSD_PROMPTS_PER_DATASET (default 8).
Requests go through http.client on Locust's gevent-patched sockets, so a cancel is a real hang-up.
"""
from __future__ import annotations

import http.client
import json
import os
import random
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

from locust import User, constant, events, task

from ssd_loadtest import traffic

MAX_TOKENS = int(os.environ.get("SSD_MAX_TOKENS", "32"))
DATASETS = traffic.env_datasets()
PER_DATASET = int(os.environ.get("SSD_PROMPTS_PER_DATASET", "8"))
SUMMARY = os.environ.get("SSD_SOAK_SUMMARY", "")
MODES = ("ar", "sd", "ssd")
BAD = [  # (body, the field its error must name)
    ({"max_tokens": 8}, "text_input"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "top_p": 1.5}, "top_p"),
    ({"text_input": "hi", "mode": "turbo"}, "mode"),
    ({"text_input": "hi", "num_draft_tokens": 99}, "num_draft_tokens"),
    ({"text_input": "hi", "backup": "psychic"}, "backup"),
    ({"text_input": "hi", "top_k": -3}, "top_k"),
]

PROMPTS = traffic.prompts(DATASETS, PER_DATASET)
COUNTS: Counter = Counter()
ERRORS: Counter = Counter()  # failure messages (first 160 characters), for the report
GREEDY: dict[str, list[int]] = {}


@events.quitting.add_listener
def _write_summary(environment, **_kw):
    if SUMMARY:
        Path(SUMMARY).write_text(json.dumps({"outcomes": dict(COUNTS), "errors": dict(ERRORS.most_common(20)),
                                             "greedy_prompts": len(GREEDY)}))


class SoakUser(User):
    wait_time = constant(0)

    def on_start(self):
        u = urlparse(self.host)
        if u.hostname not in traffic.LOOPBACK:
            raise SystemExit(f"soak: refusing host {self.host!r}: only http://127.0.0.1:PORT targets")
        self.addr = (u.hostname, u.port or 80)
        self.rng = random.Random()

    def _open(self, path: str, body: dict):
        conn = http.client.HTTPConnection(*self.addr, timeout=600)
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        return conn, conn.getresponse()

    def _record(self, name: str, t0: float, outcome: str, error: str | None = None) -> None:
        COUNTS[outcome] += 1
        if error:
            ERRORS[f"{outcome}: {error[:160]}"] += 1
        self.environment.events.request.fire(
            request_type="SOAK", name=name, response_time=1000 * (time.perf_counter() - t0), response_length=0,
            exception=Exception(error) if error else None, context={})

    @task(6)
    def good(self):
        prompt = self.rng.choice(PROMPTS)
        mode, stream, greedy = self.rng.choice(MODES), self.rng.random() < 0.5, self.rng.random() < 2 / 3
        sampling = {} if greedy else {"temperature": 0.7, "top_p": 0.95, "seed": self.rng.randrange(2**31)}
        body = traffic.body(prompt, MAX_TOKENS, mode, stream, **sampling)
        name = f"good {'stream' if stream else 'whole'} {'greedy' if greedy else 'sampled'}"
        t0 = time.perf_counter()
        ids, error = [], None
        try:
            if stream:
                conn, resp = self._open(traffic.GENERATE_STREAM, body)
                if resp.status != 200:
                    error = f"HTTP {resp.status}: {resp.read()[:160]!r}"
                for raw in resp if error is None else ():
                    line = raw.decode("utf-8", "replace").strip()
                    if line.startswith("data:"):
                        ev = json.loads(line[5:])
                        if "error" in ev:
                            error = f"stream error: {ev['error']}"
                            break
                        ids += traffic.output_ids(ev.get("output_ids"))
            else:
                conn, resp = self._open(traffic.GENERATE, body)
                data = resp.read()
                if resp.status != 200:
                    error = f"HTTP {resp.status}: {data[:160]!r}"
                else:
                    ids = traffic.output_ids(json.loads(data).get("output_ids"))
            conn.close()
        except Exception as e:  # noqa: BLE001 - a broken connection is a failure to count
            error = f"{type(e).__name__}: {e}"
        if error is None and not ids:
            error = "no tokens"
        if error is not None:
            self._record(name, t0, "failed", error)
            return
        if greedy:
            first = GREEDY.setdefault(prompt, ids)
            if first != ids:
                self._record(name, t0, "greedy_mismatch", f"mode {mode}: output differs from the first greedy one")
                return
        self._record(name, t0, "ok_stream" if stream else "ok")

    @task(1)
    def cancel(self):
        body = traffic.body(self.rng.choice(PROMPTS), MAX_TOKENS * 4, self.rng.choice(MODES), stream=True)
        t0 = time.perf_counter()
        try:
            conn, resp = self._open(traffic.GENERATE_STREAM, body)
            while resp.status == 200 and not resp.fp.readline().startswith(b"data:"):
                pass
            conn.sock.close()  # hang up mid-stream
            conn.close()
        except Exception as e:  # noqa: BLE001
            self._record("cancel", t0, "cancel_failed", f"{type(e).__name__}: {e}")
            return
        self._record("cancel", t0, "cancelled")

    @task(1)
    def bad(self):
        body, field = self.rng.choice(BAD)
        t0 = time.perf_counter()
        try:
            conn, resp = self._open(traffic.GENERATE, body)
            text = resp.read().decode("utf-8", "replace")
            conn.close()
        except Exception as e:  # noqa: BLE001
            self._record("bad", t0, "bad_unanswered", f"{type(e).__name__}: {e}")
            return
        if resp.status == 400 and field in text:
            self._record("bad", t0, "bad_rejected")
        else:
            self._record("bad", t0, "bad_unanswered", f"bad request for {field!r} got HTTP {resp.status}: {text[:120]}")
