"""The llama.cpp peer (tools/bench/llamacpp.py): llama-server built from the pinned sdist's llama.cpp,
run on a tiny random GGUF written here, greedy, alone and with its speculative decoding; the rows the
bench takes from its responses; the load peer (parallel slots under the loadtest's Locust users);
the report's ours-over-llama.cpp ratios; and llama-cpp-python's prompt lookup peer
(tools/bench/lcpp_lookup.py).

The first test builds llama-server (build/llama.cpp-<version>/, a few minutes on 2 cores) unless a
cached build with the same options is there."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from ssd_tools.bench import llamacpp, report
from ssd_tools.llamacpp.tiny_gguf import write_tiny_gguf

REPO = Path(__file__).resolve().parent.parent

N = 24
PROMPT = [1, 300, 301, 320, 345, 290, 411]  # BOS, then vocabulary pieces


@pytest.fixture(scope="module")
def binary() -> Path:
    return llamacpp.build(sys.executable)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    return {"target": write_tiny_gguf(d / "target.gguf", seed=0),
            "other": write_tiny_gguf(d / "other.gguf", seed=1)}


def test_every_flag_the_peer_passes_is_one_llama_server_knows(binary, ggufs):
    help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60).stdout
    cmd = llamacpp.command(binary, llamacpp.PeerConfig(ggufs["target"], draft=ggufs["other"]), 8080)
    flags = [c for c in cmd[cmd.index(str(binary)) + 1:] if c.startswith("-")]
    assert {"--spec-type", "-md", "--spec-draft-n-max", "-td"} <= set(flags)
    for f in flags:
        assert f in help_text.replace(",", " ").split(), f
    assert "draft-simple" in help_text
    assert cmd[:3] == ["taskset", "-c", "0,1"]
    ar = llamacpp.command(binary, llamacpp.PeerConfig(ggufs["target"]), 8080)
    assert "-md" not in ar and "--spec-type" not in ar


@pytest.mark.parametrize("side", [f"llama-{t}" for t in llamacpp.NGRAM_FLAGS])
def test_every_ngram_side_starts_with_flags_llama_server_knows(binary, ggufs, side):
    help_text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60).stdout
    cfg = llamacpp.peer_config(side, {"target": ggufs["target"], "drafter": ggufs["other"]})
    flags = [c for c in cfg.extra if c.startswith("-")]
    assert "--spec-type" in flags
    for f in flags:
        assert f in help_text.replace(",", " ").split(), f
    assert side.removeprefix("llama-") in help_text  # the --spec-type value


def test_prompt_lookup_peer_keeps_greedy_tokens_and_counts_its_drafts(ggufs):
    from llama_cpp import Llama

    from ssd_tools.bench.lcpp_lookup import PromptLookupPeer

    prompts = [PROMPT, [1, 300, 301, 300, 301, 300, 301, 320]]
    llm = Llama(model_path=str(ggufs["target"]), n_ctx=128, n_threads=1, verbose=False)
    plain = []
    for p in prompts:
        llm.reset()
        out = []
        for t in llm.generate(p, temp=0.0, top_k=1, repeat_penalty=1.0):
            if t == llm.token_eos() or len(out) == N:
                break
            out.append(t)
        plain.append(out)
    del llm
    with PromptLookupPeer(ggufs["target"], pred_tokens=4, n_ctx=128, cores="0", threads=1) as peer:
        rows = [peer.complete(p, N) for p in prompts]
        again = peer.complete(prompts[0], N)
    assert [r["ids"] for r in rows] == plain and again["ids"] == rows[0]["ids"]
    for r in rows:
        assert r["tokens"] == len(r["ids"]) and r["decode_tps"] > 0 and r["prefill_s"] > 0
        assert 0 <= r["draft_n_accepted"] <= r["draft_n"] <= 4 * r["tokens"]
    assert sum(r["draft_n"] for r in rows) > 0  # the random model repeats pieces: lookup drafts


def test_prompt_lookup_peer_runs_past_the_librarys_batch_of_logits(ggufs):
    """With a draft model llama-cpp-python keeps every position's logits; a sequence past 512
    tokens (its n_batch) must still decode, and the same as the plain model's greedy tokens."""
    from llama_cpp import Llama

    from ssd_tools.bench.lcpp_lookup import PromptLookupPeer

    prompt = [1] + [300 + i % 40 for i in range(600)]  # repeats: lookup drafts from the start
    llm = Llama(model_path=str(ggufs["target"]), n_ctx=1024, n_threads=1, verbose=False)
    plain = []
    for t in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        if t == llm.token_eos() or len(plain) == N:
            break
        plain.append(t)
    del llm
    with PromptLookupPeer(ggufs["target"], pred_tokens=10, n_ctx=1024, cores="0", threads=1) as peer:
        row = peer.complete(prompt, N)
    assert row["ids"] == plain and row["draft_n"] > 0


def test_prompt_lookup_counts_a_draft_accepted_up_to_its_first_miss():
    from ssd_tools.bench.lcpp_lookup import CountingLookup

    lookup = CountingLookup(max_ngram_size=2, num_pred_tokens=3)
    # the sequence ... 7 8 9 ... 7 8: the draft copies what followed 7 8
    assert list(lookup(np.array([5, 7, 8, 9, 4, 6, 7, 8], dtype=np.intc))) == [9, 4, 6] and lookup.drafted == 3
    assert [lookup.accepted(t) for t in (9, 4, 2, 6)] == [True, True, False, False]  # 2: the target's own token
    lookup(np.array([1, 2, 3], dtype=np.intc))  # no match: no draft
    assert lookup.drafted == 3 and lookup.accepted(1) is False


def test_greedy_ar_is_deterministic_and_its_row_reads_llamacpp_timings(binary, ggufs):
    cfg = llamacpp.PeerConfig(ggufs["target"], threads=1, cores="0")
    with llamacpp.LlamaServer(binary, cfg) as srv:
        first, again = srv.complete(PROMPT, N), srv.complete(PROMPT, N)
    row = llamacpp.peer_row(first)
    assert row["ids"] == llamacpp.peer_row(again)["ids"]
    assert 0 < len(row["ids"]) == row["new_tokens"] <= N
    assert len(set(row["ids"])) > 1  # the random model wanders: the comparison below says something
    t = first["timings"]
    assert row["prompt_tokens"] == len(PROMPT)
    # llama.cpp's own rate: the first token comes from the prefill's logits, the rate counts the rest
    assert row["decode_tokens_per_s"] == pytest.approx(1000 * (t["predicted_n"] - 1) / t["predicted_ms"])
    assert row["prefill_s"] == pytest.approx(t["prompt_ms"] / 1000) and row["latency_s"] > row["prefill_s"]
    assert row["draft_n"] is None and row["acceptance_length"] is None


@pytest.mark.parametrize("drafter", ["target", "other"])
def test_speculative_decoding_keeps_greedy_ar_tokens(binary, ggufs, tmp_path, drafter):
    """With the target as its own drafter every draft is accepted; with an unrelated one few are.
    Either way the tokens are AR's."""
    k = 4
    prompts = [{"dataset": "toy", "index": i, "ids": PROMPT[:4 + i]} for i in range(2)]
    seen = []
    ar = llamacpp.run_peer(binary, llamacpp.PeerConfig(ggufs["target"], threads=1, cores="0"), prompts, N,
                           PROMPT[:3], log_file=tmp_path / "ar.log")
    spec = llamacpp.run_peer(binary, llamacpp.PeerConfig(ggufs["target"], draft=ggufs[drafter], n_draft=k, threads=1,
                                                         draft_threads=1, cores="0"),
                             prompts, N, PROMPT[:3], on_row=seen.append, log_file=tmp_path / "spec.log")
    assert seen == spec and [r["mode"] for r in ar] == ["ar"] * 2 and [r["mode"] for r in spec] == ["spec"] * 2
    for a, s in zip(ar, spec):
        assert (s["dataset"], s["prompt"], s["k"]) == (a["dataset"], a["prompt"], k)
        assert s["ids"] == a["ids"]
        assert s["draft_n"] > 0 and 0 <= s["draft_n_accepted"] <= s["draft_n"]
        rounds = s["new_tokens"] - 1 - s["draft_n_accepted"]
        assert s["draft_n"] <= k * rounds  # at most k drafts a round
        assert s["acceptance_length"] == pytest.approx((s["new_tokens"] - 1) / rounds)
    acceptance = [s["draft_acceptance"] for s in spec]
    if drafter == "target":
        assert min(acceptance) > 0.9
    else:
        assert max(acceptance) < 0.5


def test_load_peer_serves_locust_users_from_parallel_slots(binary, ggufs, tmp_path):
    """The load peer: the loadtest's closed-loop users (its prompts, summary and -i limit) against
    llama-server's chat endpoint, two users on two slots."""
    prefix, summary = tmp_path / "load", tmp_path / "summary.json"
    exe = Path(sys.executable).parent / "locust"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "locust"]
    cfg = llamacpp.PeerConfig(ggufs["target"], threads=1, cores="0", parallel=2, ctx_per_slot=1024)
    with llamacpp.LlamaServer(binary, cfg) as srv:
        cmd += ["-f", str(REPO / "tools" / "llamacpp" / "llama_locustfile.py"), "--headless", "-u", "2", "-r", "2",
                "-i", "6", "--run-time", "120s", "--host", srv.url, "--csv", str(prefix), "--only-summary"]
        env = dict(os.environ, SSD_MAX_TOKENS="8", SSD_DATASETS="humaneval", SSD_PROMPTS_PER_DATASET="3",
                   SSD_SUMMARY=str(summary))
        p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        with urllib.request.urlopen(f"{srv.url}/slots") as r:
            assert len(json.loads(r.read())) == 2
    with open(f"{prefix}_stats.csv") as f:
        rows = {r["Name"]: r for r in csv.DictReader(f)}
    assert int(rows["chat"]["Request Count"]) == 6 and int(rows["Aggregated"]["Failure Count"]) == 0, rows
    s = json.loads(summary.read_text())
    assert s["failures"] == 0 and s["requests"] == 6 and 6 <= s["tokens"] <= 6 * 8 and s["output_tokens_per_s"] > 0


def test_peer_row_counts_rounds_from_the_accepted_tokens():
    # the first token from the prefill, then 2 rounds of 4 drafts: 3 then 1 accepted, + 1 target token each
    resp = {"tokens": [5, 6, 7, 8, 9, 10, 11], "latency_s": 1.5,
            "timings": {"predicted_n": 7, "predicted_per_second": 12.0, "prompt_ms": 250.0, "prompt_n": 9,
                        "draft_n": 8, "draft_n_accepted": 4}}
    row = llamacpp.peer_row(resp)
    assert row["ids"] == [5, 6, 7, 8, 9, 10, 11] and row["decode_tokens_per_s"] == 12.0 and row["prefill_s"] == 0.25
    assert row["draft_acceptance"] == 0.5 and row["acceptance_length"] == 3.0


def test_gguf_files_come_from_the_engine_config(tmp_path):
    by_role = llamacpp.gguf_by_role(REPO / "engines" / "default.yaml", tmp_path)
    assert by_role == {"target": tmp_path / ".cache" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                       "drafter": tmp_path / ".cache" / "qwen2.5-coder-0.5b-instruct-awq.gguf"}


def test_report_puts_ours_over_llamacpp_on_the_prompts_both_ran():
    def row(source_mode, prompt, rate, **kw):
        return {"dataset": "d", "prompt": prompt, "mode": source_mode, "decode_tokens_per_s": rate, "ids": [1],
                "latency_s": 1.0, "acceptance_length": 1.0, **kw}

    raw = {"split": [row("ssd", 0, 12.0, phase="greedy"), row("ssd", 1, 30.0, phase="greedy"),
                     row("default", 0, 12.0, phase="greedy")],
           "shared2": [row("ar", 0, 7.0, phase="greedy")],
           "llamacpp": [row("ar", 0, 14.0, k=0), row("spec", 0, 6.0, k=4), row("spec", 2, 50.0, k=4)]}
    table = report.against_llamacpp(raw)
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in table.splitlines()}
    assert "llama.cpp AR, 2 threads" in table.splitlines()[0]
    assert lines["SSD K=4 B=12, 1+1 cores"].endswith("| 0.86x | 2.00x |")  # prompt 0 only
    assert lines["AR, 2 threads"].endswith("| 0.50x | 1.17x |")
    targets = report.targets(raw)
    assert "| our AR 2 threads / llama.cpp AR 2 threads | 0.50 | >= 0.95 | no |" in targets
    assert "| served default / llama.cpp speculative decoding | 2.00 | >= 2.0 | yes |" in targets
    assert report.against_llamacpp({"split": raw["split"]}) == "(llama.cpp did not run)"
