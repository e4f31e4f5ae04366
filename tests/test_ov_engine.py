"""The OpenVINO engine (real OpenVINO, real SmolLM2-135M weights; bf16 compute where the CPU has it, else f32).

A row's logits are bit-identical whatever shares its forward (row counts, other sequences, tree rows
over a shared prefix) and at 1 or 2 threads; greedy SD and SSD through the engine produce its own
greedy AR tokens; the served factory picks it from the engine folder's runtime.
"""
from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from conftest import PROMPTS, TARGET, WEAK

N_TOKENS = 24


@pytest.fixture(scope="module")
def ov_engines(engine_root):
    from ssd.engine.ov_engine import OpenVinoEngine

    return {
        "target": OpenVinoEngine(engine_root / TARGET, threads=2),  # bf16 where the CPU computes bf16
        "f32": OpenVinoEngine(engine_root / TARGET, weights="f32", threads=2),
        "target_1t": OpenVinoEngine(engine_root / TARGET, threads=1),
        "weak": OpenVinoEngine(engine_root / WEAK, threads=1),
        "int8": OpenVinoEngine(engine_root / TARGET, weights="int8", threads=1, exact=False),
    }


@pytest.fixture(scope="module")
def prompt_ids(codec):
    return codec.encode_prompt(PROMPTS[0])


def _one_at_a_time(engine, seq, tokens, start):
    from ssd.engine.engine import ExtendCall

    engine.release(seq)
    engine.extend([ExtendCall(seq, tokens[:start], 1)])
    return torch.cat([engine.extend([ExtendCall(seq, tokens[: i + 1], 1)])[0] for i in range(start, len(tokens))])


def test_logits_match_the_torch_engine(engines, ov_engines, prompt_ids):
    """The graph computes the torch engine's function: in f32 the two agree to 2e-3."""
    from ssd.engine.engine import ExtendCall

    ours = ov_engines["f32"].extend([ExtendCall("m", prompt_ids, 8)])[0]
    ref = engines["target"].extend([ExtendCall("m", prompt_ids, 8)])[0]
    assert ours.shape == ref.shape
    assert torch.allclose(ours, ref, atol=2e-3, rtol=0), (ours - ref).abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_row_logits_do_not_depend_on_row_count_batch_or_threads(ov_engines, prompt_ids):
    from ssd.engine.engine import ExtendCall

    eng = ov_engines["target"]
    start = len(prompt_ids) - 12
    ref = _one_at_a_time(eng, "ref", prompt_ids, start)
    for chunk in (2, 3, 4, 6, 12):  # verify-sized forwards
        eng.release("c")
        eng.extend([ExtendCall("c", prompt_ids[:start], 1)])
        rows = [eng.extend([ExtendCall("c", prompt_ids[: i + chunk], chunk)])[0] for i in range(start, len(prompt_ids), chunk)]
        assert torch.equal(torch.cat(rows), ref), f"{chunk}-row forwards changed a row's logits"
    # the same rows batched with other sequences of other lengths
    eng.release("b")
    eng.extend([ExtendCall("b", prompt_ids[:start], 1)])
    out = eng.extend([ExtendCall("o1", prompt_ids[3:20], 2), ExtendCall("b", prompt_ids, 12),
                      ExtendCall("o2", prompt_ids[:7], 1)])
    assert torch.equal(out[1], ref)
    assert torch.equal(_one_at_a_time(ov_engines["target_1t"], "ref1", prompt_ids, start), ref)


def test_tree_rows_equal_linear_rows(ov_engines, prompt_ids):
    """A branch of tree rows over a shared prefix gives the rows the same logits as extending the
    sequence linearly, and committing the branch leaves a cache that continues exactly."""
    from ssd.engine.engine import ExtendCall, TreeCall

    eng = ov_engines["target"]
    prefix, branch = prompt_ids[:-4], prompt_ids[-4:]
    ref = _one_at_a_time(eng, "lin", prompt_ids, len(prefix))
    eng.release("t")
    eng.extend([ExtendCall("t", prefix, 1)])
    p = len(prefix)
    first, slots = eng.tree([TreeCall("t", [branch[0] ^ 1, branch[0]], [p, p], [p, p], [-1, -1])])[0]
    s = slots[1]  # the decoy row in slots[0] is a sibling: invisible to the branch
    rest, rest_slots = eng.tree([TreeCall("t", branch[1:3], [p + 1, p + 2], [p, p], [s, s + 1])])[0]
    assert rest_slots == [s + 1, s + 2]
    assert torch.equal(torch.cat([first[1:], rest]), ref[:3])
    eng.commit_branch("t", p, [s, s + 1, s + 2], branch[:3])
    assert torch.equal(eng.extend([ExtendCall("t", prompt_ids, 1)])[0], ref[3:])


def _client(target, drafter):
    from ssd.decoding.local_client import LocalClient
    from ssd.workers.drafter import DrafterWorker
    from ssd.workers.fast_backup import NgramWorker
    from ssd.workers.target import TargetWorker

    return LocalClient(TargetWorker(target), DrafterWorker(drafter), NgramWorker())


def _greedy(client, prompt, cfg):
    from ssd.algorithm.sampling import SamplingParams
    from ssd.decoding.generator import Generation

    g = Generation(client, "s", list(prompt), SamplingParams(), 0, cfg, None)
    return asyncio.run(g.take(N_TOKENS))


@pytest.mark.parametrize("drafter,cfg", [
    ("weak", dict(mode="sd", k=4)), ("int8", dict(mode="sd", k=3)),
    ("weak", dict(mode="ssd", k=3, fanout_budget=6, step_aside=False)),
    ("int8", dict(mode="ssd", k=4)),
], ids=["sd-weak", "sd-int8", "ssd-weak", "ssd-int8-policy"])
def test_greedy_sd_and_ssd_equal_ar(ov_engines, codec, drafter, cfg):
    from ssd.decoding.generator import DecodeConfig

    ar_client = _client(ov_engines["target"], ov_engines["weak"])
    client = _client(ov_engines["target"], ov_engines[drafter])
    for prompt in PROMPTS[:3]:
        ids = codec.encode_prompt(prompt)
        ref = _greedy(ar_client, ids, DecodeConfig(mode="ar"))
        assert _greedy(client, ids, DecodeConfig(**cfg)) == ref, f"{cfg} diverged on {prompt!r}"


def test_factory_reads_the_runtime_from_the_engine_folder(engine_root, tmp_path):
    from ssd.engine.ov_engine import OpenVinoEngine
    from ssd.config import EngineConfig
    from ssd.workers.factory import build_worker

    folder = tmp_path / "weak"
    shutil.copytree(engine_root / WEAK, folder)
    meta = json.loads((folder / "engine.json").read_text())
    (folder / "engine.json").write_text(json.dumps(meta | {"runtime": "openvino", "ov_weights": "int8"}))
    worker = build_worker(EngineConfig.from_parameters({"role": "drafter", "threads": "1"}), str(folder))
    assert isinstance(worker.engine, OpenVinoEngine)
    assert worker.engine.model.weight_format == "int8"
    with pytest.raises(ValueError, match="weights"):
        OpenVinoEngine(folder, weights="int4")


def test_build_records_the_runtime_in_engine_json(tmp_path):
    from ssd_tools.build_engines import record_runtime

    (tmp_path / "engine.json").write_text(json.dumps({"dtype": "bfloat16", "source_sha256": "x"}))
    record_runtime(tmp_path, {"runtime": "openvino", "ov_weights": "int8"})
    meta = json.loads((tmp_path / "engine.json").read_text())
    assert meta == {"dtype": "bfloat16", "source_sha256": "x", "runtime": "openvino", "ov_weights": "int8"}
    record_runtime(tmp_path, {})  # back to torch: the keys go
    assert json.loads((tmp_path / "engine.json").read_text()) == {"dtype": "bfloat16", "source_sha256": "x"}
    with pytest.raises(ValueError, match="runtime"):
        record_runtime(tmp_path, {"runtime": "onnx"})
