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
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ssd.config import ServerConfig
from ssd_tools.bench import llamacpp, report
from ssd_tools.bench.served import generate, start
from ssd_tools.prompts import load
from ssd_tools.serve import engines_by_role
from ssd_tools.triton_launcher import REPO


@dataclass
class Preset:
    datasets: str
    per_dataset: int  # greedy main table
    max_tokens: int
    sampled_datasets: str  # the temperature 0.7 table runs on the first prompt of each
    sampled_modes: tuple  # its modes (AR's rate is one forward a token at any temperature)
    sweep_datasets: str  # the sweeps run on the first prompt of each, at max_tokens
    sweeps: dict  # name -> list of per-request overrides
    inproc_datasets: str  # in-process twins of the greedy rows on the first prompt of each
    peer_k: str
    two_thread_datasets: str  # AR and SD at 2 threads and the peer run on the main prompts of these


# every SSD sweep point states all knobs, so the shared baseline (the shipped defaults) runs once
# step_aside off: these rows measure SSD itself; what the mode policy does under load is the
# Locust sweep's subject (loadtest/sweep.py)
# the server's shipped defaults (ssd.config.ServerConfig, what config.pbtxt leaves unchanged)
SSD_BASE = {name: getattr(ServerConfig(), name) for name in
            ("num_draft_tokens", "fanout_budget", "fanout_shape", "backup", "saguaro_c", "adaptive_k")} | {"step_aside": False}
# The main rows state the knobs the sweeps state, so a sweep point that equals a main-table row (same
# prompt, tokens and knobs: SSD budget 12, C 1.0 at temperature 0.7, SD K=4) is one measurement, not two
PIN = {"ssd": SSD_BASE, "sd": {"num_draft_tokens": SSD_BASE["num_draft_tokens"]}}
SWEEPS_FULL = {
    "k": [{"num_draft_tokens": k} for k in (3, 4, 5)],  # with adaptive_k: the most a round may draft
    "adaptive_k": [{"adaptive_k": a} for a in (False, True)],
    "sd_k": [{"mode": "sd", "num_draft_tokens": k} for k in (2, 3, 4, 5)],
    "shape": [{"fanout_shape": s} for s in ("uniform", "geometric")],
    "budget": [{"fanout_budget": b} for b in (5, 8, 12)],  # 12 is the most the A/Bs tried (README: the defaults)
    "backup": [{"backup": b} for b in ("neural", "fast", "auto")],
    "c": [{"saguaro_c": c, "temperature": 0.7} for c in (1.0, 0.5, 0.0)],
}
SWEEPS_QUICK = {"budget": [{"fanout_budget": b} for b in (5, 8, 12)],
                "c": [{"saguaro_c": c, "temperature": 0.7} for c in (1.0, 0.5)]}
# Sized for 2 cores on which an AR token takes ~0.4-1 s: quick's goal is 10 minutes, full's 60.
# - Both presets run their sweeps at the main table's length, on prompts of the main table, so a
#   sweep's baseline is a main row (PIN): budget 12 and C 1.0 (temperature 0.7) are measured once.
# - AR runs greedy only: its rate is one forward a token at any temperature (the temperature-0.7
#   table shows greedy AR, labelled so).
# - C = 0 rounds accept ~1 token (AR's pace, 1.6 min of a quick run): quick stops at 0.5.
# - quick sweeps and pairs the in-process runner on one prompt: ratios on one prompt are paired
#   ratios still; full does both on the first prompt of each dataset.
# - full: 64 tokens (128 would take about 95 minutes) and the peer at K = 2, its best measured K.
# - quick: 24 tokens, and the temperature-0.7 rows, the 2-thread rows and the peer on the HumanEval
#   prompt only (each ratio is taken over the prompts both sides ran: report.paired_ratio). About a
#   third of its time is fixed cost (two server starts and warm-ups, loading the peer).
ALL3 = "humaneval,gsm8k,mtbench"
PRESETS = {
    "quick": Preset("humaneval,gsm8k", 1, 24, "humaneval", ("sd", "ssd"), "humaneval", SWEEPS_QUICK, "humaneval", "2",
                    "humaneval"),
    "full": Preset(ALL3, 2, 64, ALL3, ("sd", "ssd"), "humaneval,gsm8k", SWEEPS_FULL, ALL3, "2", ALL3),
    # ours against the peers only: the greedy tables on one HumanEval prompt, no sweeps
    "peers": Preset("humaneval", 1, 64, "", (), "", {}, "", "2", "humaneval"),
}
# the warm-up's lengths: first-call allocations, and the policy's first records of SD and the SSD
# backups (AR's and SD's first calls allocate in 8 tokens, and requests that pin a mode ask the
# policy nothing; at ~1 s an AR token more would only cost time)
WARM_TOKENS = {"ar": 8, "sd": 8, "ssd": 32}


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
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 2**20


class PeakMemory(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.peak = max(self.peak, tree_rss_gb(self.pid))


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


def prompt_rows(datasets: list[str], n: int) -> list[dict]:
    """The first ``n`` prompts of each dataset, as job tags."""
    return [dict(dataset=ds, prompt=i, text=t) for ds in datasets for i, t in enumerate(load(ds, n))]


def first_prompts(rows: list[dict], datasets: str) -> list[dict]:
    """The first prompt of each of ``datasets`` (comma-separated) among the main table's ``rows``:
    where the sweeps, the in-process twins and the temperature-0.7 rows run, so they share the main
    rows' requests."""
    return [p for p in rows if p["prompt"] == 0 and p["dataset"] in datasets.split(",")]


def held_out_prompt(used: int) -> str:
    """A HumanEval prompt that no job measures (jobs use the first ``used``): the warm-up's."""
    return load("humaneval", used + 1)[-1]


def set_server_defaults(a, max_tokens: int) -> None:
    """The served model's defaults for the run: the shipped ones (SSD_BASE), greedy."""
    a.k, a.budget, a.c, a.backup = (SSD_BASE[k] for k in ("num_draft_tokens", "fanout_budget", "saguaro_c", "backup"))
    a.temperature, a.max_tokens = 0.0, max_tokens


def job_mode(tags: dict, extra: dict) -> str:
    return extra.get("mode", tags.get("mode", "ssd"))


def job_key(tags: dict, extra: dict, max_tokens: int) -> tuple:
    """What makes two served jobs the same request: prompt, mode and every knob, length included;
    a job tagged ``repeat`` is that request measured once more."""
    body = {"max_tokens": max_tokens, **{k: v for k, v in extra.items() if k != "mode"}}
    return tags["text"], job_mode(tags, extra), json.dumps(body, sort_keys=True), tags.get("repeat", 0)


def run_served(layout: str, jobs: list[tuple[dict, dict]], a, prog: Progress, warm_text: str,
               paired: Callable[[dict], dict | None] | None = None) -> list[dict]:
    """jobs: (tags, request overrides). One server for all of them, warmed up on ``warm_text``.
    ``paired(tags)``, if given, runs right after each served job (the in-process twin of a greedy
    one) while the server idles."""
    print(f"[bench] starting tritonserver ({layout} layout) ...", flush=True)
    srv = start(layout, a)
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
                generate(srv, warm_text, mode, a, **{**PIN.get(mode, {}), "max_tokens": WARM_TOKENS[mode]})
        for tags, extra in jobs:
            body = {k: v for k, v in extra.items() if k != "mode"}
            key = job_key(tags, extra, a.max_tokens)
            again = key in done  # the same request in two tables (a sweep's baseline): measured once
            if not again:
                done[key] = generate(srv, tags["text"], key[1], a, **body)
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
        mem.stop.set()
        PEAK_RSS[layout] = round(max(mem.peak, tree_rss_gb(srv.proc.pid)), 2)
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


def plan_split(pr: Preset, main_prompts: list[dict], sweep_prompts: list[dict]) -> list[tuple[dict, dict]]:
    """The split phase's served jobs, as (tags, request overrides): the greedy main table, the
    temperature 0.7 table and the sweeps. Some may be the same request (``job_key``)."""
    jobs = [({**p, "phase": "greedy", "mode": m}, {"mode": m, **PIN.get(m, {})})
            for p in main_prompts for m in ("ar", "sd", "ssd")]
    jobs += [({**p, "phase": "t0.7", "mode": m}, {"mode": m, **PIN.get(m, {}), "temperature": 0.7})
             for p in first_prompts(main_prompts, pr.sampled_datasets) for m in pr.sampled_modes]
    for name, variants in pr.sweeps.items():
        for v in variants:
            body = {**({} if v.get("mode") == "sd" else SSD_BASE), **v}
            jobs += [({**p, "phase": f"sweep:{name}", "mode": v.get("mode", "ssd")}, body) for p in sweep_prompts]
    # The SSD sweeps share one baseline, measured with the main table; measuring it again after the
    # sweeps shows how far one request's rate moves between two minutes of this machine (a slow
    # baseline would make every sweep "choose" a non-default), and a sweep's best then replaces the
    # shipped value only when it wins by more than that (report.sweeps). The C sweep's baseline, at
    # temperature 0.7, is repeated too: its spread also holds the luck of the sampled tokens.
    temps = {v.get("temperature", 0.0) for variants in pr.sweeps.values() for v in variants}
    for t in sorted(temps):
        jobs += [({**p, "phase": "repeat", "mode": "ssd", "repeat": 1}, {"mode": "ssd", **SSD_BASE,
                                                                         **({"temperature": t} if t else {})})
                 for p in sweep_prompts]
    return jobs


def sweep_defaults(pr: Preset) -> dict:
    """Each sweep's shipped value (what its points are compared with): the knob's value in the pinned rows."""
    out = {}
    for name, variants in pr.sweeps.items():
        knob = next(k for k in variants[0] if k not in ("mode", "temperature"))
        out[name] = PIN["sd" if variants[0].get("mode") == "sd" else "ssd"][knob]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=PRESETS, default="full")
    ap.add_argument("--phases", default="split,shared2,inproc,peer,llamacpp")
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
    roles = engines_by_role(a.config)
    tdir, ddir = a.engine_root / roles["target"], a.engine_root / roles["drafter"]
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
             + 2 * len(two_t) * ("llamacpp" in phases))
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
        if engine is None or tags.get("phase") != "greedy" or (tags["dataset"], tags["prompt"]) not in twins:
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
    raw["meta"] = {"preset": a.preset, "wall_s": round(time.time() - t0, 1), "max_tokens": pr.max_tokens,
                   "datasets": datasets, "per_dataset": pr.per_dataset, "peak_rss_gb": PEAK_RSS,
                   "sweep_defaults": sweep_defaults(pr)}
    (a.out / "raw.json").write_text(json.dumps(raw, indent=1))
    md = report.write(raw, a.out)
    print("\n" + md)
    print(f"[bench] done in {(time.time() - t0) / 60:.1f} min; report {a.out / 'report.md'}, plots in {a.out}")


if __name__ == "__main__":
    main()
