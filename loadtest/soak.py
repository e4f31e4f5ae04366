"""`make soak`: hours of mixed traffic in minutes, then the figures that say whether anything leaked.

Starts a server (the default pair, or --tiny: the CI engines) or uses --url, warms it, then runs
Locust headless with loadtest/soak_locustfile.py (ar / sd / ssd, streaming and whole, greedy and
sampled, client hang-ups and malformed requests) at --users for --minutes. Prints requests by
outcome, failures among the good requests, the resident memory of every server process at the
start and at the end, and the sequences the engines still hold once the traffic stopped. Exits 1
when a good request failed, a greedy output differed, or an engine kept a sequence.

  .venv/bin/python loadtest/soak.py --tiny --minutes 2 --users 4
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from ssd_loadtest.sweep import start_server
from ssd_tools.runner import locust_cmd, rss_kb, scrape, wait_idle, warm_up

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

GOOD_FAILURES = ("failed", "greedy_mismatch")


def processes(server_pid: int) -> dict[str, tuple[int, int]]:
    """{name: (pid, RSS bytes)} of tritonserver and its model processes (by instance name)."""
    from ssd.serving.supervisor import stub_instances

    out = {"tritonserver": (server_pid, rss_kb(server_pid) * 1024)}
    for model, pids in sorted(stub_instances(server_pid).items()):
        for i, pid in enumerate(sorted(pids)):
            out[model if len(pids) == 1 else f"{model}#{i}"] = (pid, rss_kb(pid) * 1024)
    return out


class MemorySampler(threading.Thread):
    """Every process's RSS every ``interval`` seconds while the traffic runs: the start and the end
    alone cannot tell caches filling up from a leak; the trend over the second half can."""

    def __init__(self, server_pid: int, interval: float):
        super().__init__(daemon=True)
        self.server_pid, self.interval = server_pid, interval
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._halt = threading.Event()
        self.t0 = time.time()

    def run(self) -> None:
        while True:
            try:
                self.samples.append((time.time() - self.t0, {n: rss for n, (_, rss) in processes(self.server_pid).items()}))
            except Exception:  # noqa: BLE001 - a process being reloaded: the next sample sees it
                pass
            if self._halt.wait(self.interval):
                return

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def second_half_slope(self, name: str) -> float | None:
        """MiB per minute over the second half of the run (least squares); None: too few samples."""
        pts = [(t, m[name]) for t, m in self.samples if name in m]
        pts = [p for p in pts if p[0] >= pts[-1][0] / 2] if pts else []
        if len(pts) < 3:
            return None
        mt, mr = sum(t for t, _ in pts) / len(pts), sum(r for _, r in pts) / len(pts)
        var = sum((t - mt) ** 2 for t, _ in pts)
        return sum((t - mt) * (r - mr) for t, r in pts) / var * 60 / 2**20 if var else None

    def plot(self, path: Path) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name in sorted({n for _, m in self.samples for n in m}):
            pts = [(t / 60, m[name] / 2**20) for t, m in self.samples if name in m]
            ax.plot(*zip(*pts), label=name)
        ax.set_xlabel("minutes")
        ax.set_ylabel("resident memory (MiB)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def engine_gauges(metrics_url: str, name: str) -> dict[str, float]:
    return {dict(labels).get("model", ""): v for (n, labels), v in scrape(metrics_url).items() if n == name}


def live_after_settle(metrics_url: str, timeout: float) -> dict[str, float]:
    """The engines' live sequences once every request has ended and its release went through."""
    wait_idle(metrics_url, timeout)
    deadline = time.time() + timeout
    live = engine_gauges(metrics_url, "ssd_engine_live_sequences")
    while any(live.values()) and time.time() < deadline:
        time.sleep(1)
        live = engine_gauges(metrics_url, "ssd_engine_live_sequences")
    return live


def report(outcomes: dict, errors: dict, mem0: dict, mem1: dict, live: dict, restarts: dict, minutes: float,
           slopes: dict | None = None) -> bool:
    good = sum(outcomes.get(k, 0) for k in ("ok", "ok_stream") + GOOD_FAILURES)
    bad_good = sum(outcomes.get(k, 0) for k in GOOD_FAILURES)
    print(f"\n[soak] {sum(outcomes.values())} requests in {minutes:g} min, by outcome:")
    for k, v in sorted(outcomes.items()):
        print(f"  {k:16s} {v}")
    print(f"[soak] failures among the {good} good requests: {bad_good}")
    for msg, n in errors.items():
        print(f"  {n} x {msg}")
    print("[soak] resident memory (MiB) start -> end, and its trend over the second half:")
    for name in sorted(set(mem0) | set(mem1)):
        a, b = mem0.get(name, (0, 0)), mem1.get(name, (0, 0))
        note = "" if a[0] == b[0] else f"  (pid {a[0]} -> {b[0]}: reloaded)"
        slope = (slopes or {}).get(name)
        trend = "" if slope is None else f", second half {slope:+.1f} MiB/min"
        print(f"  {name:18s} {a[1] / 2**20:8.1f} -> {b[1] / 2**20:8.1f}  ({(b[1] - a[1]) / 2**20:+.1f}{trend}){note}")
    print(f"[soak] sequences left in the engines: {json.dumps(live)} (total {sum(live.values()):.0f})")
    if restarts:
        print(f"[soak] engine restarts: {json.dumps(restarts)}")
    return bad_good == 0 and not any(live.values()) and good > 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start one here); memory needs --server-pid")
    ap.add_argument("--metrics-url", help="its Prometheus endpoint (default: same host, port 8002)")
    ap.add_argument("--server-pid", type=int, help="tritonserver's pid, for the memory figures with --url")
    ap.add_argument("--tiny", action="store_true", help="start a server on the CI engines (build/test_engines)")
    ap.add_argument("--config", type=Path, default=REPO / "engines/default.yaml")
    ap.add_argument("--engine-root", type=Path, default=REPO / "engines")
    ap.add_argument("--minutes", type=float, default=10.0)
    # the load sweep's throughput still rose at 16 users on 2 cores (docs/benchmarks.md)
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-active", type=int, default=64, help="max_active_requests of a server started here")
    ap.add_argument("--prompts-per-dataset", type=int, default=8)
    ap.add_argument("--settle", type=float, default=300.0, help="seconds to wait for the last requests to end")
    ap.add_argument("--sample-s", type=float, default=15.0, help="seconds between memory samples")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "soak")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    srv = None
    if a.url:
        url = a.url.rstrip("/")
        host = url.split("//", 1)[1].split(":")[0]
        metrics_url = a.metrics_url or f"http://{host}:8002/metrics"
        server_pid = a.server_pid
    else:
        srv, url, metrics_url = start_server(a)
        server_pid = srv.proc.pid
    ok = False
    try:
        warm_up(url, max_tokens=min(8, a.max_tokens))
        wait_idle(metrics_url)
        mem0 = processes(server_pid) if server_pid else {}
        restarts0 = engine_gauges(metrics_url, "ssd_engine_restarts_total")
        summary = a.out / "soak_summary.json"
        summary.unlink(missing_ok=True)
        env = dict(os.environ, SSD_SOAK_SUMMARY=str(summary), SSD_MAX_TOKENS=str(a.max_tokens),
                   SSD_PROMPTS_PER_DATASET=str(a.prompts_per_dataset))
        cmd = locust_cmd() + ["-f", str(HERE / "soak_locustfile.py"), "--headless",
                              "-u", str(a.users), "-r", str(a.users), "--run-time", f"{int(a.minutes * 60)}s",
                              "--stop-timeout", str(int(a.settle)), "--host", url, "--only-summary",
                              "--csv", str(a.out / "soak"), "SoakUser"]
        print(f"[soak] {a.users} users for {a.minutes:g} min against {url} ...", flush=True)
        sampler = MemorySampler(server_pid, a.sample_s) if server_pid else None
        if sampler:
            sampler.start()
        with open(a.out / "locust.log", "w") as log:
            subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
        slopes = {}
        if sampler:
            sampler.stop()
            slopes = {n: sampler.second_half_slope(n) for n in {n for _, m in sampler.samples for n in m}}
            sampler.plot(a.out / "soak_memory.png")
        data = json.loads(summary.read_text()) if summary.exists() else {"outcomes": {}, "errors": {}}
        live = live_after_settle(metrics_url, a.settle)
        mem1 = processes(server_pid) if server_pid else {}
        restarts1 = engine_gauges(metrics_url, "ssd_engine_restarts_total")
        restarts = {m: v - restarts0.get(m, 0.0) for m, v in restarts1.items() if v - restarts0.get(m, 0.0)}
        ok = report(data["outcomes"], data["errors"], mem0, mem1, live, restarts, a.minutes, slopes)
        (a.out / "soak_report.json").write_text(json.dumps({
            "outcomes": data["outcomes"], "errors": data["errors"], "live_sequences": live, "restarts": restarts,
            "rss_start": mem0, "rss_end": mem1, "users": a.users, "minutes": a.minutes, "passed": ok,
            "rss_second_half_mib_per_min": slopes, "rss_samples": sampler.samples if sampler else []}, indent=1))
    finally:
        if srv is not None:
            srv.stop()
    print(f"[soak] {'PASS' if ok else 'FAIL'} (details in {a.out})")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
