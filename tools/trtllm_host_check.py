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
3. Through tritonserver with the target on Triton's TensorRT-LLM backend (the rendered spec): greedy
   SD and SSD output equal AR token for token, for three prompts.

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


def triton_checks(repo: Path, engine_root: Path) -> dict:
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
            rows.append({"prompt": prompt, "sd_equal_ar": got["sd"][0] == got["ar"][0],
                         "ssd_equal_ar": got["ssd"][0] == got["ar"][0],
                         "acceptance_length": {m: a for m, (_, a) in got.items()}})
            log(f"{prompt[:30]!r}: SD == AR {rows[-1]['sd_equal_ar']}, SSD == AR {rows[-1]['ssd_equal_ar']}")
    finally:
        srv.stop()
    return {"prompts": rows, "ok": all(r["sd_equal_ar"] and r["ssd_equal_ar"] for r in rows)}


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
        report["triton"] = triton_checks(repo, engine_root)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    report["ok"] = a.dry_run or (report["executor"]["ok"] and report["triton"]["ok"])
    a.out.write_text(json.dumps(report, indent=1))
    log(f"ok: {report['ok']}; report in {a.out}")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
