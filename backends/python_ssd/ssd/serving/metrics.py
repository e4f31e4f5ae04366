"""Prometheus metrics of the `ssd` model, served on Triton's metrics port (/metrics)."""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

ACCEPT_BUCKETS = [1, 2, 3, 4, 5, 6, 7, 8]


class Metrics:
    def __init__(self):
        C, G = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        fam = pb_utils.MetricFamily
        self._f = {
            "requests": fam("ssd_requests_total", "Generate requests finished, by mode and status", C),
            "tokens": fam("ssd_output_tokens_total", "Output tokens generated, by mode", C),
            "rounds": fam("ssd_rounds_total", "Decoding rounds (target verifies), by mode", C),
            "lookups": fam("ssd_cache_lookups_total", "Speculation cache lookups, by result", C),
            "backup": fam("ssd_backup_used_total", "Drafts made by a backup after a miss, by kind", C),
            "policy": fam("ssd_policy_decisions_total", "Backup policy decisions, by kind and reason", C),
            "active": fam("ssd_active_requests", "Requests currently decoding (the batch the policy plans for)", G),
            "queue": fam("ssd_rejected_busy_total", "Requests refused because the server was at capacity", C),
            "bstar": fam("ssd_policy_b_star", "Smallest batch size at which the fast backup wins (0: never)", G),
        }
        self._hist = None
        if hasattr(fam, "HISTOGRAM"):
            self._hist = fam("ssd_tokens_per_round", "Tokens produced per round (accepted + 1), by mode", fam.HISTOGRAM)
        self._m: dict = {}

    def _metric(self, name: str, **labels):
        key = (name, tuple(sorted(labels.items())))
        if key not in self._m:
            if name == "hist":
                self._m[key] = self._hist.Metric(labels=labels, buckets=ACCEPT_BUCKETS)
            else:
                self._m[key] = self._f[name].Metric(labels=labels)
        return self._m[key]

    def set_active(self, n: int) -> None:
        self._metric("active").set(n)

    def busy(self) -> None:
        self._metric("queue").increment(1)

    def request_done(self, mode: str, status: str, stats: dict | None, b_star: int | None) -> None:
        self._metric("requests", mode=mode, status=status).increment(1)
        if not stats:
            return
        self._metric("tokens", mode=mode).increment(stats["new_tokens"])
        self._metric("rounds", mode=mode).increment(stats["rounds"])
        if stats["cache_hits"]:
            self._metric("lookups", result="hit").increment(stats["cache_hits"])
        if stats["cache_misses"]:
            self._metric("lookups", result="miss").increment(stats["cache_misses"])
        for kind, n in stats["backup_used"].items():
            self._metric("backup", kind=kind).increment(n)
        for reason, n in stats["backup_reasons"].items():
            self._metric("policy", reason=reason).increment(n)
        if self._hist is not None:
            h = self._metric("hist", mode=mode)
            for a in stats["accepted_per_round"]:
                h.observe(a + 1)
        self._metric("bstar").set(b_star or 0)
