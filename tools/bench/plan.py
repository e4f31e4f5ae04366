"""What the bench measures: the presets (prompts, lengths, sweeps), the shipped knobs every row
states, and the served jobs of each phase (tools/bench/run.py runs them)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from ssd.config import ServerConfig
from ssd_tools.prompts import ALL, load


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
PRESETS = {
    "quick": Preset("humaneval,gsm8k", 1, 24, "humaneval", ("sd", "ssd"), "humaneval", SWEEPS_QUICK, "humaneval", "2",
                    "humaneval"),
    "full": Preset(ALL, 2, 64, ALL, ("sd", "ssd"), "humaneval,gsm8k", SWEEPS_FULL, ALL, "2", ALL),
    # ours against the peers only: the greedy tables on one HumanEval prompt, no sweeps
    "peers": Preset("humaneval", 1, 64, "", (), "", {}, "", "2", "humaneval"),
}
# the warm-up's lengths: first-call allocations, and the policy's first records of SD and the SSD
# backups (AR's and SD's first calls allocate in 8 tokens, and requests that pin a mode ask the
# policy nothing; at ~1 s an AR token more would only cost time)
WARM_TOKENS = {"ar": 8, "sd": 8, "ssd": 32}


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


def plan_split(pr: Preset, main_prompts: list[dict], sweep_prompts: list[dict]) -> list[tuple[dict, dict]]:
    """The split phase's served jobs, as (tags, request overrides): the greedy main table, the
    temperature 0.7 table and the sweeps. Some may be the same request (``job_key``)."""
    jobs = [({**p, "phase": "greedy", "mode": m}, {"mode": m, **PIN.get(m, {})})
            for p in main_prompts for m in ("ar", "sd", "ssd")]
    # the served default: a plain request, every knob the server's, the scheduler choosing each round
    jobs += [({**p, "phase": "greedy", "mode": "default"}, {"mode": "ssd"}) for p in main_prompts]
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
