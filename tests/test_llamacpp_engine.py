"""The llama.cpp target engine (real llama.cpp from the pinned llama-cpp-python, built without
llamafile, with the repacked Q4_K GEMV patched to sum like the GEMM and the Q6_K dot product like
the tiled kernels; SmolLM2-135M requantized to Q4_K_M, the default target's format).

A row's logits are bit-identical whatever shares its call (1 to 24 rows: below and above the row
count where llama.cpp's tiled K-quant kernels take over, other sequences, prefills) and at 1 or 2
threads; rollback and eviction recompute the same bits; greedy SD and SSD with torch drafters
give the engine's own greedy AR tokens, in process and served by tritonserver.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import PROMPTS, TARGET, llama_quantize, start_tiny_server

N_TOKENS = 24


@pytest.fixture(scope="module")
def llama(llama_target):
    from ssd.engine.llamacpp_engine import LlamaCppEngine

    return LlamaCppEngine(llama_target, threads=1, max_sequences=4, max_len=512)


@pytest.fixture(scope="module")
def prompt_ids(codec):
    return codec.encode_prompt(PROMPTS[5])


def _one_at_a_time(engine, seq, tokens, start):
    from ssd.engine.engine import ExtendCall

    engine.release(seq, keep_prefix=False)
    engine.extend([ExtendCall(seq, tokens[:start], 1)])
    return torch.cat([engine.extend([ExtendCall(seq, tokens[: i + 1], 1)])[0] for i in range(start, len(tokens))])


def test_logits_follow_the_torch_engine(llama, engines, prompt_ids):
    """The same model (4-bit weights against the torch engine's dequantized Q4_1): close, same shape."""
    from ssd.engine.engine import ExtendCall

    ours = llama.extend([ExtendCall("m", prompt_ids, 4)])[0]
    ref = engines["target"].extend([ExtendCall("m", prompt_ids, 4)])[0]
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert torch.corrcoef(torch.stack([ours.flatten(), ref.flatten()]))[0, 1] > 0.98


def test_row_logits_do_not_depend_on_row_count_batch_or_threads(llama, prompt_ids):
    from ssd.engine.engine import ExtendCall

    start = len(prompt_ids) - 24
    ref = _one_at_a_time(llama, "ref", prompt_ids, start)
    for chunk in (2, 3, 4, 6, 8, 12):  # verify-sized forwards; from 8 rows llama.cpp would tile
        llama.release("c", keep_prefix=False)
        llama.extend([ExtendCall("c", prompt_ids[:start], 1)])
        rows = [llama.extend([ExtendCall("c", prompt_ids[: i + chunk], chunk)])[0]
                for i in range(start, len(prompt_ids), chunk)]
        assert torch.equal(torch.cat(rows), ref), f"{chunk}-row forwards changed a row's logits"
    # the same rows batched with other sequences of other lengths, one of them a prefill
    llama.release("b", keep_prefix=False)
    llama.extend([ExtendCall("b", prompt_ids[:start], 1)])
    out = llama.extend([ExtendCall("o1", prompt_ids[3:20], 2), ExtendCall("b", prompt_ids, 24),
                        ExtendCall("o2", prompt_ids[:7], 1)])
    assert [o.shape[0] for o in out] == [2, 24, 1]
    assert torch.equal(out[1], ref)
    # a short prompt's context rows (6: the vec_dot kernel) beside a long prompt's (the tiled one)
    llama.release("o2", keep_prefix=False)
    assert torch.equal(llama.extend([ExtendCall("o2", prompt_ids[:7], 1)])[0], out[2])
    assert llama.allows_threads(2)  # its own check: the same bits at 2 threads
    llama.set_threads(2)
    try:
        assert torch.equal(_one_at_a_time(llama, "ref2", prompt_ids, start), ref)
    finally:
        llama.set_threads(1)


def test_prompts_are_timed_apart_from_logit_rows(llama, prompt_ids):
    """A call's prompt (its context rows and the logit rows that end it, computed in the same
    forwards) is reported as 0 rows, which the cost curves skip and the target worker hands to
    every call of the message as prompt_seconds."""
    from ssd.engine.engine import ExtendCall
    from ssd.workers.protocol import VerifyCall
    from ssd.workers.target import TargetWorker

    llama.take_timing()
    llama.extend([ExtendCall("p", prompt_ids, 2)])
    timing = llama.take_timing()
    assert [rows for rows, _ in timing] == [0] and timing[0][1] > 0  # no one-row forward after the prompt's
    out = TargetWorker(llama).verify([VerifyCall("p", prompt_ids + [5], [6]), VerifyCall("q", [7] + prompt_ids, [])])
    assert out[0].prompt_seconds > 0 and out[0].prompt_seconds == out[1].prompt_seconds  # "q" prefilled
    assert 0 not in [rows for rows, _ in out[0].timing[1:]] and out[0].timing[0][0] == 0
    out = TargetWorker(llama).verify([VerifyCall("p", prompt_ids + [5, 7], [])])
    assert out[0].prompt_seconds == 0  # decode rows only
    llama.release("p", keep_prefix=False)
    llama.release("q", keep_prefix=False)


def test_forwards_pack_consecutive_streams_with_equal_rows():
    """llama.cpp runs a batch over several KV streams as one graph only for consecutive, ascending
    streams with the same number of rows each; the packing builds exactly such forwards."""
    from ssd.engine.llamacpp_engine import Slot, pack_forwards

    def seq(index, n):
        slot = Slot(index)
        return [(index, slot, p, 100 + p, True) for p in range(n)]

    per_sequence = [seq(5, 1), seq(2, 1), seq(3, 1), seq(4, 3), seq(9, 1), seq(10, 2)]
    forwards = pack_forwards(per_sequence, 3)
    assert [[(r[1].index, r[2]) for r in f] for f in forwards] == [
        [(2, 0), (3, 0), (4, 0)], [(4, 1), (5, 0)], [(4, 2)], [(9, 0), (10, 0)], [(10, 1)]]
    for limit in (1, 3, 7):
        forwards = pack_forwards(per_sequence, limit)
        assert sorted(r[1].index * 10 + r[2] for f in forwards for r in f) == sorted(
            r[1].index * 10 + r[2] for q in per_sequence for r in q)
        for f in forwards:
            streams = sorted({r[1].index for r in f})
            assert len(f) <= limit and streams == list(range(streams[0], streams[-1] + 1))
            assert len({sum(r[1].index == s for r in f) for s in streams}) == 1
        for q in per_sequence:  # a sequence's rows in order
            order = [r[2] for f in forwards for r in f if r[1] is q[0][1]]
            assert order == sorted(order)


def test_sequences_decoded_together_keep_their_bits(llama, prompt_ids):
    """One-row steps of several sequences in one forward (their streams consecutive, as the engine
    allocates them) give each sequence the logits it gets alone."""
    from ssd.engine.engine import ExtendCall

    starts = [len(prompt_ids) - 12, len(prompt_ids) - 10, len(prompt_ids) - 8]
    refs = [_one_at_a_time(llama, f"alone{k}", prompt_ids[k:], s - k) for k, s in enumerate(starts)]
    for seq in list(llama.sequences):  # the references' and what earlier tests left
        llama.release(seq, keep_prefix=False)
    for k, s in enumerate(starts):
        llama.extend([ExtendCall(f"t{k}", prompt_ids[k:s], 1)])
    assert [llama.sequences[f"t{k}"].index for k in range(3)] == [0, 1, 2]  # the lowest free streams
    got = [[] for _ in starts]
    for step in range(5):  # all three one row each, then mixed row counts
        rows = [1, 1, 1] if step < 3 else [2, 1, 2]
        outs = llama.extend([ExtendCall(f"t{k}", prompt_ids[k:s + sum(o.shape[0] for o in got[k]) + r], r)
                             for (k, s), r in zip(enumerate(starts), rows)])
        for k, o in enumerate(outs):
            got[k].append(o)
    for k in range(3):
        assert torch.equal(torch.cat(got[k]), refs[k][: sum(o.shape[0] for o in got[k])])
        llama.release(f"t{k}", keep_prefix=False)


def test_the_load_check_sees_the_kernel_switch(llama, llama_target, tmp_path):
    """A Q4_K_M file runs with llama.cpp's tiled kernels on (its multi-row Q6_K products; the
    patched dot product sums as they do) and every row count of the load check keeps its bits. The
    negative control: a Q5_K_M file, whose Q5_K products the patches leave as llama.cpp ships them,
    runs with the tiled kernels off by default and loads with the same row counts; forced on, the
    load check finds a prefilled history's logits changed and the engine refuses to load, naming
    the switch."""
    from ssd.engine.llamacpp_checks import LOGIT_ROW_CHOICES
    from ssd.engine.meta import gguf_tensor_types

    assert os.environ["GGML_CPU_TILED_MM"] == "1" and "Q6_K" in gguf_tensor_types(llama_target)
    assert llama.logit_rows == LOGIT_ROW_CHOICES[0]
    q5 = tmp_path / "q5"
    shutil.copytree(llama_target, q5, ignore=shutil.ignore_patterns("*.gguf", "*.safetensors"))
    llama_quantize(llama_target / "model.gguf", q5 / "model.gguf", "Q5_K_M")
    assert "Q5_K" in gguf_tensor_types(q5)
    probe = (
        "import os, sys; from ssd.engine.llamacpp_engine import LlamaCppEngine\n"
        "try:\n"
        "    e = LlamaCppEngine(sys.argv[1], threads=1, max_sequences=2, max_len=256)\n"
        "    print(os.environ['GGML_CPU_TILED_MM'], e.logit_rows)\n"
        "except RuntimeError as err:\n"
        "    print('refused:', err)\n")

    def load(**env):
        env = {k: v for k, v in os.environ.items() if k != "GGML_CPU_TILED_MM"} | env
        return subprocess.run([sys.executable, "-c", probe, str(q5)], env=env, check=True, capture_output=True,
                              text=True, timeout=600).stdout.strip().splitlines()[-1]

    assert load() == f"0 {LOGIT_ROW_CHOICES[0]}"
    refused = load(GGML_CPU_TILED_MM="1")
    assert refused.startswith("refused:") and "GGML_CPU_TILED_MM=0" in refused


def test_prompts_prefilled_together_keep_their_bits(llama, prompt_ids):
    """Prompts arriving in one call share forwards (several sequences' context rows in one graph);
    each gets the logits it gets alone, and a history recomputed in one prefill (eviction) gets the
    logits of the one-row steps that first built it."""
    from ssd.engine.engine import ExtendCall

    lengths = (len(prompt_ids), len(prompt_ids) - 9, 40)
    alone = []
    for n in lengths:
        llama.release("solo", keep_prefix=False)
        alone.append(llama.extend([ExtendCall("solo", prompt_ids[:n], 3)])[0])
    llama.release("solo", keep_prefix=False)
    together = llama.extend([ExtendCall(f"p{j}", prompt_ids[:n], 3) for j, n in enumerate(lengths)])
    for j, (a, t) in enumerate(zip(alone, together)):
        assert torch.equal(a, t), f"prompt {j} changed its logits when prefilled with others"
        llama.release(f"p{j}", keep_prefix=False)
    start = len(prompt_ids) - 30
    steps = _one_at_a_time(llama, "steps", prompt_ids, start)
    llama.release("steps", keep_prefix=False)
    llama.release("once", keep_prefix=False)
    assert torch.equal(llama.extend([ExtendCall("once", prompt_ids, 4)])[0], steps[-4:])
    llama.release("once", keep_prefix=False)


def test_rollback_and_eviction_recompute_the_same_bits(llama, prompt_ids):
    from ssd.engine.engine import ExtendCall

    full = llama.extend([ExtendCall("r", prompt_ids, 6)])[0]
    wrong = prompt_ids[:-3] + [t ^ 1 for t in prompt_ids[-3:]]
    llama.extend([ExtendCall("r", wrong, 3)])  # a rejected draft in the cache
    assert llama.cached_tokens("r") == wrong
    assert torch.equal(llama.extend([ExtendCall("r", prompt_ids, 6)])[0], full)
    llama.truncate("r", len(prompt_ids) - 5)
    assert llama.cached_tokens("r") == prompt_ids[:-5]
    assert torch.equal(llama.extend([ExtendCall("r", prompt_ids, 6)])[0], full)
    for i in range(4):  # four more sequences than the engine's 4 streams: "r" is evicted, its KV overwritten
        llama.extend([ExtendCall(f"e{i}", prompt_ids[::-1][:40 + i], 1)])
    assert llama.cached_tokens("r") == []
    assert torch.equal(llama.extend([ExtendCall("r", prompt_ids, 6)])[0], full)
    out = llama.extend([ExtendCall(f"g{i}", prompt_ids[:20 + i], 1) for i in range(6)])  # 6 > 4: in groups
    assert len(out) == 6
    with pytest.raises(ValueError, match="max_len"):
        llama.extend([ExtendCall("long", list(range(512 + 65)), 1)])


def test_a_repeated_prompt_reuses_its_prefix_and_decodes_the_same(llama, engines, codec):
    from ssd.algorithm.sampling import SamplingParams
    from ssd.decoding.generator import DecodeConfig, Generation

    client = _client(llama, engines["weak"])
    ids = codec.encode_prompt(PROMPTS[4] + " Answer in one line.")
    runs = []
    for cfg in (DecodeConfig(mode="ar"), DecodeConfig(mode="sd", k=3)):
        g = Generation(client, "rep", list(ids), SamplingParams(), 0, cfg, None)
        runs.append((asyncio.run(g.take(N_TOKENS)), g.stats))
    (first, s1), (second, s2) = runs
    assert s1.prompt_tokens == s2.prompt_tokens == len(ids)
    assert s1.cached_prompt_tokens < len(ids) - 1 and s2.cached_prompt_tokens == len(ids) - 1
    assert second == first


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
    ("weak", dict(mode="sd", k=4)), ("int8_full", dict(mode="sd", k=7)),
    ("weak", dict(mode="ssd", k=3, fanout_budget=6, step_aside=False)),
    ("int8_full", dict(mode="ssd", k=4)),
], ids=["sd-weak", "sd-k7", "ssd-weak", "ssd-policy"])
def test_greedy_sd_and_ssd_equal_ar(llama, engines, codec, drafter, cfg):
    from ssd.decoding.generator import DecodeConfig

    client = _client(llama, engines[drafter])
    for prompt in PROMPTS[:3]:
        ids = codec.encode_prompt(prompt)
        ref = _greedy(client, ids, DecodeConfig(mode="ar"))
        assert _greedy(client, ids, DecodeConfig(**cfg)) == ref, f"{cfg} diverged on {prompt!r}"


def test_factory_reads_the_runtime_and_serves_the_target_only(llama_target, tmp_path):
    from ssd.engine.llamacpp_engine import LlamaCppEngine
    from ssd.config import EngineConfig
    from ssd.workers.factory import build_worker

    folder = tmp_path / "t"
    shutil.copytree(llama_target, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    meta = json.loads((folder / "engine.json").read_text())
    (folder / "engine.json").write_text(json.dumps(meta | {"runtime": "llamacpp"}))
    cfg = EngineConfig.from_parameters({"role": "target", "threads": "1", "max_sequences": "2", "max_len": "256"})
    worker = build_worker(cfg, str(folder))
    assert isinstance(worker.engine, LlamaCppEngine) and worker.engine.max_len == 256
    with pytest.raises(ValueError, match="target only"):
        build_worker(EngineConfig.from_parameters({"role": "drafter", "threads": "1"}), str(folder))
    (folder / "model.gguf").unlink()
    with pytest.raises(FileNotFoundError, match="model.gguf"):
        LlamaCppEngine(folder)


def test_build_links_the_gguf_for_a_llamacpp_engine(llama_target, tmp_path):
    from ssd_tools.build_engines import link_gguf, record_runtime

    (tmp_path / "engine.json").write_text(json.dumps({"dtype": "float32"}))
    src = llama_target / "model.gguf"
    link_gguf(tmp_path, {"runtime": "llamacpp"}, src)
    record_runtime(tmp_path, {"runtime": "llamacpp"})
    assert (tmp_path / "model.gguf").read_bytes()[:4] == b"GGUF"
    assert json.loads((tmp_path / "engine.json").read_text())["runtime"] == "llamacpp"
    with pytest.raises(ValueError, match="GGUF source"):
        link_gguf(tmp_path, {"runtime": "llamacpp"}, None)
    with pytest.raises(ValueError, match="keep_layers"):
        link_gguf(tmp_path, {"runtime": "llamacpp", "keep_layers": 6}, src)


@pytest.fixture(scope="module")
def llama_server(llama_target, engine_root, tmp_path_factory):
    srv = start_tiny_server(engine_root, tmp_path_factory,
                            target={"engine_backend": "llamacpp", "max_sequences": "8", "max_len": "1024"})
    yield srv
    srv.stop()


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_served_greedy_equals_ar_on_the_llamacpp_target(llama_server, mode):
    from test_server import _post

    for prompt in PROMPTS[:2]:
        outs = {}
        for m in ("ar", mode):
            body = {"text_input": prompt, "max_tokens": N_TOKENS, "mode": m}
            status, text = _post(llama_server, body)
            assert status == 200, text
            outs[m] = json.loads(text)["output_ids"]
        assert outs[mode] == outs["ar"], (mode, prompt)
