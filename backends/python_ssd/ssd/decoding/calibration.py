"""The engines' forward costs, measured once before the first request decodes.

The scheduler prices every choice from each engine's seconds per forward by rows (StepCost), on
the split layout and the wide one. Learned from rounds alone, a curve knows only the batch sizes
that have run: a server that has seen one request prices a 16-sequence verify by extrapolation,
and under a sudden load its first rounds pick from guesses (SSD rounds of several seconds at 16
users where an AR round takes half a second). So the first request first runs the shapes decoding
runs and gives their timings to the curves as priors, which the rounds' own forwards replace
(StepCost.observe). The target: b sequences of one row (AR steps) and of two rows (a verify), b up
to the server's largest batch, on each layout, and on the split layout one sequence of the rows a
verify of K drafts takes, K + 1 up to the longest draft (a lookup's 32 rows at lookup_max_k 31):
llama.cpp runs a call's rows in forwards of up to its logit_rows (32, or 16 where the larger
forward's check fails), so a verify past them costs a forward more, a step no extrapolation
finds. The wide curve takes that shape from the split one (StepCost.along), which keeps the wide
layout's share of the warmup to the batch sizes. The drafter: b sequences of one row, on each
layout.

How a shape is timed decides whether its price holds:
- An engine's first forward on a layout pays what later ones do not (its OpenMP threads are
  created or moved to the layout's cores, buffers touched): one forward is run first and dropped.
- Each engine's shapes run with the other engine idle, as in the rounds that price them (AR, a
  lookup's verify): right after the other engine's call, a wide forward shares its cores with
  that engine's OpenMP threads still spinning down (libgomp spins after a parallel region), a
  cost no AR round pays.
- The shapes are run in passes and each keeps its fastest run: a forward is slowed, never sped up,
  by a one-off (a page fault, another process on the core), and passes apart in time keep one
  burst of load from slowing every run of a shape. A shape is run again, up to MAX_PASSES, until
  its two fastest runs agree within AGREE: on a quiet machine two passes, on a busy one as many as
  it takes to see the steady cost twice.
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
MIN_PASSES, MAX_PASSES = 2, 4  # runs of each shape; its fastest is kept
AGREE = 0.10  # a shape is settled once its two fastest runs are this close
CATCH_UP_ROWS = 64  # a short prompt's rows: the drafter's prefill cost a row


def batch_shapes(max_batch: int) -> list[tuple[int, int]]:
    """(sequences, rows each): 1, 4, 16, ... sequences below ``max_batch`` and ``max_batch`` itself
    at one row each (the cost curves interpolate between them)."""
    out, b = [], 1
    while b < max_batch:
        out.append((b, 1))
        b *= 4
    out.append((max_batch, 1))
    return out


def verify_rows(max_rows: int) -> list[int]:
    """One sequence's verify rows to measure: 2 and K + 1 for K = 4, 8, 16, ... below ``max_rows``,
    and ``max_rows`` itself (none below 2)."""
    if max_rows < 2:
        return []
    out, k = [2], 4
    while k + 1 < max_rows:
        out.append(k + 1)
        k *= 2
    return sorted(set(out + [max_rows]))


def target_shapes(max_batch: int, max_rows: int = 2) -> list[tuple[int, int]]:
    """The target's shapes: the batch sizes at one row, ``max_batch`` at two rows (a batch's
    verify) and one sequence at each of ``verify_rows(max_rows)`` (0: none)."""
    one = [(1, r) for r in verify_rows(max_rows)]
    return batch_shapes(max_batch) + [(max_batch, 2)] + [s for s in one if s != (max_batch, 2)]


async def calibrate(client, model: CostModel, wide_threads: int, max_batch: int, max_rows: int = 2,
                    trace=None) -> int:
    """Runs the target's shapes (verify) and then the drafter's (draft) at the split layout and,
    where offered, the wide one; returns the number of forwards measured. ``max_rows``: the most
    rows one sequence's verify takes; ``trace``: callable(dict) given every shape's runs.
    ``client`` needs ``call_many``, ``release_many`` and ``release`` (the coalescer is bypassed:
    these calls are not a round of the batch)."""
    greedy = SamplingParams(temperature=0.0)
    measured, t_start = 0, time.perf_counter()
    for threads in (0, wide_threads) if wide_threads > 0 else (0,):
        curves = {"verify": model.target_wide if threads else model.target,
                  "draft": model.drafter_wide if threads else model.drafter}
        for kind, shapes in (("verify", target_shapes(max(1, max_batch), 0 if threads else max_rows)),
                             ("draft", batch_shapes(max(1, max_batch)))):
            await _run(client, kind, threads, 1, 1, "warm", greedy)  # dropped: the layout's first forward
            runs: dict[tuple[int, int], list] = {s: [] for s in shapes}
            for rep in range(MAX_PASSES):
                todo = [s for s in shapes if rep < MIN_PASSES or not _settled(runs[s])]
                for b, rows in todo:
                    timing = await _run(client, kind, threads, b, rows, rep, greedy)
                    if timing:
                        runs[(b, rows)].append(timing)
            for (b, rows), timings in runs.items():
                if trace and timings:
                    trace({"ev": "calibrate", "threads": threads, "kind": kind, "batch": b, "rows": rows,
                           "runs": [[[n, round(s, 5)] for n, s in t] for t in timings]})
                for n, seconds in min(timings, key=lambda t: sum(s for _, s in t), default=[]):
                    curves[kind].observe(n, seconds, prior=True)
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
    if trace:
        trace({"ev": "calibrated", "forwards": measured, "s": round(time.perf_counter() - t_start, 3)})
    return measured


def _settled(timings: list) -> bool:
    """Whether a shape's two fastest runs agree within AGREE (or it has failed every run)."""
    if not timings:
        return True
    t = sorted(sum(s for _, s in run) for run in timings)
    return len(t) >= 2 and t[1] <= t[0] * (1 + AGREE)


async def _run(client, kind: str, threads: int, b: int, rows: int, rep, greedy) -> list | None:
    """One call of ``b`` new sequences of ``rows`` rows each on one engine; its forwards' timing
    (None if it failed). The sequences are released after."""
    ids = [f"__calibrate_{kind}_{threads}_{b}_{rows}_{rep}_{i}" for i in range(b)]
    try:
        if kind == "verify":
            out = await client.call_many("verify", [
                VerifyCall(s, [TOKEN], [TOKEN] * (rows - 1), greedy, threads=threads) for s in ids])
        else:  # drafter steps are one row a sequence; its tree rows are priced past the largest batch
            out = await client.call_many("draft", [DraftCall(s, [TOKEN], 1, greedy, threads=threads) for s in ids])
    finally:
        await client.release_many(ids)
    return out[0].timing if out and not isinstance(out[0], Exception) else None
