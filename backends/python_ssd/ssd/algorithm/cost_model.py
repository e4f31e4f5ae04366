"""How long one forward of an engine takes for a given number of rows, learned from the engines.

Every engine reports (rows, seconds) for each forward it runs: decode steps, verifies, tree steps,
and the drafter's prefills (the batch-invariant target leaves out forwards with a prefill, whose
rows run as one large GEMM and cost far less per row than decode rows in its tiles). On CPU (and
GPU) a forward is flat while it is bound by reading the weights and grows ~linearly once it is
bound by compute, so a piecewise-linear curve through per-bucket running means (buckets are powers
of two) is enough to compare modes that put different numbers of rows through the same engines.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class StepCost:
    alpha: float = 0.2  # weight of a new sample in its bucket's running mean
    # Rows a forward may hold and still cost what one row does, when nothing above the measured
    # ones is known: the weight-bound regime (on this CPU's bf16 GEMM it spans 2..32 rows; on a GPU
    # it is far wider, so this errs on the dear side there). Extrapolating linearly from a 2-row
    # forward priced a 5-row speculation tree at 2.5 steps before any SSD round had run, and the
    # policy kept SD at batch 1 where SSD runs 1.3x faster.
    flat_rows: int = 32
    buckets: dict[int, list[float]] = field(default_factory=dict)  # log2 bucket -> [mean rows, mean s, n]

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        key = int(round(math.log2(rows)))
        b = self.buckets.get(key)
        if b is None:
            self.buckets[key] = [float(rows), float(seconds), 1]
            return
        b[0] += self.alpha * (rows - b[0])
        b[1] += self.alpha * (seconds - b[1])
        b[2] += 1

    @property
    def known(self) -> bool:
        return bool(self.buckets)

    def __call__(self, rows: float) -> float:
        """Predicted seconds for one forward of ``rows`` rows (0 when nothing was measured yet)."""
        pts = sorted((r, s) for r, s, _ in self.buckets.values())
        if not pts or rows <= 0:
            return 0.0
        if rows <= pts[0][0]:
            return pts[0][1]  # below the smallest measured forward: weight-bound, flat
        for (r0, s0), (r1, s1) in zip(pts, pts[1:]):
            if rows <= r1:
                return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
        r, s = pts[-1]
        # beyond every measurement: flat up to flat_rows, then compute-bound (linear in rows)
        return s * max(1.0, rows / max(r, self.flat_rows))
