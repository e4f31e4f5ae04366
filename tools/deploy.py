"""Renders a deployment spec (deploy/<name>.yaml) into a Triton model repository.

One spec describes one replica: per model its interface (an engine server or the orchestrator),
batching, instances, where it runs and its parameters. Placement fields:

- ``engine``: the engine_backend parameter (torch | openvino | tensorrt_llm).
- ``gpus``: GPU ids. A tensorrt_llm model gets them as ``gpu_device_ids`` (one process leads
  the tensor-parallel group, so one KIND_CPU instance); a torch model runs one KIND_GPU
  instance per listed GPU, with ``device`` cuda.
- ``instances``: instance count (per GPU for a KIND_GPU model).

``interface: tensorrtllm`` renders a model of Triton's own TensorRT-LLM backend instead (the target
or the SD drafter served by the C++ backend, verified or drafted through over BLS by
serving/trtllm_backend_client.py): the backend's
decoupled in-flight-batching config with the inputs and outputs of serving/trtllm_contract.py, the
engine folder ``<engine_root>/trtllm/<engine>`` (the spec's ``engine_root``, /opt/ssd/engines by
default) and the backend's own parameters, which the model's ``parameters`` may override.

Parameters are an ordered list of ``key: "value"`` items (values are Triton string_values, so
strings) and comment strings, rendered in order. deploy/cpu_default.yaml renders the shipped
model_repository/ byte for byte (tests/test_deploy.py).

    python tools/deploy.py deploy/gpu_paper_layout.yaml --out build/model_repository
    python tools/deploy.py deploy/cpu_default.yaml --check model_repository   # exit 1 on a difference
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import yaml

from ssd.config import DECODE_INPUTS
from ssd.serving.trtllm_contract import INPUTS, OUTPUTS, RAGGED

REPO = Path(__file__).resolve().parents[1]
ENGINE_ROOT = "/opt/ssd/engines"  # where deploy/k8s mounts the engines volume
# The TensorRT-LLM backend's parameters (the 1.2-era template's keys) with the values this project
# serves with; the engine's path and the GPUs come from the spec.
TRTLLM_PARAMETERS = [
    ("max_beam_width", "1"),
    ("FORCE_CPU_ONLY_INPUT_TENSORS", "no"),
    ("gpt_model_type", "inflight_fused_batching"),
    ("batch_scheduler_policy", "guaranteed_no_evict"),
    ("kv_cache_free_gpu_mem_fraction", "0.5"),
    ("enable_kv_cache_reuse", "true"),  # a verify's prefix is the last one's: its blocks are reused
    ("enable_chunked_context", "true"),
    ("exclude_input_in_output", "true"),
    # a stop request cancels at once; this is how often Triton-cancelled requests are looked for
    ("cancellation_check_period_ms", "1"),
    ("executor_worker_path", "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"),
]

ENGINE_IO = """input [
  { name: "request" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "probs" data_type: TYPE_FP32 dims: [ -1, -1 ] optional: true allow_ragged_batch: true }
]
output [
  { name: "response" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "probs" data_type: TYPE_FP32 dims: [ -1, -1 ] }
]"""
TRITON_TYPES = {str: "TYPE_STRING", int: "TYPE_INT32", float: "TYPE_FP32", bool: "TYPE_BOOL"}
# the generate extension's inputs, then SSD's knobs (DecodeConfig's inputs, ssd/config.py)
ORCHESTRATOR_INPUTS = [("text_input", "TYPE_STRING", False), ("max_tokens", "TYPE_INT32", True),
                       ("temperature", "TYPE_FP32", True), ("top_p", "TYPE_FP32", True),
                       ("top_k", "TYPE_INT32", True), ("seed", "TYPE_INT64", True), ("stop", "TYPE_STRING", True),
                       ("stream", "TYPE_BOOL", True), ("apply_chat_template", "TYPE_BOOL", True)] + \
                      [(name, TRITON_TYPES[kind], True) for name, (_, kind) in DECODE_INPUTS.items()] + \
                      [("timeout_s", "TYPE_FP32", True)]
ORCHESTRATOR_OUTPUTS = [("text_output", "TYPE_STRING", "-1"), ("output_ids", "TYPE_INT32", "-1"),
                        ("finish_reason", "TYPE_STRING", "1"), ("stats", "TYPE_STRING", "1")]


def _orchestrator_io() -> str:
    dims = {"stop": "-1"}
    ins = [f'  {{ name: "{n}" data_type: {t} dims: [ {dims.get(n, "1")} ]{" optional: true" if opt else ""} }}'
           for n, t, opt in ORCHESTRATOR_INPUTS]
    outs = [f'  {{ name: "{n}" data_type: {t} dims: [ {d} ] }}' for n, t, d in ORCHESTRATOR_OUTPUTS]
    return "input [\n" + ",\n".join(ins) + "\n]\noutput [\n" + ",\n".join(outs) + "\n]"


def _tensorrtllm_io() -> str:
    def dims(d: list[int]) -> str:
        return "[ " + ", ".join(str(x) for x in d) + " ]"

    ins = []
    for n, (t, d, optional) in INPUTS.items():
        extra = " reshape: { shape: [ ] }" if d == [1] else ""
        extra += " optional: true" if optional else ""
        extra += " allow_ragged_batch: true" if n in RAGGED else ""
        ins.append(f'  {{ name: "{n}" data_type: {t} dims: {dims(d)}{extra} }}')
    outs = [f'  {{ name: "{n}" data_type: {t} dims: {dims(d)} }}' for n, (t, d) in OUTPUTS.items()]
    return "input [\n" + ",\n".join(ins) + "\n]\noutput [\n" + ",\n".join(outs) + "\n]"


INTERFACES = {"engine": ENGINE_IO, "orchestrator": _orchestrator_io(), "tensorrtllm": _tensorrtllm_io()}
# The orchestrator's first request measures the engines' costs; Triton runs this one (files in
# model_repository/ssd/warmup/) before it reports the model READY, so no client pays for it.
WARMUP_FILES = REPO / "model_repository" / "ssd" / "warmup"
ORCHESTRATOR_WARMUP = """# Triton runs this request (warmup/: a short prompt, 8 tokens) before it reports the model READY:
# the orchestrator measures the engines' costs for the scheduler on its first request
# (decoding/calibration.py), so no client's first request pays for it.
model_warmup [ {
  name: "calibrate"
  batch_size: 1
  inputs { key: "text_input" value: { data_type: TYPE_STRING dims: [ 1 ] input_data_file: "text_input" } }
  inputs { key: "max_tokens" value: { data_type: TYPE_INT32 dims: [ 1 ] input_data_file: "max_tokens" } }
} ]"""


class SpecError(ValueError):
    pass


def _comment(text: str) -> list[str]:
    return [f"# {line}".rstrip() for line in str(text).rstrip("\n").split("\n")]


def _parameters(name: str, spec: dict) -> list[tuple[str, str] | str]:
    """Ordered (key, value) pairs and comment lines, with the placement fields applied."""
    items: list[tuple[str, str] | str] = []
    for i, item in enumerate(spec.get("parameters") or []):
        if isinstance(item, str):
            items.extend(_comment(item))
        elif isinstance(item, dict) and len(item) == 1:
            (key, value), = item.items()
            if not isinstance(value, str):
                raise SpecError(f"models.{name}.parameters[{i}].{key}: a Triton string_value, quote it "
                                f"(got {type(value).__name__} {value!r})")
            items.append((str(key), value))
        else:
            raise SpecError(f"models.{name}.parameters[{i}]: expected `key: \"value\"` or a comment string")

    def put(key: str, value: str) -> None:
        for j, it in enumerate(items):
            if isinstance(it, tuple) and it[0] == key:
                items[j] = (key, value)
                return
        items.append((key, value))

    if "engine" in spec:
        if spec["engine"] not in ("torch", "openvino", "tensorrt_llm"):
            raise SpecError(f"models.{name}.engine must be torch, openvino or tensorrt_llm, got {spec['engine']!r}")
        put("engine_backend", spec["engine"])
    gpus = spec.get("gpus")
    if gpus:
        if spec.get("engine") == "tensorrt_llm":
            put("gpu_device_ids", ",".join(str(int(g)) for g in gpus))
        else:
            put("device", "cuda")
    return items


def _instance_group(name: str, spec: dict) -> str:
    count = int(spec.get("instances", 1))
    if count < 1:
        raise SpecError(f"models.{name}.instances must be at least 1, got {count}")
    gpus = spec.get("gpus")
    if gpus and spec.get("engine") != "tensorrt_llm":
        return f"instance_group [ {{ kind: KIND_GPU count: {count} gpus: [ {', '.join(str(int(g)) for g in gpus)} ] }} ]"
    return f"instance_group [ {{ kind: KIND_CPU count: {count} }} ]"


def render_tensorrtllm(name: str, spec: dict, engine_root: str) -> str:
    """A model of Triton's TensorRT-LLM backend: decoupled, in-flight batching, one KIND_CPU
    instance that leads the engine's GPUs (gpu_device_ids)."""
    if spec.get("engine", "tensorrt_llm") != "tensorrt_llm":
        raise SpecError(f"models.{name}.engine: a tensorrtllm model runs a tensorrt_llm engine, got {spec['engine']!r}")
    if not spec.get("gpus"):
        raise SpecError(f"models.{name}.gpus: a tensorrtllm model needs its GPUs")
    own = {}
    for i, item in enumerate(spec.get("parameters") or []):
        if isinstance(item, dict) and len(item) == 1:
            (key, value), = item.items()
            if not isinstance(value, str):
                raise SpecError(f"models.{name}.parameters[{i}].{key}: a Triton string_value, quote it "
                                f"(got {type(value).__name__} {value!r})")
            own[str(key)] = value
    engine = own.pop("engine", "")
    if not engine:
        raise SpecError(f"models.{name}.parameters.engine: the engine to serve (engines/*.yaml's name)")
    batch = int(spec.get("max_batch_size", 64))
    lines = _comment(spec["comment"]) if spec.get("comment") else []
    lines += [f'name: "{name}"', 'backend: "tensorrtllm"', f"max_batch_size: {batch}",
              "model_transaction_policy { decoupled: true }",
              f"dynamic_batching {{ preferred_batch_size: [ {batch} ] max_queue_delay_microseconds: "
              f"{int((spec.get('batching') or {}).get('max_queue_delay_microseconds', 0))} }}",
              INTERFACES["tensorrtllm"], "instance_group [ { kind: KIND_CPU count: 1 } ]"]
    params = dict(TRTLLM_PARAMETERS)
    params["gpt_model_path"] = f"{engine_root}/trtllm/{engine}"
    params["gpu_device_ids"] = ",".join(str(int(g)) for g in spec["gpus"])
    params.update(own)
    lines += [f'parameters: {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items()]
    return "\n".join(lines) + "\n"


def render_model(name: str, spec: dict, engine_root: str = ENGINE_ROOT) -> str:
    interface = spec.get("interface")
    if interface not in INTERFACES:
        raise SpecError(f"models.{name}.interface must be one of {sorted(INTERFACES)}, got {interface!r}")
    if interface == "tensorrtllm":
        return render_tensorrtllm(name, spec, engine_root)
    lines = _comment(spec["comment"]) if spec.get("comment") else []
    lines += [f'name: "{name}"', 'backend: "python_ssd"', f"max_batch_size: {int(spec.get('max_batch_size', 0))}"]
    batching = spec.get("batching")
    if batching is not None:
        batching = dict(batching)
        if "comment" in batching:
            lines += _comment(batching.pop("comment"))
        inner = " ".join(f"{k}: {int(v)}" for k, v in batching.items())
        lines.append(f"dynamic_batching {{ {inner} }}" if inner else "dynamic_batching { }")
    if spec.get("decoupled"):
        lines.append("model_transaction_policy { decoupled: true }")
    lines += [INTERFACES[interface], _instance_group(name, spec)]
    if interface == "orchestrator":
        lines.append(ORCHESTRATOR_WARMUP)
    for it in _parameters(name, spec):
        lines.append(it if isinstance(it, str) else f'parameters: {{ key: "{it[0]}" value: {{ string_value: "{it[1]}" }} }}')
    return "\n".join(lines) + "\n"


def _param(spec: dict, key: str) -> str | None:
    for item in spec.get("parameters") or []:
        if isinstance(item, dict) and key in item:
            return item[key]
    return None


def check_limits(models: dict) -> None:
    """Every engine that keeps a sequence per active request holds as many as the orchestrator admits
    (a drafter that evicts a live sequence recomputes its prefix every round)."""
    active = [int(_param(m, "max_active_requests") or 0) for m in models.values()
              if (m or {}).get("interface") == "orchestrator"]
    if not active or not active[0]:
        return
    for name, m in models.items():
        held = _param(m or {}, "max_sequences")
        if held is not None and int(held) < active[0]:
            raise SpecError(f"models.{name}.parameters.max_sequences {held} is below the orchestrator's "
                            f"max_active_requests {active[0]}")


def render(spec: dict) -> dict[str, str]:
    """model name -> config.pbtxt text."""
    models = spec.get("models")
    if not isinstance(models, dict) or not models:
        raise SpecError("the spec needs a `models:` mapping")
    check_limits(models)
    root = str(spec.get("engine_root", ENGINE_ROOT))
    return {name: render_model(name, m or {}, root) for name, m in models.items()}


def write(configs: dict[str, str], out: Path) -> None:
    for name, text in configs.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "config.pbtxt").write_text(text)
        if "model_warmup" in text and not (out / name / "warmup").exists():
            shutil.copytree(WARMUP_FILES, out / name / "warmup")
        version = out / name / "1"
        shipped = REPO / "model_repository" / name / "1"
        if not version.exists():  # Triton needs a version folder; the code lives in backends/python_ssd
            if shipped.is_dir():
                shutil.copytree(shipped, version)
            else:
                version.mkdir()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", type=Path)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--out", type=Path, help="model repository to write")
    group.add_argument("--check", type=Path, help="model repository to compare with (exit 1 on a difference)")
    a = ap.parse_args()
    try:
        configs = render(yaml.safe_load(a.spec.read_text()))
    except (SpecError, KeyError) as e:
        print(f"[deploy] ERROR in {a.spec}: {e}", file=sys.stderr)
        sys.exit(2)
    if a.out:
        write(configs, a.out)
        print(f"[deploy] {len(configs)} models written to {a.out}")
        return
    differ = [n for n, t in configs.items() if not (a.check / n / "config.pbtxt").exists()
              or (a.check / n / "config.pbtxt").read_text() != t]
    extra = sorted(p.parent.name for p in a.check.glob("*/config.pbtxt") if p.parent.name not in configs)
    for n in differ + extra:
        print(f"[deploy] {n}: differs from {a.spec}", file=sys.stderr)
    sys.exit(1 if differ or extra else 0)


if __name__ == "__main__":
    main()
