"""The engines' costs measured before the first decode (decoding/calibration.py), on the CI engines."""
from __future__ import annotations

import asyncio

from decoding_clients import local_client


def test_shapes_reach_the_largest_batch_and_a_verify():
    from ssd.decoding.calibration import shapes

    assert shapes(16) == [(1, 1), (4, 1), (16, 1), (16, 2)]
    assert shapes(1) == [(1, 1), (1, 2)]
    assert shapes(6) == [(1, 1), (4, 1), (6, 1), (6, 2)]


def test_calibration_measures_every_curve_at_the_batch_sizes_it_runs_and_frees_its_sequences(engines):
    from ssd.algorithm.cost_model import CostModel
    from ssd.decoding.calibration import calibrate

    client = local_client(engines, "strong")
    model = CostModel()
    assert not model.known
    measured = asyncio.run(calibrate(client, model, wide_threads=2, max_batch=4))
    assert model.known and measured > 0
    # target: 1, 4 and 8 rows (4 sequences x 2) on each layout; drafter: 1 and 4 rows
    for curve, rows in ((model.target, {1, 4, 8}), (model.target_wide, {1, 4, 8}),
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


def test_each_shape_keeps_its_faster_run():
    """A first forward slowed by a one-off (the other engine's threads still spinning) must not
    become the curve: each shape runs twice and the faster run is what the curve learns."""
    from types import SimpleNamespace

    from ssd.algorithm.cost_model import CostModel
    from ssd.decoding.calibration import calibrate

    class Client:
        def __init__(self):
            self.seen = set()

        async def call_many(self, kind, calls):
            rows = len(calls) * (len(calls[0].draft) + 1 if kind == "verify" else 1)
            seconds = 0.01 if (kind, rows) in self.seen else 0.05  # a shape's first run: five times slower
            self.seen.add((kind, rows))
            return [SimpleNamespace(timing=[(rows, seconds)]) for _ in calls]

        async def release_many(self, ids):
            pass

        async def release(self, seq):
            pass

    model = CostModel()
    asyncio.run(calibrate(Client(), model, wide_threads=0, max_batch=1))
    assert [round(b[1], 6) for b in model.target.buckets.values()] == [0.01, 0.01]  # 1 and 2 rows
    assert [round(b[1], 6) for b in model.drafter.buckets.values()] == [0.01]
