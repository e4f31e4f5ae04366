"""Deployment specs (tools/deploy.py): the CPU default renders the shipped model repository byte for
byte; the paper's GPU layout renders its placement; bad specs name the field."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ssd_tools import deploy

REPO = Path(__file__).resolve().parent.parent


def spec(name: str) -> dict:
    return yaml.safe_load((REPO / "deploy" / name).read_text())


def test_cpu_default_renders_the_model_repository_byte_for_byte() -> None:
    configs = deploy.render(spec("cpu_default.yaml"))
    shipped = {p.parent.name: p.read_text() for p in (REPO / "model_repository").glob("*/config.pbtxt")}
    assert set(configs) == set(shipped)
    for name, text in configs.items():
        assert text == shipped[name], name
    r = subprocess.run([sys.executable, "tools/deploy.py", "deploy/cpu_default.yaml", "--check", "model_repository"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_check_reports_a_difference(tmp_path: Path) -> None:
    deploy.write(deploy.render(spec("cpu_default.yaml")), tmp_path)
    cfg = tmp_path / "target/config.pbtxt"
    cfg.write_text(cfg.read_text().replace('"true"', '"false"'))
    r = subprocess.run([sys.executable, "tools/deploy.py", "deploy/cpu_default.yaml", "--check", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "target: differs" in r.stderr
    assert (tmp_path / "ssd/1").is_dir()


def test_gpu_paper_layout_places_the_target_on_gpus_0_to_3_and_the_drafter_on_gpu_4() -> None:
    configs = deploy.render(spec("gpu_paper_layout.yaml"))
    target, drafter = configs["target"], configs["drafter_primary"]
    assert "instance_group [ { kind: KIND_CPU count: 1 } ]" in target  # one process leads the TP group
    assert 'key: "gpu_device_ids" value: { string_value: "0,1,2,3" }' in target
    assert 'key: "engine_backend" value: { string_value: "tensorrt_llm" }' in target
    assert "instance_group [ { kind: KIND_GPU count: 1 gpus: [ 4 ] } ]" in drafter
    assert 'key: "device" value: { string_value: "cuda" }' in drafter
    assert 'key: "static_kv_len"' in drafter and 'key: "engine_backend" value: { string_value: "torch" }' in drafter
    assert 'key: "max_verify_rows" value: { string_value: "0" }' in configs["ssd"]
    assert "KIND_GPU" not in configs["drafter_backup"]


def test_the_gpu_instance_runs_on_the_gpu_triton_placed_it_on() -> None:
    from ssd.serving.roles import instance_device

    gpu4 = {"model_instance_kind": "GPU", "model_instance_device_id": "4"}
    assert instance_device({"device": "cuda"}, gpu4) == "cuda:4"
    assert instance_device({"device": "cuda:1"}, gpu4) == "cuda:1"
    assert instance_device({"device": "cpu"}, {"model_instance_kind": "CPU", "model_instance_device_id": "0"}) == "cpu"


@pytest.mark.parametrize("change, field", [
    (lambda s: s["models"]["target"]["parameters"].append({"threads": 2}), r"target.parameters\[\d+\].threads"),
    (lambda s: s["models"]["target"].update(engine="onnx"), "target.engine"),
    (lambda s: s["models"]["ssd"].update(interface="http"), "ssd.interface"),
    (lambda s: s["models"]["target"].update(instances=0), "target.instances"),
])
def test_bad_specs_name_the_field(change, field) -> None:
    s = spec("cpu_default.yaml")
    change(s)
    with pytest.raises(deploy.SpecError, match=field):
        deploy.render(s)


def test_kubernetes_replica_matches_the_gpu_spec() -> None:
    k8s = REPO / "deploy/k8s"
    docs = {d["kind"]: d for f in ("deployment.yaml", "service.yaml") for d in yaml.safe_load_all((k8s / f).read_text())}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    gpus = {g for m in spec("gpu_paper_layout.yaml")["models"].values() for g in m.get("gpus", [])}
    assert container["resources"]["limits"]["nvidia.com/gpu"] == len(gpus) == 5  # one replica = one spec
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {p["targetPort"] for p in docs["Service"]["spec"]["ports"]} <= set(ports)
    assert docs["Service"]["spec"]["selector"] == docs["Deployment"]["spec"]["selector"]["matchLabels"]
    dockerfile = (k8s / "Dockerfile").read_text()
    assert "FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3" in dockerfile
    assert "ARG SPEC=deploy/gpu_paper_layout.yaml" in dockerfile and "tools/deploy.py" in dockerfile
    for line in dockerfile.splitlines():  # every path the image copies exists
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert list(REPO.glob(src.rstrip("/"))), src
    # GPU nodes only, and the image is the one the Dockerfile's own build line tags
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    version = next(line.split('"')[1] for line in (REPO / "pyproject.toml").read_text().splitlines()
                   if line.startswith("version"))
    assert container["image"] == f"ssd-triton:{version}" and f"-t ssd-triton:{version} ." in dockerfile
    kustomize = yaml.safe_load((k8s / "kustomization.yaml").read_text())
    assert kustomize["images"][0]["newTag"] == version


def _dockerfile_runs() -> list[str]:
    """The Dockerfile's RUN and CMD instructions, continuation lines joined."""
    text = (REPO / "deploy/k8s/Dockerfile").read_text().replace("\\\n", " ")
    return [line for line in text.splitlines() if line.startswith(("RUN ", "CMD "))]


def test_the_image_keeps_tensorrt_llms_own_dependencies() -> None:
    """Nothing is pip-installed into the image's Python but the repository itself (--no-deps): its
    TensorRT-LLM pins transformers 4.x and `import tensorrt_llm` loads it. The weight conversion's
    transformers 5 / gguf live in a venv of their own, which build_engines.sh uses as PYTHON."""
    runs = _dockerfile_runs()
    for line in runs:
        for cmd in line.split("&&"):
            words = cmd.split()
            if "pip" in words and "install" in words and "build-venv" not in cmd:
                assert "--no-deps" in words and words[-1] == ".", cmd  # only the repository, editable
    venv = next(line for line in runs if "python3 -m venv" in line)
    assert "--system-site-packages /opt/ssd/build-venv" in venv and "transformers" in venv
    text = (REPO / "deploy/k8s/Dockerfile").read_text()
    assert "ENV PYTHON=/opt/ssd/build-venv/bin/python TRTLLM_PYTHON=python3 TRTLLM_EXAMPLES_DIR=/app/examples" in text
    assert "ARG TRITON_TAG=26.04\n" in text  # the first NGC tag with TensorRT-LLM 1.2.x


def test_the_container_serves_with_explicit_model_control() -> None:
    """The supervisor reloads a dead engine over the model-control API: explicit mode. The engines load
    at start, the orchestrator (its warmup calls them over BLS) once they are READY; the pod starts
    only when the orchestrator is READY."""
    import json
    import subprocess

    (cmd,) = [line for line in _dockerfile_runs() if line.startswith("CMD ")]
    assert json.loads(cmd[len("CMD "):]) == ["bash", "deploy/k8s/serve.sh"]
    script = (REPO / "deploy/k8s/serve.sh").read_text()
    assert "--model-control-mode=explicit" in script and "/v2/repository/models/$model/load" in script
    subprocess.run(["bash", "-n", str(REPO / "deploy/k8s/serve.sh")], check=True)
    (container,) = yaml.safe_load((REPO / "deploy/k8s/deployment.yaml").read_text())["spec"]["template"]["spec"][
        "containers"]
    assert container["startupProbe"]["httpGet"]["path"] == "/v2/models/ssd/ready"


def test_engines_hold_every_request_the_orchestrator_admits() -> None:
    """A drafter with fewer sequences than the orchestrator admits would evict live ones every round."""
    for name in ("cpu_default.yaml", "gpu_paper_layout.yaml"):
        deploy.render(spec(name))
    s = spec("gpu_paper_layout.yaml")
    for item in s["models"]["drafter_primary"]["parameters"]:
        if isinstance(item, dict) and "max_sequences" in item:
            item["max_sequences"] = "16"
    with pytest.raises(deploy.SpecError, match="drafter_primary.parameters.max_sequences 16.*max_active_requests 64"):
        deploy.render(s)


def test_the_shipped_engines_follow_their_profiles_runtime(tmp_path: Path) -> None:
    """No engine model of the shipped repository pins engine_backend, so an engine folder's
    `runtime` (engines/*.yaml -> engine.json) decides; a pinned value would silently win."""
    import json

    from ssd.workers.factory import _folder_runtime

    for name in ("target", "drafter_primary"):
        text = (REPO / "model_repository" / name / "config.pbtxt").read_text()
        pinned = [line for line in text.splitlines() if '"engine_backend"' in line and 'string_value: ""' not in line]
        assert not pinned, (name, pinned)
    (tmp_path / "engine.json").write_text(json.dumps({"runtime": "openvino"}))
    assert _folder_runtime(str(tmp_path)) == "openvino"
