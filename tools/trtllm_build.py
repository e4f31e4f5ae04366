"""Renders (and on GPU hosts runs) the TensorRT-LLM 1.2.x engine builds for an engines/<profile>.yaml.

Input: the HF-format folders engines/<name>/ that the CPU path writes (tools/build_engines.py).
Per target engine: a transformers-4 compatible view of the folder (the TRT-LLM image ships
transformers 4.x, which ignores the `rope_parameters` our transformers-5 config.json uses and would
silently fall back to rope_theta 10000), checkpoint conversion
(examples/models/core/<family>/convert_checkpoint.py, bf16), `trtllm-build`, and
engines/trtllm/<name>/runtime.json for backends/.../trtllm_engine.py.

Every target gets a TensorRT-LLM engine (draft_tokens_external, K = max_draft_len); a drafter gets
one where the deployment spec serves it as a `tensorrtllm` model (deploy/gpu_trtllm_backend.yaml's
drafter_trtllm: SD drafting as plain generation requests, generation logits in fp32). SSD's
speculation trees need rows with a custom attention mask each, which neither the executor's
Request nor the backend's inputs take, so they stay on the torch drafter with CUDA graphs
(engine/static_engine.py) whatever is built here.

The deployment spec (``--spec``, deploy/gpu_paper_layout.yaml by default) decides the sizes that
must agree with serving: an engine's ``tp_size`` is the number of GPUs its tensorrt_llm model
lists, and its ``max_batch_size`` is the orchestrator's ``max_active_requests`` (every active
request has one verify in flight). The examples come from the TensorRT-LLM container (/app/examples
in the NGC image), TRTLLM_EXAMPLES_DIR wins.

`--dry-run` prints the commands and the files it would write and touches nothing, so it works on a
machine without TensorRT-LLM, a GPU or even the HF folders.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ssd.engine.meta import trtllm_engine_dir  # torch-free: the runtime reads the same path

CONTAINER_EXAMPLES = "/app/examples"  # the TensorRT-LLM examples in NGC's trtllm-python-py3 image
DEFAULTS = {"version": "1.2", "examples_dir": CONTAINER_EXAMPLES, "max_draft_len": 4,
            "max_batch_size": 8, "max_seq_len": 4096, "max_input_len": None, "max_num_tokens": 4096,
            "enable_chunked_context": True, "kv_cache_free_gpu_mem_fraction": {"target": 0.5}}
ROLES = ("target",)  # built whatever the spec says; a drafter only where the spec serves it (docstring)
# HF model_type -> (examples/models/core/<dir>, architectures entry for the compat config.json)
FAMILIES = {"qwen2": ("qwen", "Qwen2ForCausalLM"), "llama": ("llama", "LlamaForCausalLM"),
            "mistral": ("llama", "MistralForCausalLM")}
NAME_HINTS = {"qwen": "qwen2", "llama": "llama", "smollm": "llama", "mistral": "mistral"}
LINKED = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
          "chat_template.jinja")


class BuildError(RuntimeError):
    def __init__(self, msg: str, code: int = 1):
        super().__init__(msg)
        self.code = code


@dataclass
class EnginePlan:
    name: str
    role: str
    model_type: str
    model_type_from: str  # "config.json" or "name" (a guess, only when the HF folder is missing)
    hf_dir: Path
    hf_present: bool
    stage_dir: Path
    ckpt_dir: Path
    engine_dir: Path
    commands: list[list[str]] = field(default_factory=list)
    files: dict[str, dict] = field(default_factory=dict)  # path -> JSON content

    def to_json(self) -> dict:
        return {"name": self.name, "role": self.role, "model_type": self.model_type,
                "model_type_from": self.model_type_from, "hf_dir": str(self.hf_dir), "hf_present": self.hf_present,
                "engine_dir": str(self.engine_dir), "commands": self.commands,
                "command_lines": [shlex.join(c) for c in self.commands], "files": self.files}


def spec_limits(spec: dict | None) -> dict[str, dict]:
    """engine name -> {"tp_size", "max_batch_size"} for each tensorrt_llm model of a deployment spec."""
    if not spec:
        return {}
    models = spec.get("models") or {}
    active = [dict(p for item in (m.get("parameters") or []) if isinstance(item, dict) for p in item.items())
              .get("max_active_requests") for m in models.values() if m.get("interface") == "orchestrator"]
    out = {}
    for name, m in models.items():
        if m.get("engine") != "tensorrt_llm" and m.get("interface") != "tensorrtllm":
            continue
        params = dict(p for item in (m.get("parameters") or []) if isinstance(item, dict) for p in item.items())
        engine = params.get("engine")
        if not engine:
            raise BuildError(f"deployment spec: models.{name} runs on tensorrt_llm but names no `engine` parameter", 2)
        limits = {"tp_size": len(m.get("gpus") or [0])}
        if active and active[0]:
            limits["max_batch_size"] = int(active[0])
        if engine in out and out[engine] != limits:  # one engine folder serves both models: one build
            raise BuildError(f"deployment spec: engine {engine} is served by models of different sizes "
                             f"({out[engine]} and models.{name}'s {limits})", 2)
        out[engine] = limits
    return out


def settings(cfg: dict) -> dict:
    if "tp_size" in (cfg.get("tensorrt_llm") or {}):
        raise BuildError("tensorrt_llm.tp_size: the tensor parallelism comes from the deployment spec (the number of "
                         "GPUs of the engine's tensorrt_llm model, --spec); remove it here", 2)
    s = {**DEFAULTS, **(cfg.get("tensorrt_llm") or {})}
    k = int(s["max_draft_len"])
    if s["max_input_len"] is None:
        s["max_input_len"] = int(s["max_seq_len"]) - k - 1
    # A verify request carries the full prefix as input and asks for K + 1 new tokens.
    if int(s["max_input_len"]) + k + 1 > int(s["max_seq_len"]):
        raise BuildError(f"tensorrt_llm: max_input_len {s['max_input_len']} + max_draft_len {k} + 1 exceeds "
                         f"max_seq_len {s['max_seq_len']}", 2)
    if not 1 <= k <= 64:
        raise BuildError(f"tensorrt_llm: max_draft_len must be in 1..64, got {k}", 2)
    s["examples_dir"] = os.environ.get("TRTLLM_EXAMPLES_DIR") or s["examples_dir"]
    return s


def compat_config(hf: dict, model_type: str, dtype: str) -> dict:
    """config.json as transformers 4.x reads it: architectures set, rope_theta/rope_scaling top level."""
    out = {k: v for k, v in hf.items() if k not in ("rope_parameters", "transformers_version", "dtype")}
    out["architectures"] = [FAMILIES[model_type][1]]
    out["torch_dtype"] = dtype
    rope = dict(hf.get("rope_parameters") or {})
    if "rope_theta" in rope:
        out["rope_theta"] = rope.pop("rope_theta")
    out["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
    return out


def plan_engine(name: str, spec: dict, s: dict, engines_root: Path, out_root: Path | None, python: str,
                limits: dict | None = None) -> EnginePlan:
    """``out_root`` None: the engine goes where the runtime looks for it (meta.trtllm_engine_dir).
    ``limits``: the deployment spec's tp_size and max_batch_size for this engine (spec_limits)."""
    limits = limits or {}
    hf_dir = engines_root / name
    engine_dir = out_root / name if out_root else trtllm_engine_dir(hf_dir)
    hf_cfg_path = hf_dir / "config.json"
    hf_present = hf_cfg_path.exists() and (hf_dir / "model.safetensors").exists()
    hf = json.loads(hf_cfg_path.read_text()) if hf_cfg_path.exists() else {}
    meta = json.loads((hf_dir / "engine.json").read_text()) if (hf_dir / "engine.json").exists() else {}
    if hf.get("model_type"):
        model_type, source = hf["model_type"], "config.json"
    else:  # dry run before the CPU conversion: guess from the names, config.json decides for real
        hay = f"{name} {spec.get('source', '')}".lower()
        model_type, source = next((t for h, t in NAME_HINTS.items() if h in hay), "unknown"), "name"
    if model_type not in FAMILIES and hf_present:
        raise BuildError(f"{name}: model_type {model_type!r} has no TRT-LLM example mapping "
                         f"(known: {', '.join(FAMILIES)})", 2)
    family = FAMILIES.get(model_type, ("<family>", ""))[0]
    role = spec["role"]
    k = int(s["max_draft_len"])
    build_root = engine_dir.parent / ".build" / name
    p = EnginePlan(name, role, model_type, source, hf_dir, hf_present, build_root / "hf",
                   build_root / "checkpoint", engine_dir)
    script = Path(s["examples_dir"]) / "models" / "core" / family / "convert_checkpoint.py"
    tp = int(limits.get("tp_size", 1))  # tensor parallelism: GPUs per engine, from the deployment spec
    max_batch = int(limits.get("max_batch_size", s["max_batch_size"]))
    p.commands.append([python, str(script), "--model_dir", str(p.stage_dir), "--output_dir", str(p.ckpt_dir),
                       "--dtype", "bfloat16", "--tp_size", str(tp), "--pp_size", "1"])
    build = ["trtllm-build", "--checkpoint_dir", str(p.ckpt_dir), "--output_dir", str(p.engine_dir),
             "--gemm_plugin", "auto", "--kv_cache_type", "paged", "--use_paged_context_fmha", "enable",
             "--max_batch_size", str(max_batch), "--max_input_len", str(s["max_input_len"]),
             "--max_seq_len", str(s["max_seq_len"]), "--max_num_tokens", str(s["max_num_tokens"]),
             # both roles: the target's sampled acceptance and the drafter's q rows need logits (fp32)
             "--gather_generation_logits", "--logits_dtype", "float32"]
    if role == "target":
        build += ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", str(k)]
    p.commands.append(build)
    fracs = s["kv_cache_free_gpu_mem_fraction"]
    frac = float(fracs.get(role, 0.3) if isinstance(fracs, dict) else fracs)
    fingerprint = hashlib.sha256(json.dumps([p.commands, meta.get("source_sha256", "")]).encode()).hexdigest()
    if hf:
        p.files[str(p.stage_dir / "config.json")] = compat_config(hf, model_type, "bfloat16")
    p.files[str(p.engine_dir / "runtime.json")] = {
        "format": 1, "name": name, "role": role, "engine_dir": ".",
        "tokenizer_dir": os.path.relpath(hf_dir, p.engine_dir), "trtllm_version": str(s["version"]),
        "speculative_decoding_mode": "draft_tokens_external" if role == "target" else None,
        "max_draft_len": k, "tp_size": tp, "kv_cache_free_gpu_mem_fraction": frac, "enable_kv_cache_reuse": True,
        "enable_chunked_context": bool(s["enable_chunked_context"]), "gather_generation_logits": True,
        "max_batch_size": max_batch, "max_input_len": int(s["max_input_len"]),
        "max_seq_len": int(s["max_seq_len"]), "max_num_tokens": int(s["max_num_tokens"]),
        "vocab_size": hf.get("vocab_size"), "eos_token_ids": meta.get("eos_token_ids", []),
        "build_fingerprint": fingerprint}
    return p


def make_plans(config: Path, engines_root: Path, out_root: Path | None, python: str,
               deploy_spec: Path | None = None) -> tuple[dict, list[EnginePlan]]:
    cfg = yaml.safe_load(config.read_text())
    s = settings(cfg)
    limits = spec_limits(yaml.safe_load(deploy_spec.read_text()) if deploy_spec else None)
    unknown = sorted(set(limits) - set(cfg["engines"]))
    if unknown:
        raise BuildError(f"deployment spec {deploy_spec} serves {', '.join(unknown)} on tensorrt_llm, which {config} "
                         "does not build", 2)
    return s, [plan_engine(n, spec, s, engines_root, out_root, python, limits.get(n))
               for n, spec in cfg["engines"].items() if spec["role"] in ROLES or n in limits]


def describe(plans: list[EnginePlan], s: dict, out) -> None:
    for i, p in enumerate(plans, 1):
        tp = p.commands[0][p.commands[0].index("--tp_size") + 1]
        print(f"[trtllm] engine {i}/{len(plans)}: {p.name} ({p.role}, bfloat16, tp_size {tp}, model_type {p.model_type}"
              f"{' guessed from the name' if p.model_type_from == 'name' else ''})", file=out)
        if p.hf_present:
            print(f"[trtllm]   input {p.hf_dir}/ (HF-format, from the torch build)", file=out)
        else:
            print(f"[trtllm]   input {p.hf_dir}/ is missing: build_engines.sh would convert it first "
                  f"(tools/build_engines.py), then stage it here", file=out)
        print(f"[trtllm]   would stage {p.stage_dir}/ (compat config.json + links to "
              f"{', '.join(LINKED[:3])})", file=out)
        for c in p.commands:
            print("  $ " + shlex.join(c), file=out)
        for path, content in p.files.items():
            if path.endswith("runtime.json"):
                print(f"[trtllm]   would write {path}:", file=out)
                print("    " + json.dumps(content, indent=2).replace("\n", "\n    "), file=out)
            else:  # the compat config: only what differs from the HF config matters to a reader
                keys = ("architectures", "torch_dtype", "rope_theta", "rope_scaling")
                print(f"[trtllm]   would write {path}: {p.hf_dir}/config.json with "
                      f"{json.dumps({k: content.get(k) for k in keys})}, rope_parameters dropped", file=out)


def check_toolchain(plans: list[EnginePlan], s: dict, python: str) -> None:
    problems = []
    if shutil.which("trtllm-build") is None:
        problems.append("`trtllm-build` is not on PATH")
    if Path(python).resolve() == Path(sys.executable).resolve():
        if importlib.util.find_spec("tensorrt_llm") is None:
            problems.append(f"`import tensorrt_llm` fails for {python}")
    elif subprocess.run([python, "-c", "import tensorrt_llm"], capture_output=True).returncode != 0:
        problems.append(f"`import tensorrt_llm` fails for {python}")
    if problems:
        raise BuildError("TensorRT-LLM 1.2.x is not available here: " + "; ".join(problems) + ". Build on a GPU "
                         "host (NGC tritonserver:<ver>-trtllm-python-py3), or use --dry-run to only render.", 2)
    for p in plans:
        if not p.hf_present:
            raise BuildError(f"{p.hf_dir}/ is missing: run `bash build_engines.sh --backend torch` first", 2)
        script = Path(p.commands[0][1])
        if not script.exists():
            raise BuildError(f"{script} not found: run in the NGC tritonserver trtllm-python-py3 image (examples in "
                             f"{CONTAINER_EXAMPLES}) or set TRTLLM_EXAMPLES_DIR to the examples/ of a TensorRT-LLM "
                             f"v{s['version']}.x checkout", 2)


def is_current(p: EnginePlan) -> bool:
    rt = p.engine_dir / "runtime.json"
    if not (rt.exists() and any(p.engine_dir.glob("rank*.engine"))):
        return False
    want = p.files[str(rt)]["build_fingerprint"]
    return json.loads(rt.read_text()).get("build_fingerprint") == want


def stage(p: EnginePlan) -> None:
    if p.stage_dir.exists():
        shutil.rmtree(p.stage_dir)
    p.stage_dir.mkdir(parents=True)
    for f in LINKED:  # symlinks: the weights are GBs and only read
        if (p.hf_dir / f).exists():
            (p.stage_dir / f).symlink_to((p.hf_dir / f).resolve())
    (p.stage_dir / "config.json").write_text(json.dumps(p.files[str(p.stage_dir / "config.json")], indent=2))


def execute(plans: list[EnginePlan], force: bool, log) -> None:
    for i, p in enumerate(plans, 1):
        print(f"[trtllm] engine {i}/{len(plans)}: {p.name} ({p.role})", file=log, flush=True)
        if not force and is_current(p):
            print(f"[trtllm] {p.engine_dir} is up to date, nothing to do", file=log, flush=True)
            continue
        stage(p)
        p.engine_dir.mkdir(parents=True, exist_ok=True)
        (p.engine_dir / "runtime.json").unlink(missing_ok=True)  # its presence marks a finished build
        for c in p.commands:
            print("  $ " + shlex.join(c), file=log, flush=True)
            rc = subprocess.run(c).returncode
            if rc != 0:
                raise BuildError(f"{p.name}: `{Path(c[1]).name if c[0] != 'trtllm-build' else c[0]}` "
                                 f"failed with exit code {rc}", rc)
        rt = p.engine_dir / "runtime.json"
        rt.write_text(json.dumps(p.files[str(rt)], indent=2))
        print(f"[trtllm] {p.engine_dir} ready", file=log, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=Path("engines/default.yaml"))
    ap.add_argument("--engines-root", type=Path, default=Path("engines"), help="where the HF-format folders are")
    ap.add_argument("--out-root", type=Path, default=None,
                    help="default: <engines-root>/trtllm, where the served target model looks")
    ap.add_argument("--spec", type=Path, default=Path("deploy/gpu_paper_layout.yaml"),
                    help="deployment spec whose tensorrt_llm models set tp_size and max_batch_size")
    ap.add_argument("--python", default=sys.executable, help="interpreter with tensorrt_llm for convert_checkpoint")
    ap.add_argument("--dry-run", action="store_true", help="print commands and rendered files, run nothing")
    ap.add_argument("--print-json", action="store_true", help="print the plan as JSON on stdout")
    ap.add_argument("--force", action="store_true", help="rebuild engines that look up to date")
    a = ap.parse_args()
    log = sys.stderr if a.print_json else sys.stdout  # keep stdout pure JSON for --print-json
    try:
        s, plans = make_plans(a.config, a.engines_root, a.out_root, a.python, a.spec)
        if a.print_json:
            print(json.dumps({"config": str(a.config), "dry_run": a.dry_run, "settings": s,
                              "engines": [p.to_json() for p in plans]}, indent=2))
        if a.dry_run:
            if not a.print_json:
                describe(plans, s, log)
            print("[trtllm] dry run: nothing was run or written", file=log)
            return
        check_toolchain(plans, s, a.python)
        execute(plans, a.force, log)
    except BuildError as e:
        print(f"[trtllm] ERROR: {e}", file=sys.stderr)
        sys.exit(e.code)


if __name__ == "__main__":
    main()
