"""Clients that hang up, and clients over the request limit, on a real tritonserver and OpenAI frontend.

Every endpoint: clients hang up (close their connection; a gRPC client process is killed) while
their requests decode, and the server must end those requests (counted `cancelled`, or `timeout`
where Triton gives no signal: a non-streamed HTTP generate ends at its deadline), give back their
slots and leave no sequence in any engine. Over `max_active_requests` a request waits in the queue
instead of being refused, and a closed loop at exactly the limit, started right after clients
were dropped mid-request, has no failure. The waits poll the server's gauges with a generous bound;
no timing is asserted.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.request

import openai
import pytest

from conftest import TARGET, start_tiny_server
from ssd_loadtest.hangups import ENGINES, PROMPT, GrpcClient, HttpClient, load, measure, outcomes, wait_for

LIMIT = 2  # max_active_requests of this server
LONG = 1500  # a hung-up request must still be decoding when its client goes
DEADLINE = 300  # seconds any wait may take before the test gives up


@pytest.fixture(scope="module")
def srv(engine_root, tmp_path_factory):
    s = start_tiny_server(engine_root, tmp_path_factory, max_active_requests=str(LIMIT), queue_wait_s="300",
                          max_tokens_limit="2048", max_seq_len="4096")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def urls(srv, engine_root, tmp_path_factory):
    from ssd_tools.openai_launcher import OpenAIFrontend
    from ssd_tools.triton_launcher import free_port

    fe = OpenAIFrontend(engine_root / TARGET, srv.grpc_url, port=free_port(),
                        log_file=tmp_path_factory.mktemp("openai") / "frontend.log").start()
    yield {"http": f"http://{srv.http_url}", "grpc": srv.grpc_url, "openai": fe.base_url, "openai_model": TARGET,
           "metrics": f"http://{srv.address}:{srv.metrics_port}/metrics"}
    fe.stop()


def _at_rest(urls) -> dict[str, float]:
    """Waits until nothing decodes, waits or holds a sequence; returns the gauges then (all zero)."""
    last = {}

    def idle():
        last.update(load(urls["metrics"]))
        return not any(last.values())

    wait_for(idle, f"the server to be idle (last seen {last})", DEADLINE, poll=0.1)
    return last


def _post(urls, body: dict, path: str = "generate") -> tuple[int, dict]:
    req = urllib.request.Request(f"{urls['http']}/v2/models/ssd/{path}", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("endpoint, ends_as", [
    ("generate_stream", "cancelled"), ("grpc_stream", "cancelled"), ("openai_stream", "cancelled"),
    ("openai_whole", "cancelled"),
    # Triton's HTTP frontend reads nothing from a non-streamed generate's connection until it
    # replies, so the model hears nothing: the request's deadline ends it
    ("generate", "timeout")])
def test_clients_that_hang_up_mid_generation_free_their_slots_and_kv(srv, urls, endpoint, ends_as):
    assert not any(_at_rest(urls).values())
    row = measure(endpoint, LIMIT, urls, max_tokens=LONG, generate_timeout_s=8.0, timeout=DEADLINE)
    assert row.outcome == {ends_as: LIMIT}, row
    assert not any(_at_rest(urls).values())  # slots, queue and every engine's sequences


def test_clients_that_hang_up_while_queued_leave_the_queue(srv, urls):
    """gRPC and the OpenAI API (over gRPC) report a hang-up at once: a queued request leaves the
    queue without ever decoding, while the requests holding the slots go on."""
    assert not any(_at_rest(urls).values())
    before = outcomes(urls["metrics"])
    holders = [HttpClient(urls["http"], "/v2/models/ssd/generate_stream",
                          {"text_input": PROMPT, "max_tokens": LONG, "stream": True}) for _ in range(LIMIT)]
    try:
        wait_for(lambda: load(urls["metrics"])["active"] >= LIMIT, "the slots taken", DEADLINE)
        chat = {"model": TARGET, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
        queued = [GrpcClient(urls["grpc"], {"text_input": "Hi", "max_tokens": 8, "stream": True}),
                  HttpClient(urls["openai"], "/chat/completions", chat),
                  HttpClient(urls["openai"], "/chat/completions", {**chat, "stream": True})]
        wait_for(lambda: load(urls["metrics"])["queued"] >= len(queued), "three requests queued", DEADLINE)
        for c in queued:
            c.hang_up()
        wait_for(lambda: load(urls["metrics"])["queued"] == 0, "the queue to empty", DEADLINE)
        now = load(urls["metrics"])
        assert now["active"] == LIMIT, now  # the holders still decode: the queued ones left without a slot
        after = outcomes(urls["metrics"])
        assert after.get("cancelled", 0) - before.get("cancelled", 0) == len(queued), (before, after)
    finally:
        for h in holders:
            h.hang_up()
    assert not any(_at_rest(urls).values())


def test_requests_over_the_limit_wait_for_a_slot_instead_of_failing(srv, urls):
    assert not any(_at_rest(urls).values())
    results, queued_seen, stop = [], [], threading.Event()

    def one(i):
        results.append(_post(urls, {"text_input": f"Count to {i + 3}.", "max_tokens": 24, "mode": "ar"}))

    def watch():
        while not stop.is_set():
            queued_seen.append(load(urls["metrics"])["queued"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(3 * LIMIT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert [s for s, _ in results] == [200] * (3 * LIMIT), results
    assert max(queued_seen) >= 1  # some of them waited in the queue
    assert not any(_at_rest(urls).values())


def test_a_closed_loop_at_the_limit_right_after_hang_ups_has_no_failures(srv, urls):
    """Users of the previous run vanish mid-request (every kind of client); the next run starts at
    once with exactly max_active_requests users, each sending requests back to back."""
    assert not any(_at_rest(urls).values())
    body = {"text_input": PROMPT, "max_tokens": LONG}
    chat = {"model": TARGET, "max_tokens": LONG, "messages": [{"role": "user", "content": PROMPT}]}
    dropped = [HttpClient(urls["http"], "/v2/models/ssd/generate_stream", {**body, "stream": True}),
               HttpClient(urls["http"], "/v2/models/ssd/generate", {**body, "timeout_s": 3.0}),
               GrpcClient(urls["grpc"], {**body, "stream": True}),
               HttpClient(urls["openai"], "/chat/completions", chat),
               HttpClient(urls["openai"], "/chat/completions", {**chat, "stream": True})]
    wait_for(lambda: load(urls["metrics"])["active"] >= LIMIT, "the previous run's requests decoding", DEADLINE)
    for c in dropped:
        c.hang_up()

    failures, done = [], []
    client = openai.OpenAI(base_url=urls["openai"], api_key="unused", max_retries=0, timeout=DEADLINE)

    def user(u):
        for i in range(3):
            try:
                if (u + i) % 2:
                    status, out = _post(urls, {"text_input": f"Say {i}.", "max_tokens": 8})
                    if status != 200:
                        failures.append(out)
                        continue
                else:
                    client.chat.completions.create(model=TARGET, max_tokens=8,
                                                   messages=[{"role": "user", "content": f"Say {i}."}])
                done.append(u)
            except Exception as e:  # noqa: BLE001 - every failure is counted and shown
                failures.append(repr(e))

    users = [threading.Thread(target=user, args=(u,)) for u in range(LIMIT)]
    for t in users:
        t.start()
    for t in users:
        t.join()
    assert failures == [] and len(done) == 3 * LIMIT, failures
    assert not any(_at_rest(urls).values())


def test_a_request_past_its_deadline_returns_what_it_made_with_finish_reason_timeout(srv, urls):
    status, out = _post(urls, {"text_input": PROMPT, "max_tokens": LONG, "timeout_s": 2.0})
    assert status == 200, out
    ids = out["output_ids"] if isinstance(out["output_ids"], list) else [out["output_ids"]]  # Triton writes one id bare
    assert out["finish_reason"] == "timeout" and 0 < len(ids) < LONG, out
    status, out = _post(urls, {"text_input": PROMPT, "timeout_s": -1.0})
    assert status == 400 and out["error"].startswith("input 'timeout_s'"), out
    assert not any(_at_rest(urls).values())
    assert set(ENGINES) <= set(load(urls["metrics"]))
