"""The client examples in examples/ run as users run them, against a real server, and print the
served greedy answer: the generate endpoint's text for the same prompt, through every protocol."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import pytest

from conftest import PROMPTS, REPO

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def expected(server) -> str:
    body = {"text_input": PROMPTS[2], "max_tokens": MAX_TOKENS, "mode": "ssd"}
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/ssd/generate", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())["text_output"]


def _run(script: str, *args: str) -> list[str]:
    out = subprocess.run([sys.executable, str(REPO / "examples" / script), PROMPTS[2], "--max-tokens",
                          str(MAX_TOKENS), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.parametrize("script,args", [
    ("http_client.py", []),
    ("http_client.py", ["--stream"]),
    ("grpc_stream_client.py", []),
    ("openai_client.py", []),
])
def test_example_prints_the_served_answer(server, frontend, expected, script, args):
    url = {"http_client.py": f"http://{server.http_url}", "grpc_stream_client.py": server.grpc_url,
           "openai_client.py": frontend.base_url}[script]
    lines = _run(script, "--url", url, *args)
    has_stats = script != "grpc_stream_client.py"
    text = "\n".join(lines[:-1] if has_stats else lines)
    assert text == expected
    if has_stats:
        assert re.fullmatch(r"\[\d+ tokens, [\d.]+ per round, p_hit [\d.]+\]", lines[-1]), lines[-1]
