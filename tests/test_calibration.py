"""The engines' costs measured before the first decode (decoding/calibration.py), on the CI engines."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from decoding_clients import local_client


def test_shapes_reach_the_largest_batch_a_verify_and_one_sequences_longest_verify():
    from ssd.decoding.calibration import batch_shapes, target_shapes, verify_rows

    assert batch_shapes(16) == [(1, 1), (4, 1), (16, 1)]
    assert batch_shapes(1) == [(1, 1)]
    assert batch_shapes(6) == [(1, 1), (4, 1), (6, 1)]
    assert verify_rows(17) == [2, 5, 9, 17]  # K + 1 for K = 1, 4, 8 and lookup_max_k 16
    assert verify_rows(8) == [2, 5, 8] and verify_rows(2) == [2] and verify_rows(0) == []
    assert target_shapes(16, 17) == [(1, 1), (4, 1), (16, 1), (16, 2), (1, 2), (1, 5), (1, 9), (1, 17)]
    assert target_shapes(1, 2) == [(1, 1), (1, 2)] and target_shapes(4, 0) == [(1, 1), (4, 1), (4, 2)]


def test_calibration_measures_every_curve_at_the_batch_sizes_it_runs_and_frees_its_sequences(engines):
    from ssd.algorithm.cost_model import CostModel
    from ssd.decoding.calibration import calibrate

    client = local_client(engines, "strong")
    model = CostModel()
    assert not model.known
    measured = asyncio.run(calibrate(client, model, wide_threads=2, max_batch=4, max_rows=5))
    assert model.known and measured > 0
    # target: 1, 4 and 8 rows (4 sequences x 2) on each layout, one sequence's 2 and 5 on the
    # split one; drafter: 1 and 4 rows
    for curve, rows in ((model.target, {1, 2, 4, 5, 8}), (model.target_wide, {1, 4, 8}),
                        (model.drafter, {1, 4}), (model.drafter_wide, {1, 4})):
        assert {round(b[0]) for b in curve.buckets.values()} == rows
        assert all(b[1] > 0 for b in curve.buckets.values())
    for name in ("target", "strong"):
        assert not any(s.startswith("__calibrate") for s in engines[name].sequences)
    # the drafter's prefill a row, on each layout: what a catch-up of n rows costs
    assert set(model.catch_up_row_seconds) == {False, True} and all(v > 0 for v in model.catch_up_row_seconds.values())
    assert model.catch_up_seconds(100, wide=True) == 100 * model.catch_up_row_seconds[True]


def test_calibration_without_wide_rounds_leaves_the_wide_curves_to_the_rounds(engines):
    from ssd.algorithm.cost_model import CostModel
    from ssd.decoding.calibration import calibrate

    model = CostModel()
    asyncio.run(calibrate(local_client(engines, "strong"), model, wide_threads=0, max_batch=1))
    assert model.target.known and model.drafter.known
    assert not model.target_wide.known and not model.drafter_wide.known


class FakeEngines:
    """Two engines' forwards by a cost table: ``verify(rows)`` and ``draft(rows)`` seconds in
    steady state, ``first_touch`` times that for an engine's first forward on a layout and
    ``spinning`` times that for a wide forward right after the other engine's call (its threads
    still on the cores)."""

    def __init__(self, verify, draft, first_touch=5.0, spinning=3.0):
        self.cost = {"verify": verify, "draft": draft}
        self.first_touch, self.spinning = first_touch, spinning
        self.touched, self.last = set(), None
        self.calls = []

    async def call_many(self, kind, calls):
        threads = calls[0].threads
        rows = len(calls) * (len(calls[0].draft) + 1 if kind == "verify" else len(calls[0].tokens))
        seconds = self.cost[kind](rows)
        if (kind, threads) not in self.touched:
            seconds *= self.first_touch
        elif threads and self.last not in (None, kind):
            seconds *= self.spinning
        self.touched.add((kind, threads))
        self.last = kind
        self.calls.append((kind, threads, rows))
        return [SimpleNamespace(timing=[(rows, seconds)]) for _ in calls]

    async def release_many(self, ids):
        pass

    async def release(self, seq):
        pass


def steady_verify(rows: int) -> float:
    """A target that runs a call's rows in forwards of up to 16: 30 ms a forward, 10 ms a row."""
    return 0.03 * -(-rows // 16) + 0.01 * rows


def test_calibration_prices_each_shape_at_its_steady_cost():
    """The first forward on a layout (threads created, moved) and a wide forward right after the
    other engine's call (its threads still spinning) are slower than the rounds the prices are
    for: an AR step runs the target alone. Calibrated, every curve has the steady costs."""
    from ssd.algorithm.cost_model import CostModel
    from ssd.decoding.calibration import calibrate

    model = CostModel()
    asyncio.run(calibrate(FakeEngines(steady_verify, lambda rows: 0.005 * rows), model, wide_threads=2,
                          max_batch=16, max_rows=17))
    assert {round(b[0]): round(b[1], 6) for b in model.target.buckets.values()} == {
        r: round(steady_verify(r), 6) for r in (1, 2, 4, 5, 9, 16, 17, 32)}
    # the wide layout: the batch sizes; one sequence's rows take the split curve's shape
    assert {round(b[0]): round(b[1], 6) for b in model.target_wide.buckets.values()} == {
        r: round(steady_verify(r), 6) for r in (1, 4, 16, 32)}
    assert abs(model.target_wide.along(model.target)(17) - steady_verify(17)) < 1e-9
    for curve in (model.drafter, model.drafter_wide):
        assert {round(b[0]): round(b[1], 6) for b in curve.buckets.values()} == {1: 0.005, 4: 0.02, 16: 0.08}


def test_one_sequences_verify_rows_price_a_lookup_round_from_the_measured_curve():
    """17 rows take a forward more than 16: measured, the longest lookup draft stops at 15 tokens
    (16 rows), where its extra token would cost a whole forward."""
    from ssd.algorithm.cost_model import CostModel
    from ssd.algorithm.lookup_estimate import LookupOutlook
    from ssd.decoding.calibration import calibrate

    model = CostModel()
    asyncio.run(calibrate(FakeEngines(steady_verify, lambda rows: 0.005 * rows), model, wide_threads=0,
                          max_batch=16, max_rows=17))
    assert abs(model.target(17) - steady_verify(17)) < 1e-9 and abs(model.target(9) - steady_verify(9)) < 1e-9
    sure = LookupOutlook(alpha=0.95, p_draft=1.0, length=16.0, k_max=16)
    assert model.lookup_k(1, sure, wide=False) == 15
    assert abs(model.rates(1, 4, 8, sure)["lookup"] - sure.tokens(15) / (model.t_lookup.value + steady_verify(16))) < 1e-9


def test_each_shape_keeps_its_fastest_pass():
    """Forwards slowed by a burst of load on the core must not become the curve: the shapes run
    in passes, each keeps its fastest run, and a shape whose runs disagree runs again, so a burst
    over the first pass is outrun."""
    from ssd.algorithm.cost_model import CostModel
    from ssd.decoding.calibration import calibrate

    class Bursty(FakeEngines):
        async def call_many(self, kind, calls):
            out = await super().call_many(kind, calls)
            if 2 <= len(self.calls) <= 3:  # a burst over the first pass: five times slower
                out = [SimpleNamespace(timing=[(n, 5 * s) for n, s in r.timing]) for r in out]
            return out

    engines = Bursty(lambda rows: 0.01, lambda rows: 0.002, first_touch=1.0, spinning=1.0)
    model = CostModel()
    asyncio.run(calibrate(engines, model, wide_threads=0, max_batch=1))
    # the warm-up, then two passes over 1 and 2 rows, whose runs disagree (5x): a third pass
    assert [rows for kind, _, rows in engines.calls if kind == "verify"] == [1] + [1, 2] * 3
    assert [round(b[1], 6) for b in model.target.buckets.values()] == [0.01, 0.01]  # 1 and 2 rows
    assert [round(b[1], 6) for b in model.drafter.buckets.values()] == [0.002]
