"""`make bench` / `make bench-quick`: the paper's comparison on this machine, in one run.

Phases (each prints progress and an ETA):
  split     served, target on core 0 + drafter on core 1, one thread each (the paper's protocol):
            AR, SD, SSD greedy; SD, SSD at temperature 0.7; the sweeps (K, fan-out shape and
            budget, backup, C) behind the shipped defaults (checked with ab.py)
  shared2   served, every engine on both cores with 2 threads: AR and SD (same hardware for everyone)
  inproc    the same engines without Triton (tools/bench/inprocess.py): the serving overhead; each
            greedy in-process job runs right after its served twin (split phase), same prompt, same cores
  peer      transformers assisted generation on the same pair, prompts and 2 cores (tools/bench/peer.py)
  llamacpp  llama.cpp's llama-server on the pair's GGUF files, same prompts and 2 cores: AR and its
            speculative decoding (tools/bench/llamacpp.py; builds llama-server once, cached in build/)
  bound     the engines' forwards at 1 and 2 threads, in-process: with the run's acceptance and hit
            rates, the most each choice can make at batch 1 (tools/bench/bound.py)
What each phase runs (presets, sweeps, jobs) is planned in plan.py; the servers, their warm-up
and memory come from ssd_tools.runner, shared with the load tests.
Outputs in --out (default results/bench/): raw.json, report.md (tables per dataset and overall,
correctness pass, sweeps, defaults), throughput.png, hit_rate_vs_budget.png,
ssd_over_sd_predicted_vs_measured.png, c_sweep.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from ssd_tools.bench import bound, llamacpp, report
from ssd_tools.bench.plan import (PIN, PRESETS, WARM_TOKENS, first_prompts, held_out_prompt, job_key, job_mode,
                                  plan_split, prompt_rows, set_server_defaults, sweep_defaults)
from ssd_tools.runner import PeakMemory, config_pair, generate, start_pair
from ssd_tools.triton_launcher import REPO


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.t0 = total, 0, time.time()

    def step(self, what: str) -> None:
        self.done += 1
        el = time.time() - self.t0
        eta = el / self.done * (self.total - self.done)
        print(f"[bench] {self.done}/{self.total} {what} | elapsed {el / 60:.1f} min, ETA {eta / 60:.1f} min",
              flush=True)


def served_row(d: dict, **tags) -> dict:
    s = d["stats"]
    keep = ("decode_tokens_per_s", "acceptance_length", "p_hit", "new_tokens", "speedup_predicted", "t_verify_ms",
            "t_p", "t_b", "t_sd_draft", "verify_forward_ms", "verify_outside_forward_ms", "backup_used", "e_hit",
            "e_miss", "rounds_by_choice", "prefill_s", "draft_lens")
    return {**tags, "ids": d["output_ids"] if isinstance(d["output_ids"], list) else [d["output_ids"]],
            "latency_s": d["latency_s"], **{k: s.get(k) for k in keep}}


PEAK_RSS: dict[str, float] = {}


class InProcess:
    """tools/bench/inprocess.py kept running (engines loaded once), answering one job at a time."""

    def __init__(self, tdir: Path, ddir: Path, max_tokens: int, warm_ids: list[int]):
        # it loads while tritonserver starts (both mostly read weights): the first job waits for it
        print("[bench] in-process: loading the engines (tools/bench/inprocess.py --jobs-stdin) ...", flush=True)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "inprocess.py"), "--target", str(tdir),
                                      "--drafter", str(ddir), "--max-tokens", str(max_tokens), "--jobs-stdin"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready, self.warm_ids = False, warm_ids

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"[bench] inprocess.py exited (code {self.proc.wait()})")
        return json.loads(line)

    def run(self, dataset: str, index: int, ids: list[int], mode: str) -> dict:
        if not self.ready:
            self.ready = self._read()["ready"]  # {"ready": true} once loaded (first-call allocations done)
            # the served SSD warm-up in-process too, so the scheduler starts from the same records
            # in both: without it the in-process SSD rows pay for exploring choices the served
            # server explored in its warm-up. AR and SD requests do not consult the scheduler.
            self._job({"dataset": "warm-up", "index": -1, "ids": self.warm_ids, "mode": "ssd",
                       "max_tokens": WARM_TOKENS["ssd"]})
        return self._job({"dataset": dataset, "index": index, "ids": ids, "mode": mode})

    def _job(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def served_generate(url: str, prompt: str, mode: str, a, **extra) -> dict:
    """One request with the run's length and temperature (``set_server_defaults``), seeded."""
    return generate(url, {"text_input": prompt, "max_tokens": a.max_tokens, "mode": mode, "temperature": a.temperature,
                          "seed": 1, **extra})


def run_served(layout: str, jobs: list[tuple[dict, dict]], a, prog: Progress, warm_text: str,
               paired: Callable[[dict], dict | None] | None = None) -> list[dict]:
    """jobs: (tags, request overrides). One server for all of them, warmed up on ``warm_text``.
    ``paired(tags)``, if given, runs right after each served job (the in-process twin of a greedy
    one) while the server idles."""
    srv = start_pair(config_pair(a.config, a.engine_root), f"bench_{layout}", layout,
                     {"num_draft_tokens": a.k, "fanout_budget": a.budget, "saguaro_c": a.c, "backup": a.backup,
                      "max_active_requests": 4})
    url = f"http://{srv.http_url}"
    mem = PeakMemory(srv.proc.pid)
    mem.start()
    rows, done = [], {}
    try:
        # warm-up: first-call allocations, and the mode policy's first measurements of every choice,
        # on a prompt of the benchmark's kind that is not measured (a haiku, drafted at 1-2 tokens
        # a round, gave the policy a first record unlike any measured prompt: see The mode policy)
        modes = {job_mode(tags, extra) for tags, extra in jobs}
        for mode in ("ar", "sd", "ssd"):
            if mode in modes:
                served_generate(url, warm_text, mode, a, **{**PIN.get(mode, {}), "max_tokens": WARM_TOKENS[mode]})
        if any(tags.get("mode") == "default" for tags, _ in jobs):  # the scheduler's first records of each choice
            served_generate(url, warm_text, "ssd", a, max_tokens=2 * WARM_TOKENS["ssd"])
        for tags, extra in jobs:
            body = {k: v for k, v in extra.items() if k != "mode"}
            key = job_key(tags, extra, a.max_tokens)
            again = key in done  # the same request in two tables (a sweep's baseline): measured once
            if not again:
                done[key] = served_generate(url, tags["text"], key[1], a, **body)
            row = served_row(done[key], **{k: v for k, v in tags.items() if k != "text"}, layout=layout, **body)
            rows.append(row)
            what = (f"{layout} {row.get('phase')} {row.get('dataset')} #{row.get('prompt')} {row.get('mode')} "
                    f"{body or ''}: {row['decode_tokens_per_s']:.2f} tok/s, accept {row['acceptance_length']:.2f}, "
                    f"p_hit {row['p_hit']:.2f}")
            if again:
                print(f"[bench] (the same request as above) {what}", flush=True)
            else:
                prog.step(what)
            if paired is not None and paired(tags) is not None:
                prog.step(f"in-process {tags['dataset']} #{tags['prompt']} {tags['mode']}")
    finally:
        PEAK_RSS[layout] = round(mem.finish(), 2)
        srv.stop()
    print(f"[bench] {layout}: peak resident memory of the server {PEAK_RSS[layout]:.1f} GB", flush=True)
    return rows


def run_subprocess(script: str, args: list[str], out: Path, n: int, prog: Progress, label: str) -> list[dict]:
    print(f"[bench] {label}: {script} {' '.join(args)}", flush=True)
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / script), *args, "--out", str(out)],
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        line = line.rstrip()
        print(line, flush=True)
        if " tok/s" in line:
            prog.step(label)
    if proc.wait() != 0:
        raise SystemExit(f"[bench] {script} failed (exit {proc.returncode})")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=PRESETS, default="full")
    ap.add_argument("--phases", default="split,shared2,inproc,peer,llamacpp,bound")
    ap.add_argument("--config", type=Path, default=REPO / "engines/default.yaml")
    ap.add_argument("--engine-root", type=Path, default=REPO / "engines")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench")
    ap.add_argument("--max-tokens", type=int, help="new tokens a request (default: the preset's)")
    a = ap.parse_args()
    pr = PRESETS[a.preset]
    if a.max_tokens:
        pr = dataclasses.replace(pr, max_tokens=a.max_tokens)
    set_server_defaults(a, pr.max_tokens)
    a.out.mkdir(parents=True, exist_ok=True)
    pair = config_pair(a.config, a.engine_root)
    tdir, ddir = a.engine_root / pair.target, a.engine_root / pair.drafter
    from ssd.decoding.text import TextCodec
    codec = TextCodec(tdir)
    datasets = pr.datasets.split(",")
    main_prompts = prompt_rows(datasets, pr.per_dataset)
    sweep_prompts = first_prompts(main_prompts, pr.sweep_datasets)
    inproc = first_prompts(main_prompts, pr.inproc_datasets)
    warm_text = held_out_prompt(pr.per_dataset)
    phases = a.phases.split(",")

    split_jobs = plan_split(pr, main_prompts, sweep_prompts)
    two_t = [p for p in main_prompts if p["dataset"] in pr.two_thread_datasets.split(",")]
    shared_jobs = [({**p, "phase": "greedy", "mode": m}, {"mode": m}) for p in two_t for m in ("ar", "sd")]
    n_peer = len(two_t) * len(pr.peer_k.split(","))
    n_split = len({job_key(t, b, pr.max_tokens) for t, b in split_jobs})
    total = (n_split * ("split" in phases) + len(shared_jobs) * ("shared2" in phases)
             + 3 * len(inproc) * ("inproc" in phases) + n_peer * ("peer" in phases)
             + 2 * len(two_t) * ("llamacpp" in phases) + ("bound" in phases))
    prog = Progress(total)
    print(f"[bench] preset {a.preset}: {total} generations in phases {phases}", flush=True)
    t0 = time.time()
    raw: dict[str, list] = {}
    # In-process twins of the greedy served jobs on the inproc prompts, each run right after its served
    # job (the server idles meanwhile; both fit in memory): served / in-process then compares the same
    # prompt minutes apart instead of two phases half an hour apart on a machine whose speed drifts.
    twins = {(p["dataset"], p["prompt"]) for p in inproc}
    inproc_rows: list[dict] = []
    engine = InProcess(tdir, ddir, pr.max_tokens, codec.encode_prompt(warm_text)) if "inproc" in phases else None

    def twin(tags: dict) -> dict | None:
        if (engine is None or tags.get("phase") != "greedy" or tags["mode"] not in ("ar", "sd", "ssd")
                or (tags["dataset"], tags["prompt"]) not in twins):
            return None
        inproc_rows.append(engine.run(tags["dataset"], tags["prompt"], codec.encode_prompt(tags["text"]),
                                      tags["mode"]))
        return inproc_rows[-1]

    if "split" in phases:
        raw["split"] = run_served("split", split_jobs, a, prog, warm_text, paired=twin)
    elif engine is not None:  # no served phase to pair with: the in-process runs alone
        for p in inproc:
            for m in ("ar", "sd", "ssd"):
                twin({**p, "phase": "greedy", "mode": m})
                prog.step(f"in-process {p['dataset']} #{p['prompt']} {m}")
    if engine is not None:
        engine.close()
        raw["inproc"] = inproc_rows
        (a.out / "inproc.json").write_text(json.dumps(inproc_rows))
    if "shared2" in phases:
        raw["shared2"] = run_served("shared2", shared_jobs, a, prog, warm_text)
    ids_file = a.out / "prompt_ids.json"
    ids_file.write_text(json.dumps([{"dataset": p["dataset"], "index": p["prompt"], "ids": codec.encode_prompt(p["text"])}
                                    for p in two_t]))
    if "peer" in phases:
        raw["peer"] = run_subprocess("peer.py", ["--target", str(tdir), "--drafter", str(ddir), "--prompts",
                                                 str(ids_file), "--max-tokens", str(pr.max_tokens), "--k", pr.peer_k,
                                                 "--modes", "assisted", "--cores", "0,1", "--threads", "2"],
                                     a.out / "peer.json", n_peer, prog, "peer")
    if "llamacpp" in phases:
        raw["llamacpp"] = llamacpp.bench_phase(
            a.config, a.engine_root, json.loads(ids_file.read_text()), pr.max_tokens, codec.encode_prompt(warm_text),
            a.out, on_row=lambda r: prog.step(f"llama.cpp {r['dataset']} #{r['prompt']} {r['mode']}: "
                                              f"{r['decode_tokens_per_s']:.2f} tok/s"))
    if "bound" in phases:
        raw["bound"] = bound.measure(a.engine_root, pair.target, pair.drafter)
        prog.step("bound: the engines' forwards at 1 and 2 threads")
    raw["meta"] = {"preset": a.preset, "wall_s": round(time.time() - t0, 1), "max_tokens": pr.max_tokens,
                   "datasets": datasets, "per_dataset": pr.per_dataset, "peak_rss_gb": PEAK_RSS,
                   "sweep_defaults": sweep_defaults(pr)}
    (a.out / "raw.json").write_text(json.dumps(raw, indent=1))
    md = report.write(raw, a.out)
    print("\n" + md)
    print(f"[bench] done in {(time.time() - t0) / 60:.1f} min; report {a.out / 'report.md'}, plots in {a.out}")


if __name__ == "__main__":
    main()
