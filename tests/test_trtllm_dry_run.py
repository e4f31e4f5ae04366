"""The TensorRT-LLM path without TensorRT-LLM: rendered build commands, runtime.json, backend choice,
and the runtime engine's plumbing against a stand-in executor module. Nothing is fetched or built."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv/bin/python") if (ROOT / ".venv/bin/python").exists() else sys.executable
CONFIG = yaml.safe_load((ROOT / "engines/default.yaml").read_text())
K = int(CONFIG["tensorrt_llm"]["max_draft_len"])
TARGETS = [n for n, s in CONFIG["engines"].items() if s["role"] == "target"]
DRAFTERS = [n for n, s in CONFIG["engines"].items() if s["role"] == "drafter"]
HAS_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
SPEC = yaml.safe_load((ROOT / "deploy/gpu_paper_layout.yaml").read_text())
SPEC_TP = len(SPEC["models"]["target"]["gpus"])  # the layout's GPUs for the target
SPEC_ACTIVE = next(int(p["max_active_requests"]) for p in SPEC["models"]["ssd"]["parameters"]
                   if isinstance(p, dict) and "max_active_requests" in p)


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": PY})


def build_line(out: str, name: str) -> str:
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("$ trtllm-build") and f"/{name} " in ln]
    assert len(lines) == 1, f"expected one trtllm-build line for {name}:\n{out}"
    return lines[0]


def test_build_engines_trtllm_dry_run_renders_commands() -> None:
    trt_before = (ROOT / "engines/trtllm").exists()
    r = run("bash", "build_engines.sh", "--backend", "tensorrt_llm", "--dry-run", "--config", "engines/default.yaml")
    assert r.returncode == 0, r.stderr
    for name in TARGETS:
        line = build_line(r.stdout, name)
        assert "--speculative_decoding_mode draft_tokens_external" in line
        assert f"--max_draft_len {K}" in line
        assert "--gather_generation_logits" in line
        assert "--use_paged_context_fmha enable" in line and "--kv_cache_type paged" in line
        for flag in ("--max_input_len", "--max_seq_len", "--max_num_tokens"):
            assert flag in line
        # the deployment spec's sizes: its target GPUs and the orchestrator's admitted requests
        assert f"--max_batch_size {SPEC_ACTIVE} " in line
    for name in DRAFTERS:  # the paper layout serves no drafter on TensorRT-LLM: no engine for nobody
        assert not [ln for ln in r.stdout.splitlines() if ln.strip().startswith("$ trtllm-build") and f"/{name} " in ln]
    assert r.stdout.count("convert_checkpoint.py") == len(TARGETS)
    assert f"--dtype bfloat16 --tp_size {SPEC_TP}" in r.stdout and "/app/examples/models/core/" in r.stdout
    assert '"enable_kv_cache_reuse": true' in r.stdout
    assert (ROOT / "engines/trtllm").exists() == trt_before  # a dry run writes nothing


def test_a_spec_that_serves_the_drafter_on_the_backend_builds_its_engine() -> None:
    """deploy/gpu_trtllm_backend.yaml serves the drafter as a tensorrtllm model (drafter_trtllm): the
    build makes it an engine of its own GPU count and the orchestrator's batch, a plain generator
    (no external drafts) that returns fp32 generation logits (the q rows of sampled drafts)."""
    spec = yaml.safe_load((ROOT / "deploy/gpu_trtllm_backend.yaml").read_text())
    served = spec["models"]["drafter_trtllm"]
    engine = next(p["engine"] for p in served["parameters"] if isinstance(p, dict) and "engine" in p)
    assert engine in DRAFTERS
    r = run("bash", "build_engines.sh", "--backend", "tensorrt_llm", "--dry-run", "--config", "engines/default.yaml",
            "--spec", "deploy/gpu_trtllm_backend.yaml")
    assert r.returncode == 0, r.stderr
    line = build_line(r.stdout, engine)
    assert "--gather_generation_logits --logits_dtype float32" in line and "--speculative_decoding_mode" not in line
    assert f"--max_batch_size {SPEC_ACTIVE} " in line
    assert r.stdout.count("convert_checkpoint.py") == len(TARGETS) + 1
    assert f"--dtype bfloat16 --tp_size {len(served['gpus'])} " in r.stdout


def test_dry_run_without_hf_folders(tmp_path: Path) -> None:
    r = run("bash", "build_engines.sh", "--backend", "tensorrt_llm", "--dry-run", "--config", "engines/default.yaml",
            "--out", str(tmp_path / "engines"))
    assert r.returncode == 0, r.stderr
    assert "would fetch" in r.stdout or "would convert" in r.stdout
    assert "is missing: build_engines.sh would convert it first" in r.stdout
    assert f"--max_draft_len {K}" in build_line(r.stdout, TARGETS[0])
    assert not (tmp_path / "engines").exists()


def test_print_json_plan_and_runtime_json(tmp_path: Path) -> None:
    # an HF folder as the transformers-5 conversion writes it: rope_theta only inside rope_parameters
    hf = tmp_path / TARGETS[0]
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": None, "vocab_size": 151936,
                                                "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}))
    r = run(PY, "tools/trtllm_build.py", "--config", "engines/default.yaml", "--engines-root", str(tmp_path),
            "--out-root", str(tmp_path / "trtllm"), "--dry-run", "--print-json")
    assert r.returncode == 0, r.stderr
    plan = {e["name"]: e for e in json.loads(r.stdout)["engines"]}
    target = plan[TARGETS[0]]
    argv = target["commands"][1]
    assert argv[0] == "trtllm-build" and argv[argv.index("--max_draft_len") + 1] == str(K)
    rt = target["files"][str(tmp_path / "trtllm" / TARGETS[0] / "runtime.json")]
    assert rt["enable_kv_cache_reuse"] is True and rt["max_draft_len"] == K and rt["role"] == "target"
    assert 0 < rt["kv_cache_free_gpu_mem_fraction"] < 1 and rt["vocab_size"] == 151936
    compat = target["files"][str(tmp_path / "trtllm/.build" / TARGETS[0] / "hf/config.json")]
    assert compat["rope_theta"] == 1e6 and compat["architectures"] == ["Qwen2ForCausalLM"]
    assert "rope_parameters" not in compat
    assert set(plan) == set(TARGETS)
    assert rt["tp_size"] == SPEC_TP and rt["max_batch_size"] == SPEC_ACTIVE


def test_auto_backend_picks_torch_here(tmp_path: Path) -> None:
    if HAS_TRTLLM and shutil.which("nvidia-smi"):
        pytest.skip("this host has TensorRT-LLM and a GPU")
    r = run("bash", "build_engines.sh", "--backend", "auto", "--dry-run", "--config", "engines/default.yaml",
            "--out", str(tmp_path / "engines"))
    assert r.returncode == 0, r.stderr
    assert "backend: torch (auto:" in r.stdout
    assert "trtllm-build" not in r.stdout and "nothing was fetched" in r.stdout


def test_real_build_refuses_without_tensorrt_llm(tmp_path: Path) -> None:
    if HAS_TRTLLM or shutil.which("trtllm-build"):
        pytest.skip("TensorRT-LLM is installed here")
    r = run(PY, "tools/trtllm_build.py", "--config", "engines/default.yaml", "--out-root", str(tmp_path / "t"))
    assert r.returncode == 2 and "TensorRT-LLM 1.2.x is not available" in r.stderr
    assert not (tmp_path / "t").exists()


def test_engine_module_imports_without_tensorrt_llm() -> None:
    if HAS_TRTLLM:
        pytest.skip("TensorRT-LLM is installed here")
    from ssd.engine.trtllm_engine import TrtllmEngine
    from ssd.workers.trtllm_target import TrtllmTargetWorker  # noqa: F401
    assert "tensorrt_llm" not in sys.modules
    with pytest.raises(RuntimeError, match="TensorRT-LLM"):
        TrtllmEngine(ROOT / "engines/trtllm" / TARGETS[0])


# -- the engine against tests/trtllm_stand_in.py (TensorRT-LLM 1.2's executor semantics) -----------
V = 50


def oracle(seq: list[int]) -> int:  # the stand-in target's greedy next token
    return (sum(seq) * 7 + len(seq)) % V


def oracle_logits(seq: list[int]) -> torch.Tensor:
    out = torch.zeros(V)
    out[oracle(seq)] = 5.0
    return out


def test_engine_plumbing_with_stand_in_executor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import trtllm_stand_in
    from ssd_tools.trtllm_build import plan_engine, settings

    from ssd.algorithm.sampling import SamplingParams
    from ssd.engine.trtllm_engine import TrtllmEngine
    from ssd.workers.protocol import VerifyCall
    from ssd.workers.trtllm_target import TrtllmTargetWorker

    s = settings(CONFIG)
    for role in ("target",):  # an HF folder whose vocab (64) is larger than the rows (V): padding
        (tmp_path / role).mkdir()
        (tmp_path / role / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 64}))
    plans = {r: plan_engine(r, {"role": r, "source": "qwen"}, s, tmp_path, tmp_path / "trt", "python")
             for r in ("target",)}
    for p in plans.values():
        p.engine_dir.mkdir(parents=True)
        (p.engine_dir / "runtime.json").write_text(json.dumps(p.files[str(p.engine_dir / "runtime.json")]))
    fake, made = trtllm_stand_in.executor_module(oracle_logits)
    pkg = types.ModuleType("tensorrt_llm")
    pkg.bindings = types.ModuleType("tensorrt_llm.bindings")
    pkg.bindings.executor = fake
    monkeypatch.setitem(sys.modules, "tensorrt_llm", pkg)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings", pkg.bindings)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings.executor", fake)

    worker = TrtllmTargetWorker(TrtllmEngine(plans["target"].engine_dir))
    ex = made[0]
    assert ex.config.kv_cache_config.enable_block_reuse is True
    prefix = [3, 1, 4]
    good = [oracle(prefix)]
    good.append(oracle(prefix + good))
    bad = [(oracle(prefix) + 1) % V, 9]
    q = torch.softmax(torch.randn(2, V), -1)
    calls = [VerifyCall("a", prefix, good), VerifyCall("b", prefix, bad), VerifyCall("c", prefix, []),
             VerifyCall("d", prefix, bad, SamplingParams(temperature=0.8), draft_probs=q)]
    res = worker.verify(calls)
    assert ex.batches == [4]  # enqueued together, answered together
    assert (res[0].accepted, res[0].token) == (2, oracle(prefix + good))
    assert (res[1].accepted, res[1].token) == (0, oracle(prefix))
    assert (res[2].accepted, res[2].token) == (0, oracle(prefix))
    sent = ex.requests[4].external_draft_tokens_config.logits  # q' travels as logits whose softmax is q' again
    assert sent.shape == (2, 64) and torch.allclose(torch.softmax(sent, -1)[:, :V], q, atol=1e-5)
    assert ex.requests[1].external_draft_tokens_config.logits is None  # greedy: token matching, no logits
    assert sent.dtype == torch.float32


def test_build_runs_with_stand_in_toolchain(tmp_path: Path) -> None:
    """The non-dry path (staging, commands, runtime.json, up-to-date check) with stand-in tools."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "site/tensorrt_llm").mkdir(parents=True)
    (tmp_path / "site/tensorrt_llm/__init__.py").write_text("")
    tool = tmp_path / "bin/trtllm-build"
    tool.write_text('#!/bin/bash\nwhile [[ $# -gt 0 ]]; do [[ $1 == --output_dir ]] && o=$2; shift; done\n'
                    'mkdir -p "$o" && echo e > "$o/rank0.engine"\n')
    tool.chmod(0o755)
    script = tmp_path / "ex/models/core/qwen/convert_checkpoint.py"
    script.parent.mkdir(parents=True)
    script.write_text("import json, os, sys\na = sys.argv\nmd = a[a.index('--model_dir') + 1]\n"
                      "assert json.load(open(md + '/config.json'))['rope_theta'] == 1e6\n"
                      "assert os.path.islink(md + '/model.safetensors')\n"
                      "os.makedirs(a[a.index('--output_dir') + 1], exist_ok=True)\n")
    for name in CONFIG["engines"]:
        (tmp_path / "eng" / name).mkdir(parents=True)
        (tmp_path / "eng" / name / "config.json").write_text(json.dumps(
            {"model_type": "qwen2", "vocab_size": 64, "rope_parameters": {"rope_theta": 1e6}}))
        (tmp_path / "eng" / name / "model.safetensors").write_text("x")
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "site"),
           "TRTLLM_EXAMPLES_DIR": str(tmp_path / "ex")}
    cmd = [PY, "tools/trtllm_build.py", "--engines-root", str(tmp_path / "eng"), "--out-root", str(tmp_path / "t")]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for name in TARGETS:
        rt = json.loads((tmp_path / "t" / name / "runtime.json").read_text())
        assert rt["enable_kv_cache_reuse"] is True and (tmp_path / "t" / name / "rank0.engine").exists()
    assert not any((tmp_path / "t" / name).exists() for name in DRAFTERS)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.count("is up to date") == len(TARGETS)


def test_engine_backend_is_selectable_and_fails_clearly_without_tensorrt_llm():
    import pytest

    from ssd.config import EngineConfig
    from ssd.workers.factory import build_worker

    with pytest.raises(ValueError, match="engine_backend"):
        EngineConfig.from_parameters({"role": "target", "engine_backend": "onnx"})
    with pytest.raises(ValueError, match="engine_backend.*target only"):
        EngineConfig.from_parameters({"role": "drafter", "engine_backend": "tensorrt_llm"})
    try:
        import tensorrt_llm  # noqa: F401
    except ImportError:  # this machine: the target on tensorrt_llm says what is missing and where it runs
        with pytest.raises(RuntimeError, match="TensorRT-LLM .* is not installed"):
            build_worker(EngineConfig.from_parameters({"role": "target", "engine_backend": "tensorrt_llm"}),
                         "/nonexistent")
    assert type(build_worker(EngineConfig.from_parameters({"role": "fast_backup"}), None)).__name__ == "NgramWorker"


def test_sizes_come_from_the_deployment_spec(tmp_path: Path) -> None:
    """tp_size is the GPUs the spec gives the engine's tensorrt_llm model, max_batch_size the
    orchestrator's max_active_requests: a layout with 2 GPUs and 24 requests builds that engine."""
    from ssd_tools.trtllm_build import BuildError, make_plans, settings

    spec = yaml.safe_load((ROOT / "deploy/gpu_paper_layout.yaml").read_text())
    spec["models"]["target"]["gpus"] = [0, 1]
    for item in spec["models"]["ssd"]["parameters"]:
        if isinstance(item, dict) and "max_active_requests" in item:
            item["max_active_requests"] = "24"
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    _, plans = make_plans(ROOT / "engines/default.yaml", tmp_path / "e", tmp_path / "t", "python", tmp_path / "spec.yaml")
    (plan,) = plans
    convert, build = plan.commands
    assert convert[convert.index("--tp_size") + 1] == "2" and build[build.index("--max_batch_size") + 1] == "24"
    with pytest.raises(BuildError, match="tp_size.*deployment spec"):
        settings({"tensorrt_llm": {"tp_size": {"target": 4}}})
    spec["models"]["target"]["parameters"] = [{"role": "target"}, {"engine": "another-model"}]
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(BuildError, match="another-model"):
        make_plans(ROOT / "engines/default.yaml", tmp_path / "e", tmp_path / "t", "python", tmp_path / "spec.yaml")


def test_the_host_check_renders_a_one_gpu_backend_layout(tmp_path: Path) -> None:
    """tools/trtllm_host_check.py (for a GPU host in the TensorRT-LLM image) in its dry run: the
    one-GPU spec renders, the target and the SD drafter are tensorrtllm models on GPU 0 whose engine
    the build plan makes with tp_size 1 and the orchestrator's 8 requests."""
    r = subprocess.run([PY, "tools/trtllm_host_check.py", "--dry-run", "--work", str(tmp_path / "w"),
                        "--out", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={"PATH": f"{Path(PY).parent}:/usr/bin:/bin", "PYTHON": PY})
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is True
    target = (tmp_path / "w/model_repository/target/config.pbtxt").read_text()
    engine = tmp_path.resolve() / "w/engines/trtllm/smollm2-135m"
    assert 'backend: "tensorrtllm"' in target and f'string_value: "{engine}"' in target
    assert 'key: "gpu_device_ids" value: { string_value: "0" }' in target
    line = build_line(r.stdout, "smollm2-135m")
    assert "--max_batch_size 8 " in line and "--tp_size 1 " in r.stdout
    # the SD drafter on the backend too, serving the tiny profile's one engine (the target's) on GPU 0
    drafter = (tmp_path / "w/model_repository/drafter_trtllm/config.pbtxt").read_text()
    assert 'backend: "tensorrtllm"' in drafter and f'string_value: "{engine}"' in drafter
    assert 'key: "gpu_device_ids" value: { string_value: "0" }' in drafter
    ssd = (tmp_path / "w/model_repository/ssd/config.pbtxt").read_text()
    assert 'key: "drafter_backend" value: { string_value: "tensorrtllm" }' in ssd
