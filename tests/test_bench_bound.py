"""The bench's ceiling (tools/bench/bound.py): its formulas on costs whose answers are known by hand,
and its measurement on the CI engines, so the bound phase of `make bench` cannot rot."""
from __future__ import annotations

import json
import math

import pytest
from conftest import TARGET, WEAK

from ssd.algorithm.estimators import Acceptance
from ssd_tools.bench import bound


def _costs(t1: dict, t2: dict, d1: dict, d2: dict, trees: dict) -> dict:
    """Figures as measure() returns them, round-tripped through JSON as raw.json stores them."""
    figs = {"target": {1: {"rows": t1, "tree": {}}, 2: {"rows": t2, "tree": {}}},
            "drafter": {1: {"rows": d1, "tree": trees}, 2: {"rows": d2, "tree": {}}}}
    return json.loads(json.dumps(figs))


def _tokens(a: float, k: int) -> float:
    return Acceptance(a).tokens(k)


def test_acceptance_is_recovered_from_the_tokens_a_round():
    for a, k in ((0.0, 4), (0.5, 1), (0.786, 4), (0.95, 3)):
        assert bound.alpha_from(_tokens(a, k), k) == pytest.approx(a, abs=1e-9)
    assert _tokens(0.5, 2) == pytest.approx(1.75)


def test_free_drafts_and_a_flat_verify_give_each_choice_its_tokens_a_round():
    rows = {n: 20.0 for n in range(1, 6)}  # every forward costs one row's 20 ms
    free = {n: 0.0 for n in range(1, 6)}
    c = bound.with_int_keys(_costs(rows, rows, free, free, {1: 0.0, 12: 0.0}))
    a = 0.5
    for k in range(1, 5):
        r = bound.rates(c, a, k, {12: 0.9})
        e = _tokens(a, k)
        assert r["AR@wide"] == pytest.approx(50.0)
        assert r["SD@wide"] == pytest.approx(e * 50.0) and r["SD (1+1)"] == pytest.approx(e * 50.0)
        assert r["SSD (1+1), all hits, B=1"] == pytest.approx(e * 50.0)
        assert r["SSD (1+1), p_hit 0.90, B=12"] == pytest.approx(e * 50.0)  # free misses cost nothing
    top = bound.ceiling(c, a)
    assert top["best_over_ar_wide"] == pytest.approx(_tokens(a, 4))  # the longest K wins
    assert top["ssd_over_sd"] == pytest.approx(1.0)


def test_speculation_is_priced_by_its_own_forwards():
    t1 = {1: 40.0, 2: 50.0, 3: 60.0, 4: 70.0, 5: 80.0}
    t2 = {n: v / 2 for n, v in t1.items()}
    d1 = {1: 10.0, 2: 12.0, 3: 14.0, 4: 16.0, 5: 18.0}
    d2 = {n: v / 2 for n, v in d1.items()}
    c = _costs(t1, t2, d1, d2, {1: 10.0, 5: 30.0})
    r = bound.rates(bound.with_int_keys(c), 0.8, 2, {5: 0.75})
    e = 1 + 0.8 + 0.64
    assert r["AR@wide"] == pytest.approx(1000 / 20)
    assert r["SD@wide"] == pytest.approx(e / ((2 * 5 + 30) / 1000))
    assert r["SD (1+1)"] == pytest.approx(e / ((2 * 10 + 60) / 1000))
    # the speculation (a one-row glue pass, two one-branch steps: 10 + 20 ms) hides under the 60 ms verify
    assert r["SSD (1+1), all hits, B=1"] == pytest.approx(e / 0.060)
    # five branches: 10 + 2 x 30 = 70 ms outlasts the verify; a quarter of the rounds wait 2 x 10 ms more
    assert r["SSD (1+1), p_hit 0.75, B=5"] == pytest.approx(e / ((70 + 0.25 * 20) / 1000))
    top = bound.ceiling(c, 0.8, {5: 0.75})
    best_sd = max(bound.rates(bound.with_int_keys(c), 0.8, k)["SD (1+1)"] for k in range(1, 5))
    best_ssd = max(bound.rates(bound.with_int_keys(c), 0.8, k)["SSD (1+1), all hits, B=1"] for k in range(1, 5))
    assert top["ssd_over_sd"] == pytest.approx(best_ssd / best_sd)
    text = bound.report(c, 0.8, {5: 0.75}, 0.9)
    assert f"**{top['best_over_ar_wide']:.2f}x** AR@wide" in text
    assert "llama.cpp's AR in this run: 0.90" in text and f"**{top['ssd_over_sd']:.2f}x** SD" in text
    assert "llama.cpp" not in bound.report(c, 0.8, None, math.nan)
    assert "hit rates the budget sweep measured" not in bound.report(c, 0.8, None, 0.9)


def test_measures_every_forward_of_the_served_engines(engine_root):
    costs = bound.measure(engine_root, TARGET, WEAK, threads=(1,), passes=1)
    for role in ("target", "drafter"):
        assert set(costs[role][1]["rows"]) == set(range(1, bound.K_MAX + 2))
        assert all(v > 0 for v in costs[role][1]["rows"].values())
    assert set(costs["drafter"][1]["tree"]) == set(bound.TREES) and costs["target"][1]["tree"] == {}
    assert all(v > 0 for v in costs["drafter"][1]["tree"].values())


def test_llamacpp_drafter_rows_run_tree_steps_as_sequences_sharing_a_prefix(llama_target):
    from ssd_tools.llamacpp import drafter_rows

    ms = drafter_rows.measure(str(llama_target / "model.gguf"), threads=1, k=2, trees=[3, 5], reps=2)
    assert list(ms) == ["1 row", "3 rows (glue)", "tree step, 3 rows", "tree step, 5 rows"]
    assert all(v > 0 for v in ms.values())
