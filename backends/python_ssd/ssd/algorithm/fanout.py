"""How many outcomes (k, t*) to pre-draft at each accepted length k: the fan-out F_0..F_K.

The accepted length is modelled as a capped geometric with per-token acceptance a; the chance that
the cache misses t* at a depth with fan-out F as F^-r. Minimising the expected miss rate under a
budget B = sum F_k gives F_k ~ a^(k/(1+r)) for k < K and F_K ~ a^(K/(1+r)) (1-a)^(-1/(1+r))
(SSD paper, section 4). r is fitted online from the cache's lookups; a is the cost model's
acceptance of the drafter's drafts, read at each allocation (one estimate of one quantity).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable


def _largest_remainder(weights: list[float], budget: int) -> list[int]:
    # every depth keeps at least one candidate: a depth with F = 0 misses for sure
    n = len(weights)
    budget = max(budget, n)
    total = sum(weights)
    raw = [1 + (budget - n) * w / total for w in weights]
    out = [int(math.floor(x)) for x in raw]
    rest = budget - sum(out)
    order = sorted(range(n), key=lambda i: raw[i] - out[i], reverse=True)
    for i in order[:rest]:
        out[i] += 1
    return out


def uniform_fanout(k: int, budget: int) -> list[int]:
    return _largest_remainder([1.0] * (k + 1), budget)


def geometric_fanout(k: int, budget: int, a: float, r: float) -> list[int]:
    a = min(max(a, 0.05), 0.98)
    r = max(r, 0.05)
    w = [a ** (i / (1 + r)) for i in range(k)]
    w.append(a ** (k / (1 + r)) * (1 - a) ** (-1 / (1 + r)))
    return _largest_remainder(w, budget)


def _prior_a() -> float:
    return 0.8


@dataclass
class FanoutEstimator:
    """The fan-out's two parameters: a (per-token acceptance) and r (miss exponent).

    a: ``acceptance()``, the estimate the cost model keeps (``CostModel.drafter_alpha``); the prior
       when the estimator stands alone.
    r: least squares of log(miss rate) on log(F) over the fan-outs seen (kept per F value).
    """

    acceptance: Callable[[], float] = _prior_a
    prior_r: float = 1.0
    by_fanout: dict[int, list[int]] = field(default_factory=dict)  # F -> [misses, trials]

    def record_lookup(self, fanout: int, hit: bool) -> None:
        m = self.by_fanout.setdefault(fanout, [0, 0])
        m[0] += int(not hit)
        m[1] += 1

    @property
    def a(self) -> float:
        return self.acceptance()

    @property
    def r(self) -> float:
        pts = [(math.log(f), math.log(max(m, 0.5) / t)) for f, (m, t) in self.by_fanout.items() if t >= 8 and f >= 1]
        if len(pts) < 2:
            return self.prior_r
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        if sxx == 0:
            return self.prior_r
        slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
        return min(max(-slope, 0.05), 5.0)


def allocate(shape: str, k: int, budget: int, est: FanoutEstimator | None = None) -> list[int]:
    if shape == "uniform" or est is None:
        return uniform_fanout(k, budget)
    if shape == "geometric":
        return geometric_fanout(k, budget, est.a, est.r)
    raise ValueError(f"unknown fanout shape {shape!r} (expected 'uniform' or 'geometric')")
