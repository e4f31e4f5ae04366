"""AR / SD / SSD on the engines alone, in one process, no Triton (run as a subprocess).

The same engines, workers and decoding loop as the server, with the engine parameters read from
model_repository/*/config.pbtxt, and the same placement: every target call runs on one thread pinned
to the target's core, every drafter / n-gram call on one pinned to the drafter's core (torch with one
intra-op thread computes on the calling thread). Served minus in-process is the cost of serving:
BLS round trips, JSON, the dynamic batcher, a second process. With ``--jobs-stdin`` the bench keeps
it running beside the idle server and sends each in-process job right after the same served one, so
the two are measured minutes, not half an hour, apart (this machine's step time drifts by up to 40%
over a run: a comparison of two phases measured the drift, not the serving).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ssd.algorithm.sampling import SamplingParams
from ssd.config import EngineConfig, ServerConfig
from ssd.decoding.generator import DecodeConfig, Generation, SharedState
from ssd.decoding.local_client import LocalClient
from ssd.serving.placement import parse_cores
from ssd.workers.factory import build_worker
from ssd.workers.fast_backup import NgramWorker

REPO = Path(__file__).resolve().parents[2]

_PARAM = re.compile(r'key:\s*"(\w+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"')


def model_params(model: str) -> dict[str, str]:
    return dict(_PARAM.findall((REPO / "model_repository" / model / "config.pbtxt").read_text()))


def load_worker(role: str, folder: Path, params: dict[str, str]):
    """The worker the served model builds (same runtime, knobs and checks), on one thread: the
    in-process rows measure the algorithm without Triton, not another engine."""
    return build_worker(EngineConfig.from_parameters({**params, "role": role, "threads": "1"}), str(folder))


class PinnedClient(LocalClient):
    """LocalClient whose target calls run on a thread pinned to one core, drafter calls on another."""

    def __init__(self, target, drafter, fast, target_core: int, drafter_core: int):
        super().__init__(target, drafter, fast)
        pin = lambda core: (lambda: os.sched_setaffinity(0, {core}))  # noqa: E731 - per-thread on Linux
        self._pools = {id(target): ThreadPoolExecutor(1, initializer=pin(target_core)),
                       id(drafter): ThreadPoolExecutor(1, initializer=pin(drafter_core)),
                       id(fast): ThreadPoolExecutor(1, initializer=pin(drafter_core))}

    async def _run(self, worker, method: str, calls: list) -> list:
        def run():
            return getattr(worker, method)(calls)
        return await asyncio.get_running_loop().run_in_executor(self._pools[id(worker)], run)


async def generate(client, shared, ids: list[int], mode: str, a) -> dict:
    """One generation of up to ``a.max_tokens`` tokens, with its statistics."""
    # step_aside off: SSD itself, as in the served rows of the bench
    cfg = DecodeConfig(mode=mode, k=a.k, fanout_budget=a.budget, saguaro_c=a.c, backup=a.backup, step_aside=False)
    g = Generation(client, f"{mode}-{time.monotonic_ns()}", list(ids), SamplingParams(a.temperature), 1, cfg, shared,
                   a.max_tokens)
    out, t0 = [], time.perf_counter()
    async for block in g.run():
        out += block
        if len(out) >= a.max_tokens or any(t in a.eos for t in block):
            break
    latency = time.perf_counter() - t0
    await client.release(g.seq_id)
    cut = next((i for i, t in enumerate(out) if t in a.eos), len(out))
    g.stats.new_tokens = min(cut, a.max_tokens)
    return {"ids": out[:g.stats.new_tokens], "latency_s": latency, **g.stats.to_dict()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--drafter", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, help="JSON: [{dataset, index, ids}]")
    ap.add_argument("--modes", default="ar,sd,ssd")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    defaults = ServerConfig()  # the served defaults, so in-process rows twin the served ones
    ap.add_argument("--k", type=int, default=defaults.num_draft_tokens)
    ap.add_argument("--budget", type=int, default=defaults.fanout_budget)
    ap.add_argument("--c", type=float, default=defaults.saguaro_c)
    ap.add_argument("--backup", default=defaults.backup)
    ap.add_argument("--ar-steps", type=int, default=defaults.ar_steps)
    ap.add_argument("--out", type=Path, help="run every prompt x mode, write the rows here (JSON)")
    ap.add_argument("--jobs-stdin", action="store_true",
                    help="instead: read jobs (JSON lines: dataset, index, ids, mode, optional max_tokens) from stdin and answer each "
                         "with its row as a JSON line on stdout, so a caller can interleave them with served runs")
    a = ap.parse_args()
    if not (a.out or a.jobs_stdin):
        ap.error("one of --out or --jobs-stdin is required")
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    target_params, drafter_params = model_params("target"), model_params("drafter_primary")
    target = load_worker("target", a.target, target_params)
    drafter = load_worker("drafter", a.drafter, drafter_params)
    a.eos = target.engine.eos_ids
    print(f"[in-process] engines loaded in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    client = PinnedClient(target, drafter, NgramWorker(), min(parse_cores(target_params["cores"]) or {0}),
                          min(parse_cores(drafter_params["cores"]) or {0}))
    shared = SharedState(ar_steps=a.ar_steps)
    prompts = json.loads(a.prompts.read_text()) if a.prompts else []
    warm = prompts[0]["ids"][:16] if prompts else [1, 2, 3, 4]  # first-call allocations

    def upto(n: int) -> argparse.Namespace:
        return argparse.Namespace(**{**vars(a), "max_tokens": n})

    asyncio.run(generate(client, shared, warm, "ssd", upto(4)))

    def run(p: dict, mode: str) -> dict:
        r = asyncio.run(generate(client, shared, p["ids"], mode, upto(p.get("max_tokens", a.max_tokens))))
        print(f"[in-process] {p['dataset']} #{p['index']} {mode}: {r['decode_tokens_per_s']:.2f} tok/s, "
              f"accept len {r['acceptance_length']:.2f}, p_hit {r['p_hit']:.2f}", file=sys.stderr, flush=True)
        return {"dataset": p["dataset"], "prompt": p["index"], "mode": mode, **r}

    if a.jobs_stdin:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if line.strip():
                job = json.loads(line)
                print(json.dumps(run(job, job["mode"])), flush=True)
        return
    a.out.write_text(json.dumps([run(p, mode) for p in prompts for mode in a.modes.split(",")]))


if __name__ == "__main__":
    main()
