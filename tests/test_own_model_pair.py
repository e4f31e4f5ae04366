"""A user's own model pair: local Hugging Face checkpoint folders built by `build_engines.sh` from an
engines/*.yaml profile and served by tools/serve.py (what `make serve ENGINES=...` runs); refused
with a clear message when the architecture is not one the CPU engine runs or when the drafter's
tokenizer differs from the target's.

The checkpoints are tiny random Llama models (tests/tiny_models.py) carrying SmolLM2's tokenizer
files, built here in milliseconds; the mismatched one carries a tokenizer made here.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TARGET
from tiny_models import load_weights, make_tiny_engine

VOCAB = 49152  # SmolLM2's tokenizer


def _hf_checkpoint(folder: Path, tokenizer_from: Path, seed: int, base: Path | None = None) -> Path:
    make_tiny_engine(folder, seed, vocab=VOCAB, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128,
                     logit_scale=1.0, base=load_weights(base) if base else None, noise=0.3)
    (folder / "engine.json").unlink()  # a plain Hugging Face folder: config, weights, tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer_from / name).exists():
            shutil.copy2(tokenizer_from / name, folder / name)
    return folder


def _foreign_tokenizer(folder: Path) -> None:
    """Same vocabulary size, other ids: a word-level tokenizer whose id i is 'w<i>'."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def _profile(path: Path, target: Path, drafter: Path) -> Path:
    cfg = {"sources": {"my-target": {"path": str(target)}, "my-drafter": {"path": str(drafter)}},
           "engines": {"my-target": {"source": "my-target", "role": "target", "dtype": "float32"},
                       "my-drafter": {"source": "my-drafter", "role": "drafter", "dtype": "bfloat16"}}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def _build(profile: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "build_engines.sh"), "--config", str(profile), "--out", str(out),
                           "--backend", "torch"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHON=sys.executable))


@pytest.fixture(scope="module")
def checkpoints(engine_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    tok = engine_root / TARGET
    target = _hf_checkpoint(root / "target", tok, seed=1)
    drafter = _hf_checkpoint(root / "drafter", tok, seed=2, base=target)
    foreign = _hf_checkpoint(root / "foreign", tok, seed=3, base=target)
    _foreign_tokenizer(foreign)
    return {"root": root, "target": target, "drafter": drafter, "foreign": foreign}


def test_local_pair_builds_and_serves(checkpoints, tmp_path):
    from ssd_tools.triton_launcher import free_port

    profile = _profile(tmp_path / "my.yaml", checkpoints["target"], checkpoints["drafter"])
    out = tmp_path / "engines"
    r = _build(profile, out)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("my-target", "my-drafter"):
        meta = json.loads((out / name / "engine.json").read_text())
        assert (out / name / "model.safetensors").exists() and (out / name / "tokenizer.json").exists()
        assert meta["source_sha256"].startswith("local:")
    again = _build(profile, out)  # idempotent: nothing converted the second time
    assert again.returncode == 0 and again.stdout.count("is up to date") == 2, again.stdout

    http, grpc, metrics, oai = (free_port() for _ in range(4))
    serve = subprocess.Popen([sys.executable, str(REPO / "tools" / "serve.py"), "--config", str(profile),
                              "--engine-root", str(out), "--http-port", str(http), "--grpc-port", str(grpc),
                              "--metrics-port", str(metrics), "--openai-port", str(oai),
                              "--work-dir", str(tmp_path / "serve")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        deadline = time.time() + 300
        while time.time() < deadline:
            line = serve.stdout.readline()
            assert line, "serve.py exited:\n" + "".join(lines)
            lines.append(line)
            if line.startswith("[serve] OpenAI"):
                break
        assert "target=my-target drafter=my-drafter" in "".join(lines)

        def generate(mode):
            body = {"text_input": "Tell me a story.", "max_tokens": 12, "mode": mode}
            req = urllib.request.Request(f"http://127.0.0.1:{http}/v2/models/ssd/generate", data=json.dumps(body).encode())
            with urllib.request.urlopen(req, timeout=300) as resp:
                return json.loads(resp.read())

        ar, ssd = generate("ar"), generate("ssd")
        assert ar["output_ids"] and ssd["output_ids"] == ar["output_ids"]  # greedy: the drafter cannot change it
        assert json.loads(ssd["stats"])["mode"] == "ssd"
        body = {"model": "my-target", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12}
        req = urllib.request.Request(f"http://127.0.0.1:{oai}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            chat = json.loads(resp.read())
        assert chat["choices"][0]["message"]["content"] == ar["text_output"]

        # tritonserver dying on its own (a crash) ends serve.py with a non-zero code a supervisor acts on
        pid = int(subprocess.run(["pgrep", "-f", f"tritonserver.*--http-port={http} "], capture_output=True,
                                 text=True).stdout.split()[0])
        os.kill(pid, signal.SIGKILL)
        rest, _ = serve.communicate(timeout=120)
        assert serve.returncode != 0 and "tritonserver exited with code -9" in rest, rest
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(timeout=60)
        except subprocess.TimeoutExpired:
            serve.kill()


def test_drafter_with_another_tokenizer_is_refused(checkpoints, tmp_path):
    r = _build(_profile(tmp_path / "bad.yaml", checkpoints["target"], checkpoints["foreign"]), tmp_path / "engines")
    assert r.returncode != 0
    assert "different tokenizer" in r.stderr and "my-drafter" in r.stderr and "my-target" in r.stderr, r.stderr
    assert not (tmp_path / "engines").exists(), "two Hugging Face folders are compared before anything is converted"


def test_unsupported_architecture_is_refused_before_converting(checkpoints, tmp_path):
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(checkpoints["target"], gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (gpt2 / "config.json").write_text(json.dumps(cfg))
    r = _build(_profile(tmp_path / "bad.yaml", gpt2, checkpoints["drafter"]), tmp_path / "engines")
    assert r.returncode != 0
    assert "unsupported architecture" in r.stderr and "LlamaForCausalLM" in r.stderr and "Qwen2ForCausalLM" in r.stderr
    assert not (tmp_path / "engines" / "my-drafter").exists(), "nothing is converted before every source is checked"


def test_unsupported_gguf_architecture_is_refused(checkpoints, tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    path = tmp_path / "phi.gguf"
    w = GGUFWriter(str(path), "phi2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = _build(_profile(tmp_path / "bad.yaml", checkpoints["target"], path), tmp_path / "engines")
    assert r.returncode != 0 and "unsupported GGUF architecture 'phi2'" in r.stderr, r.stderr
