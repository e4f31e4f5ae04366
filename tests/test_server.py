"""A real tritonserver with the SSD models on loopback: HTTP, gRPC streaming, errors, metrics.

The served greedy output must equal the in-process target's greedy output token for token, in
every mode; bad input gets an error naming the field and the server keeps serving.
"""
from __future__ import annotations

import asyncio
import json
import queue
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from conftest import PROMPTS, TARGET, WEAK, start_tiny_server
from ssd.config import CHOICE_NAMES

MAX_TOKENS = 24


def _post(srv, body: dict, path="generate"):
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/ssd/{path}", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def reference(engines, codec):
    """Target-only greedy tokens, computed in-process with the same engine files."""
    from ssd.decoding.stopping import StopChecker

    e = engines["target"]
    from ssd.engine.engine import ExtendCall

    out = {}
    for i, p in enumerate(PROMPTS[:3]):
        seq = codec.encode_prompt(p)
        checker = StopChecker(codec.decode, MAX_TOKENS, codec.eos_ids)
        while True:
            t = int(e.extend([ExtendCall(f"ref{i}", seq, 1)])[0][0].argmax())
            seq.append(t)
            if checker.push([t]):
                break
        e.release(f"ref{i}")
        out[p] = checker.tokens
    return out


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd", "ssd-pinned"])
def test_http_generate_equals_in_process_greedy(server, reference, codec, mode):
    pinned = mode == "ssd-pinned"  # step_aside false: every round is an SSD round
    mode = "ssd" if pinned else mode
    for prompt, ref in reference.items():
        body = {"text_input": prompt, "max_tokens": MAX_TOKENS, "mode": mode}
        if pinned:
            body["step_aside"] = False
        status, body = _post(server, body)
        assert status == 200, body
        d = json.loads(body)
        assert d["output_ids"] == ref, (mode, prompt)
        assert d["text_output"] == codec.decode(ref)
        stats = json.loads(d["stats"])
        assert stats["mode"] == mode and stats["new_tokens"] == len(ref)
        # the target's forward time comes back through BLS, inside the verify's round trip
        assert stats["verify_forward_ms"] > 0 and stats["verify_outside_forward_ms"] >= 0
        if mode != "ar":
            assert stats["rounds"] >= 1 and stats["acceptance_length"] >= 1.0
        choices = stats["rounds_by_choice"]
        assert sum(choices.values()) == stats["rounds"]  # every round's choice is reported
        if mode != "ssd":
            assert set(choices) == {mode}
        elif pinned:
            assert set(choices) <= {"ssd+neural", "ssd+fast"}
            assert stats["cache_hits"] + stats["cache_misses"] == stats["rounds"]
            assert 0.0 <= stats["p_hit"] <= 1.0
        else:  # the policy's choice, each SSD round with one cache lookup
            ssd_rounds = sum(n for c, n in choices.items() if c.startswith("ssd"))
            assert stats["cache_hits"] + stats["cache_misses"] == ssd_rounds
            assert set(stats["policy_rates_tok_s"]) <= set(CHOICE_NAMES)


def test_grpc_stream_equals_http(server, reference, codec):
    import tritonclient.grpc as grpcclient

    prompt, ref = next(iter(reference.items()))
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))

    def inp(name, arr, dt):
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        return t

    client.async_stream_infer("ssd", [
        inp("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        inp("max_tokens", np.array([MAX_TOKENS], dtype=np.int32), "INT32"),
        inp("stream", np.array([True]), "BOOL"),
        inp("mode", np.array([b"ssd"], dtype=np.object_), "BYTES")], enable_empty_final_response=True)
    chunks, ids, final_stats = [], [], None
    while True:
        r, err = results.get(timeout=300)
        assert err is None, err
        t = r.as_numpy("text_output")
        if t is not None:
            chunks.append(t[0].decode())
            ids += r.as_numpy("output_ids").tolist()
        if r.as_numpy("stats") is not None:
            final_stats = json.loads(r.as_numpy("stats")[0])
        if r.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream(cancel_requests=True)  # every response is in: no wait for the server to close the stream
    assert len(chunks) > 1, "streaming sent everything at once"
    assert ids == ref and "".join(chunks) == codec.decode(ref)
    assert final_stats is not None and final_stats["mode"] == "ssd"


@pytest.mark.parametrize("body,field", [
    ({"max_tokens": 8}, "text_input"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "top_p": 1.5}, "top_p"),
    ({"text_input": "hi", "mode": "turbo"}, "mode"),
    ({"text_input": "hi", "num_draft_tokens": 99}, "num_draft_tokens"),
    ({"text_input": "hi", "saguaro_c": 2.0}, "saguaro_c"),
    ({"text_input": "hi", "backup": "psychic"}, "backup"),
])
def test_bad_input_names_the_field_and_server_survives(server, body, field):
    status, text = _post(server, body)
    assert status == 400, text
    assert field in text
    ok, good = _post(server, {"text_input": "Say hi.", "max_tokens": 4, "mode": "ar"})
    assert ok == 200 and json.loads(good)["text_output"]


def test_bad_request_does_not_disturb_concurrent_ones(server, reference):
    prompt, ref = next(iter(reference.items()))
    results = {}

    def good(i):
        results[i] = _post(server, {"text_input": prompt, "max_tokens": MAX_TOKENS, "mode": "sd"})

    threads = [threading.Thread(target=good, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    bad = [_post(server, {"text_input": "x", "top_k": -3}) for _ in range(3)]
    for t in threads:
        t.join()
    assert all(s == 400 and "top_k" in b for s, b in bad)
    for status, body in results.values():
        assert status == 200 and json.loads(body)["output_ids"] == ref


def test_stop_strings_and_generate_stream(server, reference, codec):
    prompt, ref = next(iter(reference.items()))
    full = codec.decode(ref)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    status, body = _post(server, {"text_input": prompt, "max_tokens": MAX_TOKENS, "stop": [stop], "mode": "ssd"})
    assert status == 200
    d = json.loads(body)
    assert d["text_output"] == full[: full.index(stop)] and d["finish_reason"] == "stop"
    status, sse = _post(server, {"text_input": prompt, "max_tokens": MAX_TOKENS, "stream": True, "mode": "sd"},
                        path="generate_stream")
    assert status == 200
    events = [json.loads(line[5:]) for line in sse.splitlines() if line.startswith("data:")]
    assert len(events) > 1 and "".join(e["text_output"] for e in events) == full


def test_metrics_count_requests(server):
    with urllib.request.urlopen(f"http://{server.address}:{server.metrics_port}/metrics") as r:
        before = r.read().decode()

    def count(text, mode):
        total = 0.0
        for line in text.splitlines():
            if line.startswith("ssd_requests_total{") and f'mode="{mode}"' in line and 'status="ok"' in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    for _ in range(2):  # SSD rounds (step_aside off): they look the speculation cache up, so its counter exists
        assert _post(server, {"text_input": "Count to three.", "max_tokens": 6, "mode": "ssd",
                              "step_aside": False})[0] == 200
    with urllib.request.urlopen(f"http://{server.address}:{server.metrics_port}/metrics") as r:
        after = r.read().decode()
    assert count(after, "ssd") - count(before, "ssd") == 2
    for name in ("ssd_output_tokens_total", "ssd_rounds_total", "ssd_cache_lookups_total", "ssd_active_requests",
                 "ssd_prompt_tokens_total", "ssd_prompt_tokens_cached_total"):
        assert name in after


def test_client_disconnect_mid_stream_frees_the_request(server, reference):
    """A client that drops its SSE stream must not leave a request decoding or disturb the next."""
    import http.client
    import time

    conn = http.client.HTTPConnection(server.address, server.http_port, timeout=120)
    conn.request("POST", "/v2/models/ssd/generate_stream",
                 body=json.dumps({"text_input": "Count from one to two hundred.", "max_tokens": 400,
                                  "stream": True, "mode": "ssd"}))
    resp = conn.getresponse()
    first = resp.fp.readline()
    while not first.startswith(b"data:"):
        first = resp.fp.readline()
    conn.sock.close()  # the client goes away mid-generation
    conn.close()

    def active() -> float:
        with urllib.request.urlopen(f"http://{server.address}:{server.metrics_port}/metrics") as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("ssd_active_requests"))

    deadline = time.time() + 120
    while active() > 0 and time.time() < deadline:
        time.sleep(0.5)
    assert active() == 0
    prompt, ref = next(iter(reference.items()))
    status, body = _post(server, {"text_input": prompt, "max_tokens": MAX_TOKENS, "mode": "ssd"})
    assert status == 200 and json.loads(body)["output_ids"] == ref


@pytest.mark.parametrize("choice", ["sd@wide", "ar@wide"])
def test_wide_rounds_give_the_lone_ar_output(engine_root, tmp_path_factory, reference, choice):
    """Every round on the wide layout (the engine at work on both cores, two threads where its rows
    keep their bits), the prefill too: the served greedy output is still the target's own."""
    srv = start_tiny_server(engine_root, tmp_path_factory, force_mode=choice)
    try:
        for prompt, ref in reference.items():
            status, body = _post(srv, {"text_input": prompt, "max_tokens": MAX_TOKENS, "mode": "ssd"})
            assert status == 200, body
            d = json.loads(body)
            assert d["output_ids"] == ref, (choice, prompt)
            stats = json.loads(d["stats"])
            assert set(stats["rounds_by_choice"]) == {choice}
            assert stats["prefill_threads"] == 2  # the prompt too is prefilled on both cores
    finally:
        srv.stop()


@pytest.mark.parametrize("model, name", [("target", "max_lenn"), ("ssd", "explor")])
def test_a_misspelled_parameter_stops_the_load_naming_it_and_the_model(tmp_path, model, name):
    """A real tritonserver on a repository whose `model` has a misspelled parameter: the model fails
    to load (and so does the server), and the error names the parameter and the model. The check runs
    before any weights load: no engines are needed."""
    import shutil

    from ssd_tools.triton_launcher import TritonServer, render_repository

    repo = render_repository(tmp_path / "models", {model: {name: "1"}})
    for other in repo.iterdir():  # the model alone: its own error, quickly
        if other.name != model:
            shutil.rmtree(other)
    log = tmp_path / "tritonserver.log"
    srv = TritonServer(repo, tmp_path / "engines", log_file=log)
    try:
        # an engine loads with the server (which exits); the orchestrator after it (the launcher's load fails)
        with pytest.raises(RuntimeError, match="tritonserver (exited|could not load)"):
            srv.start(timeout=300)
    finally:
        srv.stop()
    text = log.read_text()
    assert f"model '{model}': parameter '{name}': unknown (known: " in text, text[-3000:]
    assert f"failed to load '{model}'" in text, text[-3000:]
