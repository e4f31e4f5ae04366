"""Faults and cancellations on a real tritonserver: the engine processes are killed for real.

Each fault is injected with SIGKILL on the engine's Python-backend stub (found in ps by its
instance name, among this server's children only). The orchestrator's supervisor must reload the
model, readiness must say not-ready while it is down, and every output produced across a fault
must equal the target's greedy AR output. Cancelled and disconnected clients must leave no state
in any engine (the engines' live-sequence gauges on /metrics).
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from conftest import TARGET, start_tiny_server

ENGINES = ("target", "drafter_primary", "drafter_backup")
PROMPT = "Write a long story about a dragon."  # the tiny target writes all LONG tokens of it
LONG = 160  # long enough that the fault lands mid-request on this machine
DEADLINE = 180  # seconds any wait may take before the test gives up (no timing is asserted)


@pytest.fixture(scope="module")
def srv(engine_root, tmp_path_factory):
    s = start_tiny_server(engine_root, tmp_path_factory, kv_budget_tokens="2000", max_tokens_limit="2048",
                          max_seq_len="4096")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(engine_root, codec):
    """Target-only greedy tokens for PROMPT, in-process with the same engine files."""
    from ssd.decoding.stopping import StopChecker
    from ssd.engine.engine import ExtendCall, TorchEngine

    e, seq = TorchEngine(engine_root / TARGET, dtype="float32"), codec.encode_prompt(PROMPT)
    checker = StopChecker(codec.decode, LONG, codec.eos_ids)
    while True:
        t = int(e.extend([ExtendCall("rel-ref", seq, 1)])[0][0].argmax())
        seq.append(t)
        if checker.push([t]):
            break
    e.release("rel-ref")
    assert len(checker.tokens) == LONG  # a fault must land mid-request
    return checker.tokens


def _post(s, body: dict, path="generate"):
    req = urllib.request.Request(f"http://{s.http_url}/v2/models/ssd/{path}", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _metrics(s) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{s.address}:{s.metrics_port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if ln and not ln.startswith("#")}


def _live(s) -> dict[str, float]:
    m = _metrics(s)
    return {e: m.get(f'ssd_engine_live_sequences{{model="{e}"}}', 0.0) for e in ENGINES}


def _restarts(s, model: str) -> float:
    return _metrics(s).get(f'ssd_engine_restarts_total{{model="{model}"}}', 0.0)


def _wait(cond, what: str):
    deadline = time.time() + DEADLINE
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _no_state_left(s) -> dict[str, float]:
    """Waits until no engine holds a sequence; returns the gauges then (all zero)."""
    last = {}

    def empty():
        last.update(_live(s))
        return not any(last.values())

    _wait(empty, f"every engine to free its sequences (last seen {last})")
    return last


def stub_pid(s, model: str) -> int:
    """The pid of ``model``'s stub process among this server's children (never another server's)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    pids = [int(ln.split()[0]) for ln in out.splitlines()
            if "triton_python_backend_stub" in ln and int(ln.split()[1]) == s.proc.pid and f" {model}_0_0 " in ln]
    assert len(pids) == 1, (model, pids)
    return pids[0]


def _stream_with_fault(s, body: dict, fault) -> tuple[list[int], str | None, dict | None]:
    """Streams ``body``; calls ``fault()`` once the first chunk arrived. (ids, error, stats).

    ``fault`` must be instant (a kill of a pid found beforehand): the rest of the request runs
    meanwhile, and a ``ps`` on a machine with many processes can outlast it."""
    import http.client

    conn = http.client.HTTPConnection(s.address, s.http_port, timeout=DEADLINE)
    conn.request("POST", "/v2/models/ssd/generate_stream", body=json.dumps({**body, "stream": True}))
    resp = conn.getresponse()
    ids, err, stats, fired = [], None, None, False
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        ev = json.loads(line[5:])
        if "error" in ev:
            err = ev["error"]
            break
        got = ev.get("output_ids", [])
        ids += got if isinstance(got, list) else [got]  # Triton's JSON writes a one-element array as a scalar
        if "stats" in ev:
            stats = json.loads(ev["stats"])
        if not fired:
            fired = True
            fault()
    conn.close()
    return ids, err, stats


def _recovery(s, model: str, restarts_before: float) -> list[tuple[int, int]]:
    """Readiness (server, model) as seen until the model is back; the restart counter moved."""
    seen = []

    def back():
        r = (_status(f"http://{s.http_url}/v2/health/ready"), _status(f"http://{s.http_url}/v2/models/{model}/ready"))
        if not seen or seen[-1] != r:
            seen.append(r)
        return _restarts(s, model) > restarts_before and r == (200, 200)

    _wait(back, f"{model} to be reloaded")
    return seen


def test_every_engine_is_up_and_holds_nothing_at_rest(srv):
    m = _metrics(srv)
    for e in ENGINES:
        assert m[f'ssd_engine_up{{model="{e}"}}'] == 1.0
    assert not any(_no_state_left(srv).values())


def test_drafter_death_mid_request_keeps_output_exact_and_the_drafter_comes_back(srv, reference):
    before, pid = _restarts(srv, "drafter_primary"), stub_pid(srv, "drafter_primary")
    # pinned to SSD (step_aside false): with measured costs the scheduler may run this batch of one
    # as AR rounds, which never call the drafter and so could not notice it dying
    ids, err, stats = _stream_with_fault(srv, {"text_input": PROMPT, "max_tokens": LONG, "mode": "ssd",
                                               "step_aside": False},
                                         lambda: os.kill(pid, signal.SIGKILL))
    assert err is None and ids == reference
    assert stats["degraded"], "the request did not notice its drafter dying"
    seen = _recovery(srv, "drafter_primary", before)
    assert (200, 200) in seen
    # a later request runs with the reloaded drafter: SSD rounds with speculation, nothing degraded
    status, body = _post(srv, {"text_input": PROMPT, "max_tokens": LONG, "mode": "ssd", "step_aside": False})
    assert status == 200, body
    d = json.loads(body)
    later = json.loads(d["stats"])
    assert d["output_ids"] == reference
    assert later["degraded"] == "" and later["cache_hits"] + later["cache_misses"] == later["rounds"] > 0
    assert _restarts(srv, "drafter_primary") == before + 1


def test_target_death_fails_only_the_request_in_flight(srv, reference):
    from ssd.serving.errors import http_status

    for _ in range(5):  # the kill follows the first chunk; on a busy machine the request may end first
        before, pid = _restarts(srv, "target"), stub_pid(srv, "target")
        ids, err, _ = _stream_with_fault(srv, {"text_input": PROMPT, "max_tokens": LONG, "mode": "sd"},
                                         lambda: os.kill(pid, signal.SIGKILL))
        if err is not None:
            break
        assert ids == reference  # it finished before the fault landed: still exact
        _recovery(srv, "target", before)

    assert err is not None and "target" in err and "retry" in err, err
    assert http_status(err) == 503, err  # "engine unavailable: ...": a server-side, retryable failure
    assert ids == reference[:len(ids)]  # what it streamed before the fault was right
    seen = _recovery(srv, "target", before)
    # readiness said not-ready while the target was down (unless the reload beat the first look)
    assert seen[-1] == (200, 200)
    for mode in ("ar", "sd", "ssd"):
        status, body = _post(srv, {"text_input": PROMPT, "max_tokens": LONG, "mode": mode})
        assert status == 200, body
        assert json.loads(body)["output_ids"] == reference, mode
    assert not any(_no_state_left(srv).values())


def test_readiness_drops_while_the_target_reloads_and_a_request_sent_then_waits_for_it(srv):
    before = _restarts(srv, "target")
    codes, stop = set(), threading.Event()

    def watch():  # from before the kill until after the reload: the reload lasts a whole engine build
        while not stop.is_set():
            codes.add((_status(f"http://{srv.http_url}/v2/health/ready"),
                       _status(f"http://{srv.http_url}/v2/models/target/ready")))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    os.kill(stub_pid(srv, "target"), signal.SIGKILL)
    # a request sent while the target is down waits for the reload instead of failing
    _wait(lambda: _status(f"http://{srv.http_url}/v2/models/target/ready") != 200 or _restarts(srv, "target") > before,
          "the target to be found dead")
    status, body = _post(srv, {"text_input": "Say hi.", "max_tokens": 4, "mode": "ar"})
    assert status == 200, body
    seen = _recovery(srv, "target", before)
    stop.set()
    watcher.join()
    assert seen[-1] == (200, 200)
    assert (200, 200) in codes and any(200 not in pair for pair in codes), codes  # both not-ready while down


def test_grpc_cancellation_stops_the_request_and_frees_every_engine(srv):
    import tritonclient.grpc as grpcclient

    def inp(name, arr, dt):
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        return t

    cancelled_before = _metrics(srv).get('ssd_requests_total{mode="ssd",status="cancelled"}', 0.0)
    client = grpcclient.InferenceServerClient(srv.grpc_url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("ssd", [
        inp("text_input", np.array([PROMPT.encode()], dtype=np.object_), "BYTES"),
        inp("max_tokens", np.array([1500], dtype=np.int32), "INT32"),
        # SSD rounds only: the drafter holds the request from its prefill on (a batch on the wide
        # layout leaves the drafter's prefill to its first draft)
        inp("step_aside", np.array([False]), "BOOL"),
        inp("stream", np.array([True]), "BOOL")])
    r, e = got.get(timeout=DEADLINE)
    assert e is None, e
    held = _live(srv)
    assert held["target"] >= 1 and held["drafter_primary"] >= 1  # the request holds state in the engines
    client.stop_stream(cancel_requests=True)
    client.close()
    _wait(lambda: _metrics(srv).get('ssd_requests_total{mode="ssd",status="cancelled"}', 0.0) > cancelled_before,
          "the request to end as cancelled")
    assert not any(_no_state_left(srv).values())
    assert _metrics(srv).get("ssd_active_requests", 0.0) == 0.0


def test_http_disconnect_frees_every_engine(srv):
    import http.client

    conn = http.client.HTTPConnection(srv.address, srv.http_port, timeout=DEADLINE)
    conn.request("POST", "/v2/models/ssd/generate_stream",
                 body=json.dumps({"text_input": PROMPT, "max_tokens": 1500, "stream": True}))
    resp = conn.getresponse()
    while not resp.fp.readline().startswith(b"data:"):
        pass
    assert _live(srv)["target"] >= 1
    conn.sock.close()
    conn.close()
    assert not any(_no_state_left(srv).values())
    _wait(lambda: _metrics(srv).get("ssd_active_requests", 1.0) == 0.0, "no request decoding")


def test_kv_budget_refuses_a_request_that_can_never_fit(srv):
    status, body = _post(srv, {"text_input": PROMPT, "max_tokens": 2000})
    assert status == 400 and "kv_budget_tokens=2000" in body, body


def test_concurrent_requests_across_a_drafter_fault_are_all_exact(srv, reference):
    results: dict[int, tuple[int, str]] = {}

    def one(i):
        results[i] = _post(srv, {"text_input": PROMPT, "max_tokens": LONG, "mode": ("ssd", "sd", "ar")[i % 3]})

    before = _restarts(srv, "drafter_primary")
    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    _wait(lambda: _live(srv)["target"] >= 3, "three requests decoding")
    os.kill(stub_pid(srv, "drafter_primary"), signal.SIGKILL)
    for t in threads:
        t.join()
    for status, body in results.values():
        assert status == 200, body
        assert json.loads(body)["output_ids"] == reference
    _recovery(srv, "drafter_primary", before)
    assert not any(_no_state_left(srv).values())


def test_short_soak_has_no_failures_and_leaves_no_sequences(srv, tmp_path):
    """loadtest/soak.py against this server: every kind of request, a minute, then the books."""
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "soak"
    r = subprocess.run([sys.executable, str(repo / "loadtest" / "soak.py"), "--url", f"http://{srv.http_url}",
                        "--metrics-url", f"http://{srv.address}:{srv.metrics_port}/metrics",
                        "--server-pid", str(srv.proc.pid), "--minutes", "1", "--users", "3", "--max-tokens", "16",
                        "--prompts-per-dataset", "2", "--settle", str(DEADLINE), "--out", str(out)],
                       capture_output=True, text=True, timeout=900)
    rep = json.loads((out / "soak_report.json").read_text())
    outcomes = rep["outcomes"]
    assert r.returncode == 0 and rep["passed"], r.stdout[-3000:] + r.stderr[-3000:]
    assert outcomes.get("ok", 0) + outcomes.get("ok_stream", 0) > 0
    assert outcomes.get("failed", 0) == 0 and outcomes.get("greedy_mismatch", 0) == 0
    assert not any(rep["live_sequences"].values())
    assert set(rep["rss_end"]) >= {"tritonserver", "ssd", *ENGINES} and all(v[1] > 0 for v in rep["rss_end"].values())
    # memory sampled through the run (every 15 s: five samples a minute), with a trend per process
    assert len(rep["rss_samples"]) >= 4 and set(rep["rss_samples"][-1][1]) >= {"tritonserver", "ssd", *ENGINES}
    assert set(rep["rss_second_half_mib_per_min"]) >= {"ssd", *ENGINES} and (out / "soak_memory.png").exists()
