"""The tools that put the free-draft workloads beside the peers: the load test's workload option
(loadtest/traffic.py), the under-load comparison's sides, parts and table (loadtest/peer_sweep.py,
sweep_report.peer_markdown), llama-server's named sides (tools/bench/llamacpp.py) and the sides
of `make bench-free` (tools/bench/free_drafts.py). No servers: llama-server's flags and the
prompt lookup peer run in test_llamacpp_peer.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from ssd_loadtest import peer_sweep, sweep_report, traffic
from ssd_tools.bench import free_drafts, llamacpp, workloads
from ssd_tools.prompts import ALL

GGUFS = {"target": Path("/m/target.gguf"), "drafter": Path("/m/drafter.gguf")}


def test_a_workload_names_its_prompts_for_every_locustfile():
    assert traffic.workload_datasets("edits") == "edits" and traffic.workload_datasets("mix") == ALL
    assert traffic.prompts(traffic.workload_datasets("edits").split(","), 5) == workloads.edits(5)
    assert traffic.prompts(traffic.workload_datasets("agent").split(","), 3) == workloads.agent(3)
    with pytest.raises(ValueError, match="workload"):
        traffic.workload_datasets("chat")


def test_llama_server_sides_carry_their_own_flags():
    mod = llamacpp.peer_config("llama-ngram-mod", GGUFS, parallel=16)
    assert mod.extra == llamacpp.NGRAM_FLAGS["ngram-mod"] and mod.parallel == 16 and mod.draft is None
    assert mod.mode == "llama-ngram-mod" and mod.model == GGUFS["target"]
    simple = llamacpp.command(Path("llama-server"), llamacpp.peer_config("llama-ngram-simple", GGUFS), 9)
    assert simple[-4:] == ["--spec-type", "ngram-simple", "--spec-draft-n-max", "64"]
    ar = llamacpp.peer_config("llama-ar", GGUFS)
    assert ar.extra == () and ar.draft is None
    assert llamacpp.peer_config("llama-spec", GGUFS).draft == GGUFS["drafter"]
    with pytest.raises(ValueError, match="llama-ngram-mod"):
        llamacpp.peer_config("llama-ngram", GGUFS)


def test_the_load_comparison_runs_ours_first_and_rotates_the_order_by_part():
    sides = peer_sweep.parse_sides("llama-ar,llama-ngram-mod,llama-ar")
    assert sides == ["ours", "llama-ar", "llama-ngram-mod"]
    assert [peer_sweep.part_order(sides, p)[0] for p in range(4)] == ["ours", "llama-ar", "llama-ngram-mod", "ours"]
    assert sorted(peer_sweep.part_order(sides, 1)) == sorted(sides)
    for bad in ("", "ours", "llama-ngram-mod,vllm"):
        with pytest.raises(SystemExit):
            peer_sweep.parse_sides(bad)


def test_a_sides_parts_add_up_to_one_steady_rate():
    parts = [{"tokens": 100, "latency_ms": [4000.0, 6000.0], "failures": 0, "span_s": 10.0, "locust_rc": 0,
              "kinds": {"lookup@wide": 30}},
             {"tokens": 60, "latency_ms": [6000.0], "failures": 1, "span_s": 6.0, "locust_rc": 1,
              "kinds": {"lookup@wide": 5, "ar@wide": 10}}]
    row = peer_sweep.merged("ours", 2, parts)
    # 2 users x 160 tokens over 16 s of request latency; the parts alone: 2 x 100 / 10, 2 x 60 / 6
    assert row["steady_tokens_per_s"] == 20.0 and row["parts_steady_tok_s"] == "20.00 20.00"
    assert (row["requests"], row["failures"], row["tokens"], row["locust_rc"]) == (3, 1, 160, 1)
    assert row["output_tokens_per_s"] == 10.0
    assert row["policy_decisions"] == "ar@wide=10; lookup@wide=35"
    assert "policy_decisions" not in peer_sweep.merged("llama-ar", 2, parts)


def test_the_table_puts_ours_over_ar_and_over_the_best_ngram_at_each_user_count():
    sides = ["ours", "llama-ar", "llama-ngram-simple", "llama-ngram-mod"]
    tps = {1: (30.0, 15.0, 24.0, 20.0), 4: (40.0, 32.0, 30.0, 50.0)}
    rows = [{"side": s, "users": u, "steady_tokens_per_s": v} for u, vs in tps.items() for s, v in zip(sides, vs)]
    lines = sweep_report.peer_markdown(rows, sides).splitlines()
    assert lines[0] == ("| users | ours tok/s | llama-ar tok/s | llama-ngram-simple tok/s | llama-ngram-mod tok/s "
                        "| ours / llama-ar | ours / best n-gram |")
    assert lines[2] == "| 1 | 30.00 | 15.00 | 24.00 | 20.00 | 2.00 | 1.25 (ngram-simple) |"
    assert lines[3] == "| 4 | 40.00 | 32.00 | 30.00 | 50.00 | 1.25 | 0.80 (ngram-mod) |"
    no_ar = sweep_report.peer_markdown([r for r in rows if r["side"] != "llama-ar"],
                                       ["ours", "llama-ngram-simple", "llama-ngram-mod"])
    assert no_ar.splitlines()[2].endswith("| - | 1.25 (ngram-simple) |")


def test_bench_free_names_the_lookup_peer_by_its_draft_length():
    assert free_drafts.parse_sides("ours-nofree,llama-ar,lcpp-lookup-2") == ["ours", "ours-nofree", "llama-ar",
                                                                              "lcpp-lookup-2"]
    for bad in ("lcpp-lookup-", "lcpp-lookup-0", "lcpp-lookup-x", "llama-ngram"):
        with pytest.raises(SystemExit, match="--sides"):
            free_drafts.parse_sides(bad)
    # the longest prompt (700) + 256 tokens + a last draft of 10 + the next token: 967, in 256s
    assert free_drafts.lookup_ctx([300, 700], 256, 10) == 1024
    assert free_drafts.lookup_ctx([1], 254, 0) == 256 and free_drafts.lookup_ctx([1], 255, 0) == 512


def test_bench_free_sums_decode_seconds_and_names_the_best_ngram_and_lookup_peers():
    sides = ["ours", "ours-nofree", "llama-ngram-mod", "lcpp-lookup-10", "lcpp-lookup-2"]
    # (tokens, decode tok/s) a request; the first token is the prefill's, not decode's
    runs = {"ours": [(11, 20.0), (21, 10.0)], "ours-nofree": [(11, 5.0), (21, 5.0)],
            "llama-ngram-mod": [(11, 10.0), (21, 10.0)], "lcpp-lookup-10": [(11, 6.0), (21, 6.0)],
            "lcpp-lookup-2": [(11, 7.5), (21, 7.5)]}
    rows = [{"workload": "edits", "prompt": i, "side": s, "tokens": n, "decode_tps": r,
             "ids": [i] if s != "lcpp-lookup-2" else [9]} for s, rs in runs.items() for i, (n, r) in enumerate(rs)]
    summary = free_drafts.summarize(rows, sides)["edits"]
    # ours: 30 tokens after the first over 10/20 + 20/10 = 2.5 s
    assert summary["sides"]["ours"] == {"tokens": 30, "decode_s": 2.5, "decode_tps": 12.0, "same_ids_as_nofree": "2/2"}
    assert summary["best_ngram"] == "llama-ngram-mod" and summary["best_lookup"] == "lcpp-lookup-2"
    assert summary["ratios"]["ours/lcpp-lookup-2"] == 1.6 and summary["ratios"]["ours/ours-nofree"] == 2.4
    assert summary["sides"]["lcpp-lookup-2"]["same_ids_as_nofree"] == "0/2"
