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
            "prompt": fam("ssd_prompt_tokens_total", "Prompt tokens of finished requests", C),
            "prompt_cached": fam("ssd_prompt_tokens_cached_total",
                                 "Prompt tokens whose KV the target already held (a kept prefix): not computed", C),
            "lookups": fam("ssd_cache_lookups_total", "Speculation cache lookups, by result", C),
            "backup": fam("ssd_backup_used_total", "Drafts made by a backup after a miss, by kind", C),
            "policy": fam("ssd_policy_decisions_total",
                          "Per-round decisions of the mode policy, by choice (ssd+neural, ssd+fast, sd, ar) and reason", C),
            "backup_policy": fam("ssd_backup_decisions_total", "Backup kind chosen after a cache miss, by kind and reason", C),
            "rate": fam("ssd_policy_predicted_tokens_per_s",
                        "Tokens/s per sequence the policy predicts for each choice at the current batch", G),
            "current": fam("ssd_policy_current_choice", "1 for the choice the policy currently runs", G),
            "active": fam("ssd_active_requests", "Requests currently decoding (the batch the policy plans for)", G),
            "queue": fam("ssd_rejected_busy_total", "Requests refused because the server was at capacity", C),
            "queued": fam("ssd_queued_requests",
                          "Requests waiting for a slot (max_active_requests), at most max_queued_requests", G),
            "klen": fam("ssd_draft_len_rounds_total", "Rounds that drafted k tokens (the policy's K per choice)", C),
            "bstar": fam("ssd_policy_b_star", "Smallest batch size at which the fast backup wins (0: never)", G),
            "restarts": fam("ssd_engine_restarts_total", "Engine models reloaded after their process died, by model", C),
            "restart_s": fam("ssd_engine_last_restart_seconds", "Seconds the last reload of an engine model took", G),
            "up": fam("ssd_engine_up", "1 while an engine model serves, 0 while it is down or reloading", G),
            "kv_reserved": fam("ssd_kv_reserved_tokens", "KV tokens reserved by admitted requests (see kv_budget_tokens)", G),
            "kv_waiting": fam("ssd_kv_waiting_requests", "Requests waiting for room in the KV budget", G),
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

    def engine_restarted(self, model: str, seconds: float) -> None:
        self._metric("restarts", model=model).increment(1)
        self._metric("restart_s", model=model).set(seconds)

    def engine_state(self, model: str, up: bool) -> None:
        self._metric("up", model=model).set(1.0 if up else 0.0)

    def kv_state(self, reserved: int, waiting: int) -> None:
        self._metric("kv_reserved").set(reserved)
        self._metric("kv_waiting").set(waiting)

    def queue_state(self, waiting: int) -> None:
        self._metric("queued").set(waiting)

    def busy(self) -> None:
        self._metric("queue").increment(1)

    def policy_state(self, current: str, rates: dict[str, float]) -> None:
        for choice, r in rates.items():
            self._metric("rate", choice=choice).set(r)
            self._metric("current", choice=choice).set(1.0 if choice == current else 0.0)

    def request_done(self, mode: str, status: str, stats: dict | None, b_star: int | None) -> None:
        self._metric("requests", mode=mode, status=status).increment(1)
        if not stats:
            return
        self._metric("tokens", mode=mode).increment(stats["new_tokens"])
        self._metric("rounds", mode=mode).increment(stats["rounds"])
        self._metric("prompt").increment(stats["prompt_tokens"])
        self._metric("prompt_cached").increment(stats["cached_prompt_tokens"])
        if stats["cache_hits"]:
            self._metric("lookups", result="hit").increment(stats["cache_hits"])
        if stats["cache_misses"]:
            self._metric("lookups", result="miss").increment(stats["cache_misses"])
        for kind, n in stats["backup_used"].items():
            self._metric("backup", kind=kind).increment(n)
        for key, n in stats["backup_reasons"].items():
            kind, _, reason = key.partition(": ")
            self._metric("backup_policy", kind=kind, reason=reason).increment(n)
        for key, n in stats["policy_decisions"].items():
            choice, _, reason = key.partition(": ")
            self._metric("policy", choice=choice, reason=reason).increment(n)
        for k, n in stats["draft_lens"].items():
            self._metric("klen", k=k).increment(n)
        if self._hist is not None:
            h = self._metric("hist", mode=mode)
            for a in stats["accepted_per_round"]:
                h.observe(a + 1)
        self._metric("bstar").set(b_star or 0)
