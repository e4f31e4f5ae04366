"""Concurrent clients against a real tritonserver on the tiny engines, and a Locust smoke run.

Eight clients at once (mixed ar / sd / ssd, greedy) must each get exactly the output the same
request gets alone, exactly one response per request, and the Prometheus counters must add up.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import PROMPTS, REPO, TARGET

MODES = ("ar", "sd", "ssd")
MAX_TOKENS = 16
N_CLIENTS = 8
PER_CLIENT = 3
N_REQUESTS = N_CLIENTS * PER_CLIENT


def plan(r: int) -> tuple[int, str]:
    """Request r: prompt index (cycling over PROMPTS) and mode (every prompt meets every mode, and
    the 8 requests in flight together mix all three)."""
    return r % len(PROMPTS), MODES[(r + r // len(PROMPTS)) % len(MODES)]


def _generate(srv, prompt: str, mode: str, req_id: str) -> tuple[int, dict | str]:
    body = {"id": req_id, "text_input": prompt, "max_tokens": MAX_TOKENS, "mode": mode, "temperature": 0.0}
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/ssd/generate", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _ids(d: dict) -> list[int]:
    v = d["output_ids"]
    return v if isinstance(v, list) else [v]  # Triton's JSON writes a one-element tensor as a number


def _metrics(srv) -> str:
    with urllib.request.urlopen(f"http://{srv.address}:{srv.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def _sum(text: str, name: str, **labels) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_concurrent_requests_equal_single_requests(server):
    before = _metrics(server)
    sent: list[list[int]] = []  # output ids of every request this test sent

    # 1. single-request outputs, one at a time
    reference: dict[tuple[int, str], list[int]] = {}
    for r in range(N_REQUESTS):
        key = plan(r)
        if key in reference:
            continue
        status, d = _generate(server, PROMPTS[key[0]], key[1], f"ref{r}")
        assert status == 200, d
        reference[key] = _ids(d)
        sent.append(reference[key])
        assert 0 < len(reference[key]) <= MAX_TOKENS

    # 2. the same requests from 8 clients at once
    results: list[tuple[int, int, dict | str]] = []
    lock = threading.Lock()
    barrier = threading.Barrier(N_CLIENTS)

    def client(c: int) -> None:
        barrier.wait()
        for r in range(c, N_REQUESTS, N_CLIENTS):
            p, mode = plan(r)
            status, d = _generate(server, PROMPTS[p], mode, f"req{r}")
            with lock:
                results.append((r, status, d))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(N_CLIENTS)]
    t0 = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a client hung"
    elapsed = time.time() - t0

    # exactly one response per request, every one a 200 carrying its own id
    assert sorted(r for r, _, _ in results) == list(range(N_REQUESTS)), [r for r, _, _ in results]
    wrong = []
    for r, status, d in sorted(results, key=lambda x: x[0]):
        assert status == 200, (r, d)
        assert d["id"] == f"req{r}", (r, d["id"])
        key = plan(r)
        got = _ids(d)
        sent.append(got)
        assert json.loads(d["stats"])["mode"] == key[1]
        if got != reference[key]:
            wrong.append((r, key, got, reference[key]))
    assert not wrong, f"{len(wrong)}/{N_REQUESTS} concurrent outputs differ from the single-request ones " \
                      f"(request, (prompt, mode), got, expected): {wrong}"

    # 3. the counters add up (the orchestrator counts a request right after its final response,
    #    so the last increments may land a moment after the client has its answer)
    want_requests, want_tokens = len(sent), sum(len(ids) for ids in sent)
    deadline = time.time() + 15
    while True:
        after = _metrics(server)
        got_requests = sum(_sum(after, "ssd_requests_total", mode=m, status="ok") -
                           _sum(before, "ssd_requests_total", mode=m, status="ok") for m in MODES)
        got_tokens = _sum(after, "ssd_output_tokens_total") - _sum(before, "ssd_output_tokens_total")
        if (got_requests, got_tokens) == (want_requests, want_tokens) or time.time() > deadline:
            break
        time.sleep(0.25)
    assert got_requests == want_requests
    assert got_tokens == want_tokens
    # every round of every request is one policy decision (choice + reason) in the metrics
    d_rounds = _sum(after, "ssd_rounds_total") - _sum(before, "ssd_rounds_total")
    d_decisions = _sum(after, "ssd_policy_decisions_total") - _sum(before, "ssd_policy_decisions_total")
    assert d_rounds > 0 and d_decisions == d_rounds
    assert _sum(after, "ssd_policy_decisions_total", choice="ar", reason="request") > \
        _sum(before, "ssd_policy_decisions_total", choice="ar", reason="request")
    for status in ("error", "invalid", "cancelled"):
        assert _sum(after, "ssd_requests_total", status=status) == _sum(before, "ssd_requests_total", status=status)
    assert _sum(after, "ssd_rejected_busy_total") == _sum(before, "ssd_rejected_busy_total")
    assert _sum(after, "ssd_active_requests") == 0
    print(f"\n{N_REQUESTS} concurrent requests from {N_CLIENTS} clients in {elapsed:.1f} s, "
          f"{len(reference)} references")


def test_locust_smoke(server, tmp_path):
    prefix = tmp_path / "smoke"
    exe = Path(sys.executable).parent / "locust"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "locust"]
    cmd += ["-f", str(REPO / "loadtest" / "locustfile.py"), "--headless", "-u", "2", "-r", "2", "-i", "4",
            "--run-time", "150s", "--stop-timeout", "60", "--host", f"http://{server.http_url}",
            "--csv", str(prefix), "--only-summary", "GenerateUser", "StreamUser"]
    env = dict(os.environ, SSD_MAX_TOKENS="8", SSD_MODE="ssd", SSD_SUMMARY=str(tmp_path / "summary.json"))
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    with open(f"{prefix}_stats.csv") as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    total = rows["Aggregated"]
    assert int(total["Failure Count"]) == 0, rows
    assert int(total["Request Count"]) > 0
    # 4 iterations in all, one user of each class: both endpoints were exercised, nothing more
    n_gen, n_stream = int(rows["generate"]["Request Count"]), int(rows["generate_stream"]["Request Count"])
    assert n_gen >= 1 and n_stream >= 1 and n_gen + n_stream == 4, rows
    assert int(rows["TTFT"]["Request Count"]) == n_stream
    assert int(rows["output_tokens"]["Request Count"]) == 4
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["failures"] == 0 and 4 <= summary["tokens"] <= 4 * 8 and summary["output_tokens_per_s"] > 0
