"""What each endpoint tells a client about a server-side refusal, on a real tritonserver.

The `ssd` model codes a busy refusal and an engine failure UNAVAILABLE (its messages start with
`server busy:` / `engine unavailable:`). The OpenAI frontend turns them into 503s. Triton's HTTP
generate endpoints answer every model error with 400 in tritonserver 2.51 and its gRPC stream
carries the message without a status, so their clients read the prefix (docs/reliability.md).
A busy refusal is provoked with max_active_requests=1, no queue (queue_wait_s=0) and one request
decoding; it says how long to wait (`retry in N s`, and `Retry-After` on the OpenAI API). An engine failure
by SIGKILL of the target's stub, with kv_wait_s=0 so a request does not wait for the reload.
"""
from __future__ import annotations

import http.client
import json
import os
import queue
import re
import signal
import urllib.request

import numpy as np
import openai
import pytest

from conftest import TARGET, start_tiny_server
from test_reliability import DEADLINE, _post, _recovery, _restarts, _wait, stub_pid

# tritonserver releases whose generate endpoints answer a model's error with 400 whatever its code
GENERATE_SAYS_400 = {"2.51.0"}
CHAT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def srv(engine_root, tmp_path_factory):
    s = start_tiny_server(engine_root, tmp_path_factory, max_active_requests="1", queue_wait_s="0", kv_wait_s="0")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv, engine_root, tmp_path_factory):
    from ssd_tools.openai_launcher import OpenAIFrontend
    from ssd_tools.triton_launcher import free_port

    fe = OpenAIFrontend(engine_root / TARGET, srv.grpc_url, port=free_port(),
                        log_file=tmp_path_factory.mktemp("openai") / "frontend.log").start()
    yield openai.OpenAI(base_url=fe.base_url, api_key="unused", max_retries=0, timeout=DEADLINE)
    fe.stop()


def _generate_status(srv, honest: int) -> int:
    """The status Triton's generate endpoints give a model error that stands for ``honest``."""
    with urllib.request.urlopen(f"http://{srv.http_url}/v2", timeout=10) as r:
        version = json.loads(r.read())["version"]
    return 400 if version in GENERATE_SAYS_400 else honest


def _grpc_stream_error(srv) -> tuple[str, object]:
    """(message, status) of the error a gRPC stream client gets for a short request."""
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(srv.grpc_url)
    inp = grpcclient.InferInput("text_input", [1], "BYTES")
    inp.set_data_from_numpy(np.array([b"Say hi."], dtype=np.object_))
    got: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: got.put(error))
    try:
        c.async_stream_infer("ssd", [inp])
        err = got.get(timeout=DEADLINE)
    finally:
        c.stop_stream(cancel_requests=True)  # the error ended the request: no wait for the server to close the stream
        c.close()
    assert err is not None, "the request was served"
    return err.message(), err.status()


def _served(srv) -> bool:
    return _post(srv, {"text_input": "Say hi.", "max_tokens": 2, "mode": "ar"})[0] == 200


def test_a_busy_refusal_is_503_where_the_endpoint_can_say_so(srv, client):
    from ssd.serving.errors import BUSY, http_status

    conn = http.client.HTTPConnection(srv.address, srv.http_port, timeout=DEADLINE)
    conn.request("POST", "/v2/models/ssd/generate_stream",
                 body=json.dumps({"text_input": "Write a long story about a dragon.", "max_tokens": 400,
                                  "mode": "ar", "stream": True}))
    resp = conn.getresponse()
    assert resp.status == 200
    first = next(ln for ln in resp if ln.startswith(b"data:"))  # the holder is decoding now
    assert b"error" not in first, first
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model=TARGET, messages=CHAT, max_tokens=4)
        assert e.value.status_code == 503 and e.value.code == "server_busy", e.value
        assert "max_active_requests=1" in e.value.message
        retry = re.search(r"retry in (\d+) s", e.value.message)
        assert retry and int(retry.group(1)) >= 1, e.value.message
        assert e.value.response.headers["Retry-After"] == retry.group(1)

        for path in ("generate", "generate_stream"):
            status, body = _post(srv, {"text_input": "Say hi.", "max_tokens": 4}, path=path)
            err = json.loads(body.removeprefix("data:").strip())["error"]
            assert err.startswith(BUSY) and http_status(err) == 503, err
            assert re.search(r"retry in \d+ s$", err), err
            assert status == _generate_status(srv, 503), (path, status, body)

        message, status = _grpc_stream_error(srv)
        assert message.startswith(BUSY) and status is None, (message, status)
    finally:
        conn.close()  # hanging up cancels the holder within a round
    _wait(lambda: _served(srv), "the holder to end after its client hung up")


def _with_the_target_killed(srv, send):
    """Kills the target's stub and calls ``send()``, whose result is None when the request was
    served (the reload beat it; then again, after the reload)."""
    for _ in range(3):
        before = _restarts(srv, "target")
        os.kill(stub_pid(srv, "target"), signal.SIGKILL)
        refusal = send()
        _recovery(srv, "target", before)
        if refusal is not None:
            return refusal
    raise AssertionError("the target was reloaded before the request reached it, three times")


def test_an_engine_failure_is_503_where_the_endpoint_can_say_so(srv, client):
    from ssd.serving.errors import UNAVAILABLE, http_status

    def openai_request():
        try:
            client.chat.completions.create(model=TARGET, messages=CHAT, max_tokens=4, extra_body={"mode": "ar"})
        except openai.APIStatusError as e:
            return e
        return None

    e = _with_the_target_killed(srv, openai_request)
    assert e.status_code == 503 and e.code == "engine_unavailable", e
    assert "target" in e.message and "retry" in e.message

    def generate_request():
        status, body = _post(srv, {"text_input": "Say hi.", "max_tokens": 4, "mode": "ar"})
        return None if status == 200 else (status, body)

    status, body = _with_the_target_killed(srv, generate_request)
    err = json.loads(body)["error"]
    assert err.startswith(UNAVAILABLE) and http_status(err) == 503, err
    assert status == _generate_status(srv, 503), (status, body)
    assert _served(srv)
