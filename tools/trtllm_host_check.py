#!/usr/bin/env python3
"""The TensorRT-LLM path end to end on your own GPU host, inside NGC's tritonserver
trtllm-python-py3 image (26.04: TensorRT-LLM 1.2.1), with the image of deploy/k8s/ or this
repository installed there. What CI can only check against stand-ins, this checks for real:

1. Builds the CI's tiny pair (engines/tiny.yaml: SmolLM2-135M) with `build_engines.sh --backend
   tensorrt_llm` and a one-GPU deployment spec written here (deploy/gpu_trtllm_backend.yaml with
   every model on GPU 0), a few minutes.
2. The executor in process (engine/trtllm_engine.py): a verify of the target's own greedy tokens is
   answered with accepted = K plus the next token; a draft wrong at position 2 with (2, the
   target's token); sampled verification with one-hot fp32 draft logits of the greedy draft at a
   low temperature accepts it; a prompt over max_input_len is refused before enqueue (ValueError
   naming max_input_len) and, sent anyway, answered by the executor with an error response.
3. Through tritonserver with the target and the SD drafter on Triton's TensorRT-LLM backend (the
   rendered spec; the drafter model serves the target's engine, so greedy drafts are the target's
   own tokens): greedy SD and SSD output equal AR token for token, for three prompts, and SD
   accepts drafts. Then the drafter model directly, with the backend's tensors over the generate
   endpoint: a greedy draft of K tokens is the first K tokens of the AR output; a sampled draft
   comes back with fp32 generation logits, one row of the engine's vocabulary per token; a prompt
   over the engine's max_input_len gets an error response.

Writes a JSON report (``--out``); exit status 1 when a check fails. ``--dry-run`` writes the spec
and the model repository and prints the build plan, nothing else (what CI runs).
    python3 tools/trtllm_host_check.py --out host_check.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m"
PROMPTS = ["Write a Python function that returns the factorial of n.", "List three prime numbers.",
           "def fibonacci(n):"]


def log(msg: str) -> None:
    print(f"[host-check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def one_gpu_spec(engine_root: Path, vocab: int) -> dict:
    """deploy/gpu_trtllm_backend.yaml with every model on GPU 0 and the tiny pair's engines."""
    spec = yaml.safe_load((REPO / "deploy/gpu_trtllm_backend.yaml").read_text())
    spec["name"], spec["engine_root"] = "host-check", str(engine_root)
    models = spec["models"]

    def setp(model: str, key: str, value: str) -> None:
        items = models[model]["parameters"]
        for item in items:
            if isinstance(item, dict) and key in item:
                item[key] = value
                return
        items.append({key: value})

    for key, value in (("tokenizer", TARGET), ("max_active_requests", "8"), ("target_vocab_size", str(vocab)),
                       ("max_seq_len", "2048"), ("max_tokens_limit", "1024")):
        setp("ssd", key, value)
    models["target"]["gpus"] = [0]
    setp("target", "engine", TARGET)
    setp("target", "kv_cache_free_gpu_mem_fraction", "0.3")
    models["drafter_trtllm"]["gpus"] = [0]
    setp("drafter_trtllm", "engine", TARGET)  # the tiny profile builds one engine: drafts are the target's own
    setp("drafter_trtllm", "kv_cache_free_gpu_mem_fraction", "0.2")
    models["drafter_primary"]["gpus"] = [0]
    for key, value in (("engine", TARGET), ("max_sequences", "8"), ("static_kv_len", "2048")):
        setp("drafter_primary", key, value)
    return spec


def build(spec_path: Path, engine_root: Path, dry_run: bool) -> None:
    cmd = ["bash", "build_engines.sh", "--backend", "tensorrt_llm", "--config", "engines/tiny.yaml",
           "--out", str(engine_root), "--spec", str(spec_path)] + (["--dry-run"] if dry_run else [])
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, cwd=REPO, check=True)


def executor_checks(engine_root: Path, k: int = 4) -> dict:
    import datetime

    from ssd.algorithm.sampling import SamplingParams
    from ssd.decoding.text import TextCodec
    from ssd.engine.meta import trtllm_engine_dir
    from ssd.engine.trtllm_engine import TrtllmEngine

    engine = TrtllmEngine(trtllm_engine_dir(engine_root / TARGET), device_ids=[0])
    prompt = TextCodec(engine_root / TARGET).encode_prompt(PROMPTS[0])
    greedy, seq, ar = SamplingParams(), list(prompt), []
    for _ in range(k + 1):  # the target's own greedy tokens, one AR verify at a time
        _, token = engine.verify_external("ar", seq, [], greedy)
        ar.append(token)
        seq.append(token)
    out = {"ar_tokens": ar}
    out["all_accepted"] = engine.verify_external("v", prompt, ar[:k], greedy) == (k, ar[k])
    wrong = ar[:2] + [(ar[2] + 1) % (engine.vocab_size or 1000)] + ar[3:k]
    out["rejected_at_2"] = engine.verify_external("w", prompt, wrong, greedy) == (2, ar[2])
    cold = SamplingParams(temperature=0.05)
    accepted = [engine.verify_external(f"s{i}", prompt, ar[:k], cold, seed=i)[0] for i in range(8)]
    out["one_hot_fp32_accepted"] = accepted  # no draft_probs: one-hot fp32 logits of the draft
    out["one_hot_ok"] = sum(a == k for a in accepted) >= 7
    too_long = [1] * (engine.max_input_len + 1)
    try:
        engine.check_verify(len(too_long), 0)
        out["refused_before_enqueue"] = False
    except ValueError as e:
        out["refused_before_enqueue"] = "max_input_len" in str(e)
    tle = engine._tle
    rid = engine.executor.enqueue_request(tle.Request(input_token_ids=too_long, max_tokens=1))
    (responses,) = engine.executor.await_responses(ids=[rid], timeout=datetime.timedelta(seconds=60))
    out["executor_error_response"] = bool(responses) and responses[0].has_error()
    out["executor_error_message"] = responses[0].error_msg if responses and responses[0].has_error() else ""
    engine.shutdown()
    out["ok"] = all(out[key] for key in ("all_accepted", "rejected_at_2", "one_hot_ok", "refused_before_enqueue",
                                         "executor_error_response"))
    return out


def _generate(srv, model: str, body: dict) -> tuple[int, dict]:
    """(HTTP status, JSON answer) of Triton's generate endpoint; an error answer is {"error": ...}."""
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/{model}/generate", data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode() or "{}")


def drafter_checks(srv, ar_ids: list[int], prompt_ids: list[int], vocab: int, k: int = 4) -> dict:
    """The drafter model with the backend's own tensors (what the orchestrator sends over BLS), over
    Triton's generate endpoint: it takes each input as a JSON value or flat list (the batch
    dimension is added) and answers each output as a flat list."""
    base = {"input_ids": prompt_ids, "input_lengths": len(prompt_ids), "request_output_len": k, "end_id": -1,
            "streaming": False, "exclude_input_in_output": True}
    out: dict = {}
    status, greedy = _generate(srv, "drafter_trtllm", {**base, "runtime_top_k": 1})
    out["greedy_draft"] = greedy.get("output_ids")
    out["greedy_draft_is_ar"] = status == 200 and list(greedy.get("output_ids") or [])[:k] == ar_ids[:k]
    status, sampled = _generate(srv, "drafter_trtllm", {**base, "temperature": 0.8, "runtime_top_p": 1.0,
                                                        "return_generation_logits": True, "seed": 7})
    logits = sampled.get("generation_logits") or []
    out["generation_logits_values"] = len(logits)
    out["generation_logits_ok"] = status == 200 and len(logits) == k * vocab  # [1, beam 1, K, vocab] flat
    too_long = [prompt_ids[0]] * 100000
    status, err = _generate(srv, "drafter_trtllm", {**base, "input_ids": too_long, "input_lengths": len(too_long),
                                                    "runtime_top_k": 1})
    out["over_long_error"] = str(err.get("error", ""))[:300]
    out["over_long_refused"] = status >= 400 and "length" in out["over_long_error"].lower()
    out["ok"] = out["greedy_draft_is_ar"] and out["generation_logits_ok"] and out["over_long_refused"]
    return out


def triton_checks(repo: Path, engine_root: Path, vocab: int) -> dict:
    from ssd_tools.triton_launcher import TritonServer, prepare_backend_dir

    backends = prepare_backend_dir(REPO / "build")
    trt = backends / "tensorrtllm"
    if not trt.exists():  # the image's C++ backend next to python and python_ssd
        trt.symlink_to("/opt/tritonserver/backends/tensorrtllm")
    srv = TritonServer(repo, engine_root, log_file=REPO / "build" / "host_check_tritonserver.log")
    srv.start(timeout=900)
    try:
        rows = []
        for prompt in PROMPTS:
            got = {}
            for mode in ("ar", "sd", "ssd"):
                body = json.dumps({"text_input": prompt, "max_tokens": 48, "mode": mode}).encode()
                req = urllib.request.Request(f"http://{srv.http_url}/v2/models/ssd/generate", data=body)
                with urllib.request.urlopen(req, timeout=300) as r:
                    d = json.loads(r.read().decode())
                got[mode] = (d["output_ids"], json.loads(d["stats"]).get("acceptance_length"))
            if prompt == PROMPTS[0]:
                first_ar = got["ar"][0]
            rows.append({"prompt": prompt, "sd_equal_ar": got["sd"][0] == got["ar"][0],
                         "ssd_equal_ar": got["ssd"][0] == got["ar"][0],
                         "acceptance_length": {m: a for m, (_, a) in got.items()}})
            rows[-1]["sd_accepts_drafts"] = (got["sd"][1] or 0) > 1.0
            log(f"{prompt[:30]!r}: SD == AR {rows[-1]['sd_equal_ar']}, SSD == AR {rows[-1]['ssd_equal_ar']}")
        from ssd.decoding.text import TextCodec

        prompt_ids = TextCodec(engine_root / TARGET).encode_prompt(PROMPTS[0])
        drafter = drafter_checks(srv, first_ar, prompt_ids, vocab)
        log(f"drafter model checks: { {k: v for k, v in drafter.items() if k != 'greedy_draft'} }")
    finally:
        srv.stop()
    ok = all(r["sd_equal_ar"] and r["ssd_equal_ar"] and r["sd_accepts_drafts"] for r in rows) and drafter["ok"]
    return {"prompts": rows, "drafter": drafter, "ok": ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=REPO / "build" / "host_check", help="engines and repository")
    ap.add_argument("--out", type=Path, required=True, help="JSON report")
    ap.add_argument("--dry-run", action="store_true", help="write the spec and repository, print the build plan")
    a = ap.parse_args()
    from ssd_tools import deploy

    engine_root = (a.work / "engines").resolve()
    engine_root.mkdir(parents=True, exist_ok=True)
    vocab = 49152  # SmolLM2's vocabulary (its engine's, padded to a multiple of tp_size 1)
    spec = one_gpu_spec(engine_root, vocab)
    spec_path = a.work / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    repo = a.work / "model_repository"
    deploy.write(deploy.render(spec), repo)
    report: dict = {"spec": str(spec_path), "repository": str(repo), "dry_run": a.dry_run}
    started = time.perf_counter()
    build(spec_path, engine_root, a.dry_run)
    if not a.dry_run:
        os.environ["SSD_ENGINE_ROOT"] = str(engine_root)
        report["executor"] = executor_checks(engine_root)
        log(f"executor checks: {report['executor']}")
        report["triton"] = triton_checks(repo, engine_root, vocab)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["ok"] = a.dry_run or (report["executor"]["ok"] and report["triton"]["ok"])
    a.out.write_text(json.dumps(report, indent=1))
    log(f"ok: {report['ok']}; report in {a.out}")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
