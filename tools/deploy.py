"""Renders a deployment spec (deploy/<name>.yaml) into a Triton model repository.

One spec describes one replica: per model its interface (an engine server or the orchestrator),
batching, instances, where it runs and its parameters. Placement fields:

- ``engine``: the engine_backend parameter (torch | openvino | tensorrt_llm).
- ``gpus``: GPU ids. A tensorrt_llm model gets them as ``gpu_device_ids`` (one process leads
  the tensor-parallel group, so one KIND_CPU instance); a torch model runs one KIND_GPU
  instance per listed GPU, with ``device`` cuda.
- ``instances``: instance count (per GPU for a KIND_GPU model).

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

REPO = Path(__file__).resolve().parents[1]

ENGINE_IO = """input [
  { name: "request" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "probs" data_type: TYPE_FP32 dims: [ -1, -1 ] optional: true allow_ragged_batch: true }
]
output [
  { name: "response" data_type: TYPE_STRING dims: [ 1 ] },
  { name: "probs" data_type: TYPE_FP32 dims: [ -1, -1 ] }
]"""
ORCHESTRATOR_INPUTS = [("text_input", "TYPE_STRING", False), ("max_tokens", "TYPE_INT32", True),
                       ("temperature", "TYPE_FP32", True), ("top_p", "TYPE_FP32", True),
                       ("top_k", "TYPE_INT32", True), ("seed", "TYPE_INT64", True), ("stop", "TYPE_STRING", True),
                       ("stream", "TYPE_BOOL", True), ("apply_chat_template", "TYPE_BOOL", True),
                       ("mode", "TYPE_STRING", True), ("num_draft_tokens", "TYPE_INT32", True),
                       ("fanout_budget", "TYPE_INT32", True), ("fanout_shape", "TYPE_STRING", True),
                       ("saguaro_c", "TYPE_FP32", True), ("backup", "TYPE_STRING", True),
                       ("step_aside", "TYPE_BOOL", True), ("adaptive_k", "TYPE_BOOL", True)]
ORCHESTRATOR_OUTPUTS = [("text_output", "TYPE_STRING", "-1"), ("output_ids", "TYPE_INT32", "-1"),
                        ("finish_reason", "TYPE_STRING", "1"), ("stats", "TYPE_STRING", "1")]


def _orchestrator_io() -> str:
    dims = {"stop": "-1"}
    ins = [f'  {{ name: "{n}" data_type: {t} dims: [ {dims.get(n, "1")} ]{" optional: true" if opt else ""} }}'
           for n, t, opt in ORCHESTRATOR_INPUTS]
    outs = [f'  {{ name: "{n}" data_type: {t} dims: [ {d} ] }}' for n, t, d in ORCHESTRATOR_OUTPUTS]
    return "input [\n" + ",\n".join(ins) + "\n]\noutput [\n" + ",\n".join(outs) + "\n]"


INTERFACES = {"engine": ENGINE_IO, "orchestrator": _orchestrator_io()}


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


def render_model(name: str, spec: dict) -> str:
    interface = spec.get("interface")
    if interface not in INTERFACES:
        raise SpecError(f"models.{name}.interface must be one of {sorted(INTERFACES)}, got {interface!r}")
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
    return {name: render_model(name, m or {}) for name, m in models.items()}


def write(configs: dict[str, str], out: Path) -> None:
    for name, text in configs.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / "config.pbtxt").write_text(text)
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
