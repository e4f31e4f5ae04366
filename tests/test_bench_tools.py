"""The benchmark's own machinery on the CI engines: the in-process runner, the transformers peer
and the report (tables, correctness pass, power-law fit, plots), so `make bench` cannot rot."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import PROMPTS, REPO, TARGET, WEAK

N = 12


def _prompts(tmp_path: Path, codec) -> Path:
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps([{"dataset": "toy", "index": i, "ids": codec.encode_prompt(p)}
                             for i, p in enumerate(PROMPTS[:2])]))
    return f


def _run(script: str, args: list[str]) -> None:
    subprocess.run([sys.executable, str(REPO / "tools" / "bench" / script), *args], check=True, timeout=600)


def test_inprocess_runner_is_exact_and_reports(engine_root, codec, tmp_path):
    out = tmp_path / "inproc.json"
    _run("inprocess.py", ["--target", str(engine_root / TARGET), "--drafter", str(engine_root / WEAK),
                          "--prompts", str(_prompts(tmp_path, codec)), "--max-tokens", str(N), "--out", str(out)])
    rows = json.loads(out.read_text())
    assert sorted((r["prompt"], r["mode"]) for r in rows) == sorted((i, m) for i in range(2) for m in ("ar", "sd", "ssd"))
    for i in range(2):
        ids = {r["mode"]: r["ids"] for r in rows if r["prompt"] == i}
        assert ids["sd"] == ids["ar"] and ids["ssd"] == ids["ar"] and 0 < len(ids["ar"]) <= N  # fp32: exact
    for r in rows:
        assert r["decode_tokens_per_s"] > 0 and r["acceptance_length"] >= 1.0
        assert sum(r["rounds_by_choice"].values()) == r["rounds"]
        assert r["verify_forward_ms"] > 0 and r["verify_outside_forward_ms"] >= 0  # forward inside the call


def test_inprocess_runner_answers_jobs_from_stdin(engine_root, codec):
    """The bench keeps the runner alive beside the idle server and sends each job after its served twin."""
    proc = subprocess.Popen([sys.executable, str(REPO / "tools" / "bench" / "inprocess.py"), "--target",
                             str(engine_root / TARGET), "--drafter", str(engine_root / WEAK), "--max-tokens", str(N),
                             "--jobs-stdin"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(proc.stdout.readline()) == {"ready": True}
        ids = codec.encode_prompt(PROMPTS[0])
        rows = []
        # the bench's in-process warm-up is a job with its own length
        for mode, extra in (("ar", {}), ("ssd", {}), ("sd", {"max_tokens": 3})):
            proc.stdin.write(json.dumps({"dataset": "toy", "index": 0, "ids": ids, "mode": mode, **extra}) + "\n")
            proc.stdin.flush()
            rows.append(json.loads(proc.stdout.readline()))
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert [(r["dataset"], r["prompt"], r["mode"]) for r in rows] == [("toy", 0, m) for m in ("ar", "ssd", "sd")]
    assert rows[1]["ids"] == rows[0]["ids"] and 3 < len(rows[0]["ids"]) <= N
    assert rows[2]["ids"] == rows[0]["ids"][:3]


def test_peer_matches_our_greedy_ar(engine_root, codec, tmp_path):
    prompts = _prompts(tmp_path, codec)
    ours, peer = tmp_path / "ours.json", tmp_path / "peer.json"
    _run("inprocess.py", ["--target", str(engine_root / TARGET), "--drafter", str(engine_root / WEAK),
                          "--prompts", str(prompts), "--max-tokens", str(N), "--modes", "ar", "--out", str(ours)])
    _run("peer.py", ["--target", str(engine_root / TARGET), "--drafter", str(engine_root / WEAK), "--prompts",
                     str(prompts), "--max-tokens", str(N), "--k", "2", "--cores", "0", "--threads", "1",
                     "--out", str(peer)])
    rows = json.loads(peer.read_text())
    ar = {r["prompt"]: r["ids"] for r in json.loads(ours.read_text())}
    assert {(r["prompt"], r["mode"]) for r in rows} == {(i, m) for i in range(2) for m in ("ar", "assisted")}
    for r in rows:
        # the same token ids (chat template included), the same greedy continuation (fp32 on both sides)
        assert r["ids"][:len(ar[r["prompt"]])] == ar[r["prompt"]], (r["mode"], r["prompt"])
        assert r["decode_tokens_per_s"] > 0 and r["target_forwards"] >= 1


def test_peer_drafts_the_k_it_is_asked_for(engine_root, codec, tmp_path):
    """transformers reads K from the assistant's own generation_config (passed to generate() it is
    ignored, and its default K = 20 with a confidence cut-off ran). With the target as its own
    assistant every draft is accepted, so each round yields K + 1 tokens: never more, and the full
    K + 1 at least once."""
    out = tmp_path / "peer.json"
    _run("peer.py", ["--target", str(engine_root / TARGET), "--drafter", str(engine_root / TARGET), "--prompts",
                     str(_prompts(tmp_path, codec)), "--max-tokens", str(N), "--k", "2,3", "--modes", "assisted",
                     "--cores", "0", "--threads", "1", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert sorted((r["prompt"], r["k"]) for r in rows) == [(0, 2), (0, 3), (1, 2), (1, 3)]
    for r in rows:
        per_round = r["tokens_per_round"]
        assert sum(per_round) == r["new_tokens"] and len(per_round) == r["target_forwards"], r
        assert max(per_round) == r["k"] + 1, (r["k"], per_round)
        assert r["acceptance_length"] == r["new_tokens"] / r["target_forwards"]


def test_report_counts_divergences_and_fits_the_miss_rate(tmp_path):
    from ssd_tools.bench import report

    def row(phase, mode, prompt, ids, tps, **kw):
        return dict(phase=phase, mode=mode, dataset="toy", prompt=prompt, ids=ids, latency_s=1.0,
                    decode_tokens_per_s=tps, acceptance_length=3.0, p_hit=kw.pop("p_hit", 0.0),
                    speedup_predicted=kw.pop("pred", 1.0), **kw)

    split = [row("greedy", "ar", 0, [1, 2, 3], 2.0), row("greedy", "sd", 0, [1, 2, 3], 3.0, pred=1.5),
             row("greedy", "ssd", 0, [1, 9, 3], 4.0, pred=2.0, p_hit=0.8)]
    # miss rate exactly 0.8 B^-1: the fit must give r = 1, c = 0.8
    split += [row("sweep:budget", "ssd", 0, [1], 4.0, p_hit=1 - 0.8 / b, fanout_budget=b) for b in (4, 8, 16)]
    # at 2 threads AR leaves 1-thread AR at token 2; SD at 2 threads equals AR at 2 threads
    shared2 = [row("greedy", "ar", 0, [1, 2, 7], 3.0), row("greedy", "sd", 0, [1, 2, 7], 3.5)]
    raw = {"split": split, "shared2": shared2,
           "meta": {"preset": "t", "wall_s": 1, "max_tokens": 3, "datasets": ["toy"], "per_dataset": 1}}
    md = report.write(raw, tmp_path)
    assert "| SSD K=4 B=12, 1+1 cores | 0/1 | toy #0 @ 1 |" in md  # the divergence at token 1 is reported
    assert "| SD K=4, 1+1 cores (serial) | 1/1 | - |" in md
    assert "| AR, 2 threads | 0/1 | toy #0 @ 2 |" in md
    assert "| SD K=4, 2 threads vs AR, 2 threads | 1/1 | - |" in md
    assert "| SSD / SD, paper protocol | 1.33 | >= 1.25 | yes |" in md
    # served / in-process pairs the prompts the in-process runs covered (prompt 1 has no twin)
    paired = {"split": [row("greedy", "ar", 0, [1], 2.0), row("greedy", "ar", 1, [1], 10.0)],
              "inproc": [dict(mode="ar", dataset="toy", prompt=0, decode_tokens_per_s=2.5)]}
    assert abs(report.serving_ratio(paired, "ar") - 0.8) < 1e-12
    # time outside the forward: served 12 ms, in-process 2 ms per verify, in a 1000-ms served round
    timed = {"split": [row("greedy", "ar", 0, [1], 1.0, verify_forward_ms=900.0, verify_outside_forward_ms=12.0)],
             "inproc": [dict(mode="ar", dataset="toy", prompt=0, verify_forward_ms=880.0, verify_outside_forward_ms=2.0)]}
    timed["split"][0]["acceptance_length"] = 1.0
    assert "| ar | 900 / 12.0 | 880 / 2.0 | 1.0% |" in report.outside_forward(timed)
    _, _, r, c = report.budget_fit(raw)
    assert abs(r - 1.0) < 1e-9 and abs(c - 0.8) < 1e-9
    # a short run can hit every round at every budget: no power law, said so, the points still plotted
    allhit = {**raw, "split": [dict(x, p_hit=1.0) if x["phase"] == "sweep:budget" else x for x in split]}
    assert report.budget_fit(allhit)[2:] == (None, None)
    assert "no fit, fewer than two budgets missed a round (p_hit 1.00 / 1.00 / 1.00 at B = 4 / 8 / 16)" in \
        report.write(allhit, tmp_path)
    for png in ("throughput.png", "hit_rate_vs_budget.png", "ssd_over_sd_predicted_vs_measured.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_report_ratios_pair_the_prompts_both_configurations_ran():
    """Quick runs the 2-thread rows and the peer on one prompt of two: every ratio (targets and the
    tables' vs AR / vs SD) compares the same prompts, not one prompt's rate with another's."""
    from ssd_tools.bench import report

    def row(mode, prompt, tps, **kw):
        return dict(phase="greedy", mode=mode, dataset="toy", prompt=prompt, ids=[1], latency_s=1.0,
                    decode_tokens_per_s=tps, acceptance_length=1.0, p_hit=0.0, **kw)

    # prompt 1 runs 5x faster than prompt 0 in every configuration that ran it
    raw = {"split": [row("ar", 0, 1.0), row("ar", 1, 5.0), row("sd", 0, 2.0), row("sd", 1, 10.0),
                     row("ssd", 0, 3.0), row("ssd", 1, 15.0)],
           "shared2": [row("ar", 0, 1.5), row("sd", 0, 2.5)], "peer": [row("assisted", 0, 2.0, k=2)]}
    md = report.targets(raw)
    assert "| SSD (1+1) / best of SD 2 threads and peer | 1.20 | >= 1.15 | yes |" in md  # 3.0 / 2.5, not 9.0 / 2.5
    assert "| our SD 2 threads / peer 2 threads | 1.25 | >= 1.0 | yes |" in md
    assert "| SSD / SD, paper protocol | 1.50 | >= 1.25 | yes |" in md
    assert "| SD K=4, 2 threads | 2.50 | 1.0 | 2.50x | 1.25x |" in report.table(raw, None)  # vs AR 1.0, SD 2.0


def test_sweeps_choose_a_value_only_beyond_the_repeated_baselines_spread():
    """The shipped SSD configuration runs twice a sweep prompt; a sweep's best replaces the shipped
    value only when it wins by more than those two measurements differed."""
    from ssd_tools.bench import report

    def row(phase, prompt, tps, **knobs):
        return dict(phase=phase, mode="ssd", dataset="toy", prompt=prompt, ids=[1], decode_tokens_per_s=tps,
                    acceptance_length=3.0, p_hit=0.8, **{"fanout_budget": 12, "fanout_shape": "geometric", **knobs})

    # the baseline ran 2.0 then 2.4 on prompt 0, 4.0 then 3.6 on prompt 1: it moved (0.4/2.2 + 0.4/3.8) / 2 = 14.3%
    split = [row("greedy", 0, 2.0), row("greedy", 1, 4.0), row("repeat", 0, 2.4), row("repeat", 1, 3.6)]
    split += [row("sweep:budget", 0, 2.0), row("sweep:budget", 1, 4.0)]  # 12: the greedy rows' request
    split += [row("sweep:budget", 0, 2.2, fanout_budget=5), row("sweep:budget", 1, 4.4, fanout_budget=5)]  # +10%
    split += [row("sweep:shape", 0, 2.0), row("sweep:shape", 1, 4.0)]
    split += [row("sweep:shape", 0, 2.9, fanout_shape="uniform"), row("sweep:shape", 1, 4.3, fanout_shape="uniform")]
    # C at temperature 0.7: its baseline (the t0.7 row, 3.0 then 2.0: moved 40%) has its own spread
    split += [dict(row("t0.7", 0, 3.0), temperature=0.7, saguaro_c=1.0),
              dict(row("repeat", 0, 2.0), temperature=0.7, saguaro_c=1.0),
              dict(row("sweep:c", 0, 3.0), temperature=0.7, saguaro_c=1.0),
              dict(row("sweep:c", 0, 3.0), temperature=0.7, saguaro_c=0.5)]  # +20% over (3.0 + 2.0) / 2
    raw = {"split": split, "meta": {"sweep_defaults": {"budget": 12, "shape": "geometric", "c": 1.0}}}
    assert abs(report.repeat_spread(raw) - (0.4 / 2.2 + 0.4 / 3.8) / 2) < 1e-12
    assert abs(report.repeat_spread(raw, sampled=True) - 0.4) < 1e-12
    md, chosen = report.sweeps(raw)
    assert "| 12 (shipped) | 3.00 | 3.00 | 0.80 | 4 |" in md  # both measurements of the baseline count
    assert chosen["budget"].startswith("12 (5 ran +10%, within the 14%")
    assert chosen["shape"] == "uniform (+20% over the shipped geometric)"  # 3.6 against 3.0
    assert chosen["c"].startswith("1.0 (0.5 ran +20%, within the 40%")  # the greedy 14% would have chosen 0.5
    assert "moved 14% greedy and 40% at temperature 0.7" in md
    # a run without the repeat has no spread: the fastest value is chosen
    old = {"split": [r for r in split if r["phase"] != "repeat"], "meta": raw["meta"]}
    assert report.repeat_spread(old) is None and report.sweeps(old)[1]["budget"].startswith("5 (+10%")


def test_loadtest_parts_merge_into_one_row():
    """`loadtest/sweep.py --repeat` (loadtest/sweep_report.py): interleaved parts of a cell report as one, with tokens/s over
    all the parts' time (not a mean of rates) and percentiles over all their latencies."""
    from ssd_loadtest.sweep_report import merge

    def part(tokens, span, lat, kinds, hits):
        return {"mode": "ssd", "users": 4, "requests": len(lat), "failures": 0, "rps": 0.5, "output_tokens": tokens,
                "output_tokens_per_s": tokens / span, "server_requests_ok": len(lat), "server_requests_failed": 0,
                "server_output_tokens": tokens, "cache_hits": hits, "cache_misses": 10 - hits, "backup_neural": 1,
                "backup_fast": 0, "rejected_busy": 0, "policy_rates": "", "locust_rc": 0, "wall_s": span,
                "parts_tok_s": f"{tokens / span:.2f}", "_lat": lat, "_ttft": [], "_span": span, "_kinds": kinds}

    row = merge([part(100, 10.0, [1.0, 2.0], {"sd": 3.0}, 2), part(300, 50.0, [3.0, 4.0, 5.0], {"sd": 1, "ar": 5}, 8)])
    assert row["output_tokens"] == 400 and row["output_tokens_per_s"] == round(400 / 60, 2)  # not (10 + 6) / 2
    assert row["requests"] == 5 and row["latency_p50_ms"] == 3.0 and row["latency_avg_ms"] == 3.0
    assert row["p_hit"] == 0.5 and row["policy_decisions"] == "ar=5; sd=4" and row["policy_choice"] == "ar"
    assert row["parts_tok_s"] == "10.00 6.00" and merge([row]) is row
    assert row["steady_tokens_per_s"] == round(4 * 400 / (15.0 / 1000), 2)  # users x tokens / total latency


def test_quick_bench_measures_a_request_shared_by_two_tables_once():
    """The quick preset's sweeps run at the main table's length, so its budget-12 point is the greedy
    SSD row and its C = 1.0 point the temperature-0.7 SSD row: one request each, measured once
    (the served phase keys jobs by prompt, mode and every knob). Different knobs stay apart."""
    from ssd_tools.bench import plan

    pr = plan.PRESETS["quick"]
    prompts = [dict(dataset=ds, prompt=0, text=f"{ds} prompt") for ds in ("humaneval", "gsm8k")]
    jobs = plan.plan_split(pr, prompts, plan.first_prompts(prompts, pr.sweep_datasets))
    keys = {}
    for tags, body in jobs:
        keys.setdefault(plan.job_key(tags, body, pr.max_tokens), []).append(tags["phase"])
    shared = sorted(sorted(phases) for phases in keys.values() if len(phases) > 1)
    # quick sweeps and samples the HumanEval prompt only
    assert shared == [["greedy", "sweep:budget"], ["sweep:c", "t0.7"]]
    assert len(keys) == len(jobs) - 2
    # ... except the shipped SSD configuration's repeat after the sweeps: the same body, measured again
    # (greedy, and at temperature 0.7 for the C sweep)
    rep = [(t, b) for t, b in jobs if t["phase"] == "repeat"]
    ssd = {t["phase"]: b for t, b in jobs if t["phase"] in ("greedy", "t0.7") and t["mode"] == "ssd"
           and t["dataset"] == "humaneval"}
    assert [(t["dataset"], b) for t, b in rep] == [("humaneval", ssd["greedy"]), ("humaneval", ssd["t0.7"])]
    assert jobs[-2:] == rep
    assert plan.sweep_defaults(pr) == {"budget": 12, "c": 1.0}
    # AR's rate does not depend on the temperature: quick measures it greedy only
    assert not any(t["phase"] == "t0.7" and t["mode"] == "ar" for t, _ in jobs)
    full = plan.PRESETS["full"]
    fj = plan.plan_split(full, prompts, prompts)
    # full, at the main table's length too: the SSD baseline (K 4, adaptive K, geometric, budget 12,
    # auto backup) is the greedy SSD row in those 5 sweeps, SD K=4 the greedy SD row, C 1.0 the
    # temperature-0.7 SSD row: 7 requests a prompt measured once more
    assert len({plan.job_key(t, b, full.max_tokens) for t, b in fj}) == len(fj) - 7 * len(prompts)
    fkeys = [plan.job_key(t, b, full.max_tokens) for t, b in fj]
    sd4 = [t["phase"] for (t, b), k in zip(fj, fkeys) if k == fkeys[1]]  # fj[1]: the first prompt's greedy SD
    assert fj[1][0]["mode"] == "sd" and sorted(sd4) == ["greedy", "sweep:sd_k"]


def test_ab_interleaves_variants_and_summarizes_paired_ratios():
    """tools/bench/ab.py: each prompt runs every variant back to back, the order reversed on every
    other prompt (a drift within a pair favours neither); the ratios are per prompt, against variant 0."""
    from ssd_tools.bench import ab

    prompts = [dict(dataset="toy", prompt=i, text=f"p{i}") for i in range(3)]
    jobs = ab.plan([{"fanout_budget": 12}, {"fanout_budget": 8}], prompts, "ssd")
    assert [(t["prompt"], t["variant"], b["fanout_budget"]) for t, b in jobs] == \
        [(0, 0, 12), (0, 1, 8), (1, 1, 8), (1, 0, 12), (2, 0, 12), (2, 1, 8)]
    assert all(b["step_aside"] is False and b["mode"] == "ssd" for _, b in jobs)  # the bench's SSD knobs

    def row(prompt, variant, tps):
        return dict(dataset="toy", prompt=prompt, variant=variant, decode_tokens_per_s=tps, acceptance_length=3.0,
                    p_hit=0.5 + 0.1 * variant)
    # variant 1: 2x on one prompt, 0.5x on another, 1.1x on the third: geomean 1.1^(1/3), 2 wins
    rows = [row(0, 0, 2.0), row(0, 1, 4.0), row(1, 1, 1.0), row(1, 0, 2.0), row(2, 0, 1.0), row(2, 1, 1.1)]
    s = ab.summarize(rows, 2)
    assert s[0]["ratio_geomean"] == 1.0 and s[0]["wins"] == 0
    assert abs(s[1]["ratio_geomean"] - 1.1 ** (1 / 3)) < 1e-12
    assert (s[1]["ratio_min"], s[1]["ratio_max"], s[1]["wins"], s[1]["n"]) == (0.5, 2.0, 2, 3)
    assert abs(s[1]["tok_s"] - (4.0 + 1.0 + 1.1) / 3) < 1e-12 and abs(s[1]["p_hit"] - 0.6) < 1e-12
    assert "| 2/3 |" in ab.table(s, [{"fanout_budget": 12}, {"fanout_budget": 8}])


def test_bench_and_loadtest_share_one_table_writer_and_one_request_body(tmp_path):
    """The bench's and the load sweep's Markdown come from one writer; the Locust users (sweep,
    soak, llama.cpp peer) take their prompts, bodies and output ids from one module."""
    from ssd_loadtest import traffic
    from ssd_loadtest.sweep_report import markdown, write_report
    from ssd_tools import markdown_report as md
    from ssd_tools.prompts import load
    from ssd_tools.runner import parse_metrics

    assert md.table(["a", "b"], [[1, "x"], [2.5, "-"]]) == "| a | b |\n|---|---|\n| 1 | x |\n| 2.5 | - |"
    assert md.fmt(float("nan")) == "-" and md.fmt(None) == "-" and md.fmt(1.234) == "1.23"
    row = {"mode": "ssd", "users": 4, "requests": 9, "failures": 0, "output_tokens_per_s": 12.34,
           "steady_tokens_per_s": 13.0, "latency_p50_ms": 800.4, "latency_p99_ms": 1200.0, "ttft_p50_ms": "",
           "p_hit": 0.75, "backup_neural": 2, "backup_fast": 1, "policy_decisions": "sd=3; ssd+neural=9"}
    assert markdown([row]).splitlines()[2] == \
        "| ssd | 4 | 9 | 0 | 12.3 | 13.0 | 800 | 1200 | - | 0.75 | 2/1 | sd=3; ssd+neural=9 |"
    text = write_report([row], tmp_path, "Load sweep", [tmp_path / "throughput.png"])
    assert (tmp_path / "report.md").read_text() == text and text.startswith("# Load sweep\n\n## Per mode")
    assert markdown([row]) in text

    assert traffic.output_ids(7) == [7] and traffic.output_ids([1, 2]) == [1, 2] and traffic.output_ids(None) == []
    assert traffic.body("p", 8, "sd") == {"text_input": "p", "max_tokens": 8, "mode": "sd", "temperature": 0.0,
                                          "stream": False}
    assert traffic.body("p", 8, "ssd", True, temperature=0.7, seed=3)["temperature"] == 0.7
    he, gsm = load("humaneval", 2), load("gsm8k", 1)
    assert traffic.prompts(["humaneval", "gsm8k"], 2) == [he[0], gsm[0], he[1], load("gsm8k", 2)[1]]

    m = parse_metrics('# HELP x\nssd_requests_total{mode="ssd",status="ok"} 3\nnv_inference_count 9\n'
                      'ssd_active_requests 0\n')
    assert m == {("ssd_requests_total", frozenset({("mode", "ssd"), ("status", "ok")})): 3.0,
                 ("ssd_active_requests", frozenset()): 0.0}


def test_paired_summary_sums_each_side_and_divides_ours_by_llama():
    from ssd_tools.llamacpp.paired import summarize

    def side(pre, dec, tokens=64, wall=None):
        lat = pre + dec + 0.1
        return {"prefill_s": pre, "decode_s": dec, "latency_s": lat, "wall_s": wall or lat, "tokens": tokens}

    pairs = [{"llama": side(1.0, 3.0), "ours": side(1.5, 3.5)}, {"llama": side(2.0, 3.0), "ours": side(1.5, 2.5)}]
    s = summarize(pairs)
    assert s["llama"]["prefill_s"] == 3.0 and s["ours"]["decode_s"] == 6.0 and s["ours"]["tokens"] == 128
    assert s["ours_over_llama"] == {"prefill_s": 1.0, "decode_s": 1.0, "latency_s": 1.0, "wall_s": 1.0,
                                    "tokens_per_s": 1.0}
    pairs[0]["ours"] = side(3.0, 3.5)
    assert summarize(pairs)["ours_over_llama"]["prefill_s"] == 1.5
    # groups of users: tokens/s is each side's tokens over its wall time, not over the latencies' sum
    pairs = [{"llama": side(4.0, 12.0, 256, wall=8.0), "ours": side(4.0, 16.0, 256, wall=10.0)}]
    s = summarize(pairs)
    assert s["llama"]["tokens_per_s"] == 32.0 and s["ours"]["tokens_per_s"] == 25.6
    assert s["ours_over_llama"]["tokens_per_s"] == 0.8 and s["ours_over_llama"]["wall_s"] == 1.25


def test_paired_group_sends_its_prompts_at_once_and_sums_them():
    import threading

    from ssd_tools.llamacpp.paired import run_group

    inside, peak, lock = [0], [0], threading.Lock()
    started = threading.Barrier(3, timeout=10)  # fails unless all three requests run at once

    def request(prompt):
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        started.wait()
        with lock:
            inside[0] -= 1
        n = len(prompt)
        return {"prefill_s": 0.1 * n, "decode_s": 1.0, "latency_s": 1.0 + 0.1 * n, "tokens": n,
                "prompt_tokens": 10 * n, "cached_prompt_tokens": n}

    g = run_group(request, ["a", "bb", "ccc"])
    assert peak[0] == 3 and g["tokens"] == 6 and g["prompt_tokens"] == 60 and g["cached_prompt_tokens"] == 6
    assert abs(g["prefill_s"] - 0.6) < 1e-9 and g["decode_s"] == 3.0 and g["wall_s"] > 0
    assert [r["tokens"] for r in g["requests"]] == [1, 2, 3]  # in prompt order


def test_the_lookup_ceiling_prices_rounds_on_the_curve_it_is_given():
    from ssd.algorithm.free_draft import FreeDrafter
    from ssd_tools.bench.lookup_ceiling import ROW_MS, forward_ms, parse_row_ms, simulate

    assert [forward_ms(r) for r in (1, 4, 6)] == [27.3, pytest.approx(47.35), pytest.approx(61.05)]
    flat = parse_row_ms("1:112,2:107,4:130,16:316")
    assert forward_ms(3, flat) == pytest.approx(118.5) and forward_ms(20, flat) == pytest.approx(316 + 4 * 15.5)
    with pytest.raises(SystemExit, match="--row-ms"):
        parse_row_ms("2:33.6")
    # an answer that copies its prompt: lookup rounds of several tokens, cheaper where rows are flat
    prompt = list(range(100, 160))
    output = [7] + prompt[:40]
    ms, rounds = simulate(prompt, output, FreeDrafter(), 15, flat)
    assert rounds < 10 and ms < forward_ms(1, flat) * (len(output) - 1) / 3
    assert simulate(prompt, output, FreeDrafter(), 15, ROW_MS)[1] == rounds  # the curve prices, not drafts
