"""What the bench (tools/bench/) and the load tests (loadtest/) share: a served pair started here,
requests to it, its Prometheus figures and its memory.

A pair is a target and a drafter engine under one engine root: the engines/*.yaml profile's
(``config_pair``) or the CI engines (``tiny_pair``). ``start_pair`` renders the model repository
for a core layout, starts tritonserver and returns it once every model is READY:
  split    target on core 0, drafter on core 1, one thread each (the paper's one-device-per-model)
  shared2  every engine with 2 threads on both cores (same hardware for everyone)
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from ssd_tools.serve import engines_by_role
from ssd_tools.triton_launcher import REPO, TritonServer, render_repository

LAYOUTS = {"split": ("0", "1", "1"), "shared2": ("0,1", "0,1", "2")}  # target cores, drafter cores, threads
TINY_TARGET = "smollm2-135m"


@dataclass(frozen=True)
class Pair:
    engine_root: Path
    target: str
    drafter: str
    target_dtype: str | None = None  # None: the engine's own
    drafter_dtype: str | None = None


def config_pair(config: Path, engine_root: Path) -> Pair:
    roles = engines_by_role(config)
    return Pair(engine_root, roles["target"], roles["drafter"])


def tiny_pair() -> Pair:
    """The CI engines (build/test_engines, built here when missing): smollm2-135m in fp32 as the
    target and the same weights in bf16 as the drafter."""
    from ssd_tools.build_engines import build

    root = REPO / "build" / "test_engines"
    build(REPO / "engines" / "tiny.yaml", root, REPO / "engines" / ".cache")  # a no-op when built
    return Pair(root, TINY_TARGET, TINY_TARGET, "float32", "bfloat16")


def ssd_params(items: list[str]) -> dict[str, str]:
    """``--param NAME=VALUE`` items (parameters of the ``ssd`` model, ServerConfig) as a dict."""
    params = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--param: expected NAME=VALUE (a parameter of the ssd model), got {item!r}")
        params[name] = value
    return params


def start_pair(pair: Pair, name: str, layout: str = "split", ssd: dict | None = None,
               timeout: float = 900) -> TritonServer:
    """tritonserver on ``pair`` in ``layout``, the ``ssd`` model's parameters overridden by ``ssd``;
    its repository and log are build/<name>_repo and build/<name>_server.log."""
    tcores, dcores, threads = LAYOUTS[layout]
    target = {"engine": pair.target, "cores": tcores, "threads": threads}
    drafter = {"engine": pair.drafter, "cores": dcores, "threads": threads}
    for params, dtype in ((target, pair.target_dtype), (drafter, pair.drafter_dtype)):
        if dtype:
            params["dtype"] = dtype
    repo = render_repository(REPO / "build" / f"{name}_repo", {
        "ssd": {"tokenizer": pair.target, **{k: str(v) for k, v in (ssd or {}).items()}},
        "target": target, "drafter_primary": drafter, "drafter_backup": {"cores": dcores}})
    srv = TritonServer(repo, pair.engine_root, log_file=REPO / "build" / f"{name}_server.log")
    print(f"[{name}] starting tritonserver ({layout} layout, {pair.engine_root}; log {srv.log_file}) ...", flush=True)
    t0 = time.time()
    srv.start(timeout=timeout)
    print(f"[{name}] ready in {time.time() - t0:.0f} s on http://{srv.http_url}", flush=True)
    return srv


# -- requests ---------------------------------------------------------------------------------------------
def generate(url: str, body: dict, timeout: float = 1800) -> dict:
    """One request to the `ssd` model's generate endpoint at ``url`` (http://host:port): its JSON,
    ``stats`` parsed, plus ``latency_s``."""
    req = urllib.request.Request(f"{url}/v2/models/ssd/generate", data=json.dumps(body).encode())
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        d = json.loads(r.read())
    if isinstance(d.get("stats"), str):
        d["stats"] = json.loads(d["stats"])
    d["latency_s"] = time.perf_counter() - t0
    return d


def warm_up(url: str, modes=("ar", "sd", "ssd"), max_tokens: int = 8) -> None:
    """A short greedy request per mode: first-call allocations before anything is measured."""
    for mode in modes:
        generate(url, {"text_input": "Say hi.", "max_tokens": max_tokens, "mode": mode, "temperature": 0.0},
                 timeout=900)


def locust_cmd() -> list[str]:
    exe = Path(sys.executable).parent / "locust"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "locust"]


# -- Prometheus -------------------------------------------------------------------------------------------
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for line in text.splitlines():
        if not line.startswith("ssd_"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        try:
            out[(name, frozenset(_LABEL.findall(labels)))] = float(value)
        except ValueError:
            pass
    return out


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return parse_metrics(r.read().decode())


def wait_idle(metrics_url: str, timeout: float = 180.0) -> dict:
    """The server's metrics once no request is decoding (or after ``timeout``, with a warning)."""
    deadline = time.time() + timeout
    while True:
        m = scrape(metrics_url)
        active = sum(v for (n, _), v in m.items() if n == "ssd_active_requests")
        if active == 0 or time.time() > deadline:
            if active:
                print(f"[runner] warning: {active:.0f} requests still active on the server", flush=True)
            return m
        time.sleep(0.5)


# -- memory -----------------------------------------------------------------------------------------------
def rss_kb(pid: int) -> int:
    """Resident memory of one process (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_gb(root: int) -> float:
    """Resident memory of a process and all its descendants (tritonserver + its Python stubs)."""
    children: dict[int, list[int]] = defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children[int(fields[1])].append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        total += rss_kb(pid)
    return total / 2**20


class PeakMemory(threading.Thread):
    """Samples ``tree_rss_gb(pid)`` once a second; ``finish()`` stops and returns the peak."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.peak = max(self.peak, tree_rss_gb(self.pid))

    def finish(self) -> float:
        self.stop.set()
        return max(self.peak, tree_rss_gb(self.pid))
