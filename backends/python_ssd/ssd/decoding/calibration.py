"""The engines' forward costs, measured once before the first request decodes.

The scheduler prices every choice from each engine's seconds per forward by rows (StepCost), on
the split layout and the wide one. Learned from rounds alone, a curve knows only the batch sizes
that have run: a server that has seen one request prices a 16-sequence verify by extrapolation,
and under a sudden load its first rounds pick from guesses (SSD rounds of several seconds at 16
users where an AR round takes half a second). So the first request first runs the shapes decoding
runs: b sequences of one row (AR and drafter steps) and of two rows (a verify), b up to the
server's largest batch, on each layout, and feeds their timings to the same curves the rounds feed.
Each shape runs twice and the faster run is kept: a single forward can be slowed severalfold by a
one-off (the other engine's threads still spinning after its call, a page fault), and a curve
that starts twice too slow keeps the scheduler off that layout until the bandit explores it.
The sequences are one token long, so no prefill is timed, and are released at once. Apart from
the curves, the drafter prefills one prompt of CATCH_UP_ROWS tokens on each layout: its seconds a
row price the catch-up a drafting choice pays after AR rounds (Scheduler.after_catch_up).
"""
from __future__ import annotations

import time

from ..algorithm.cost_model import CostModel
from ..algorithm.sampling import SamplingParams
from ..workers.protocol import DraftCall, VerifyCall

TOKEN = 100  # any id every vocabulary has; costs do not depend on it
REPEATS = 2  # runs of each shape; the fastest is kept
CATCH_UP_ROWS = 64  # a short prompt's rows: the drafter's prefill cost a row


def shapes(max_batch: int) -> list[tuple[int, int]]:
    """(sequences, rows each): 1, 4, 16, ... sequences below ``max_batch`` and ``max_batch`` itself
    at one row each (the cost curves interpolate between them), then ``max_batch`` at two rows (a
    verify's shape)."""
    out, b = [], 1
    while b < max_batch:
        out.append((b, 1))
        b *= 4
    out.append((max_batch, 1))
    out.append((max_batch, 2))
    return out


async def calibrate(client, model: CostModel, wide_threads: int, max_batch: int) -> int:
    """Runs each shape on the target (verify) and the drafter (draft) at the split layout and, where
    offered, the wide one; returns the number of forwards measured. ``client`` needs ``call_many``
    and ``release_many`` (the coalescer is bypassed: these calls are not a round of the batch)."""
    greedy = SamplingParams(temperature=0.0)
    measured = 0
    for threads in (0, wide_threads) if wide_threads > 0 else (0,):
        target, drafter = (model.target_wide, model.drafter_wide) if threads else (model.target, model.drafter)
        for b, rows in shapes(max(1, max_batch)):
            runs: dict[str, list] = {"verify": [], "draft": []}
            for rep in range(REPEATS):
                ids = [f"__calibrate_{threads}_{b}_{rows}_{rep}_{i}" for i in range(b)]
                try:
                    runs["verify"].append(await client.call_many("verify", [
                        VerifyCall(s, [TOKEN], [TOKEN] * (rows - 1), greedy, threads=threads) for s in ids]))
                    # drafter steps are one row a sequence; its tree rows are priced past the largest batch
                    if rows == 1:
                        runs["draft"].append(await client.call_many(
                            "draft", [DraftCall(s, [TOKEN], 1, greedy, threads=threads) for s in ids]))
                finally:
                    await client.release_many(ids)
            for curve, kind in ((target, "verify"), (drafter, "draft")):
                timings = [r[0].timing for r in runs[kind] if r and not isinstance(r[0], Exception)]
                for n, seconds in min(timings, key=lambda t: sum(s for _, s in t), default=[]):
                    curve.observe(n, seconds)
                    measured += 1
        seq = f"__calibrate_{threads}_catch_up"
        t0 = time.perf_counter()
        try:
            prefill = await client.call_many("draft", [DraftCall(seq, [TOKEN] * CATCH_UP_ROWS, 0, greedy,
                                                                 threads=threads)])
        finally:
            await client.release(seq)
        if prefill and not isinstance(prefill[0], Exception):
            model.catch_up_row_seconds[bool(threads)] = (time.perf_counter() - t0) / CATCH_UP_ROWS
            measured += 1
    return measured
