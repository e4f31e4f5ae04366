"""The orchestrator's GPU path through Triton's TensorRT-LLM backend, on CPU: the rendered
`tensorrtllm` configs (golden files), the request tensors of a verify, and a real tritonserver in
which the target is a stand-in Python model with the backend's exact config
(tests/trtllm_backend_stand_in/model.py) and the drafter the weak CI drafter, driven by the
orchestrator: greedy SD and SSD equal AR
and the in-process target, sampled verification sends fp32 draft logits, and every streamed verify
is stopped after its first answer."""
from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import PROMPTS, TARGET, WEAK
from ssd.algorithm.sampling import SamplingParams
from ssd.serving import trtllm_contract as contract
from ssd_tools import deploy

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"
GPU_SPECS = ("gpu_paper_layout", "gpu_trtllm_backend")
MAX_TOKENS = 24
MAX_INPUT_LEN = 1024  # the stand-in engines' max_input_len (a longer prompt gets an error response)
# The backend template's dtype of every input the orchestrator sends (release/1.2
# triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt, logits_datatype TYPE_FP32)
TEMPLATE_DTYPES = {"input_ids": "TYPE_INT32", "input_lengths": "TYPE_INT32", "request_output_len": "TYPE_INT32",
                   "draft_input_ids": "TYPE_INT32", "draft_logits": "TYPE_FP32", "end_id": "TYPE_INT32",
                   "temperature": "TYPE_FP32", "runtime_top_k": "TYPE_INT32", "runtime_top_p": "TYPE_FP32",
                   "seed": "TYPE_UINT64", "return_generation_logits": "TYPE_BOOL",
                   "exclude_input_in_output": "TYPE_BOOL", "stop": "TYPE_BOOL", "streaming": "TYPE_BOOL"}


def render(name: str) -> dict[str, str]:
    return deploy.render(yaml.safe_load((REPO / "deploy" / f"{name}.yaml").read_text()))


# -- rendered configs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", GPU_SPECS)
def test_gpu_configs_match_their_golden_files(spec) -> None:
    """Every rendered GPU config, byte for byte (tests/golden/<spec>/<model>.pbtxt; a change to the
    renderer or the spec shows up here as a reviewed diff of the golden file)."""
    configs = render(spec)
    golden = {p.stem: p.read_text() for p in (GOLDEN / spec).glob("*.pbtxt")}
    assert set(configs) == set(golden)
    for name, text in configs.items():
        assert text == golden[name], name


def assert_backend_model(config: str, engine: str, kv_fraction: str, gpus: str) -> None:
    """A rendered `tensorrtllm` model: the backend's template fields and tensors, its engine, KV
    share and GPUs."""
    for line in ('backend: "tensorrtllm"', "model_transaction_policy { decoupled: true }",
                 'key: "gpt_model_type" value: { string_value: "inflight_fused_batching" }',
                 f'key: "gpt_model_path" value: {{ string_value: "/opt/ssd/engines/trtllm/{engine}" }}',
                 'key: "max_beam_width" value: { string_value: "1" }',
                 'key: "enable_kv_cache_reuse" value: { string_value: "true" }',
                 f'key: "kv_cache_free_gpu_mem_fraction" value: {{ string_value: "{kv_fraction}" }}',
                 f'key: "gpu_device_ids" value: {{ string_value: "{gpus}" }}'):
        assert line in config, line
    for name, dtype in TEMPLATE_DTYPES.items():
        assert f'name: "{name}" data_type: {dtype} ' in config, name


def test_the_drafter_is_a_tensorrtllm_backend_model_beside_the_tree_drafter() -> None:
    configs = render("gpu_trtllm_backend")
    assert_backend_model(configs["drafter_trtllm"], "qwen2.5-coder-0.5b", "0.3", "4")
    ssd = configs["ssd"]
    assert 'key: "drafter_backend" value: { string_value: "tensorrtllm" }' in ssd
    assert 'key: "drafter_model" value: { string_value: "drafter_trtllm" }' in ssd
    # speculation trees stay on the torch drafter with CUDA graphs, on the same GPU
    assert 'backend: "python_ssd"' in configs["drafter_primary"] and "gpus: [ 4 ]" in configs["drafter_primary"]


def test_the_target_is_a_tensorrtllm_backend_model() -> None:
    target = render("gpu_trtllm_backend")["target"]
    assert_backend_model(target, "qwen2.5-coder-1.5b", "0.5", "0,1,2,3")
    assert "instance_group [ { kind: KIND_CPU count: 1 } ]" in target
    ssd = render("gpu_trtllm_backend")["ssd"]
    assert 'key: "target_backend" value: { string_value: "tensorrtllm" }' in ssd


def test_a_tensorrtllm_model_names_its_engine_and_gpus() -> None:
    spec = yaml.safe_load((REPO / "deploy/gpu_trtllm_backend.yaml").read_text())
    spec["models"]["target"]["parameters"] = [{"kv_cache_free_gpu_mem_fraction": "0.4"}]
    with pytest.raises(deploy.SpecError, match="target.parameters.engine"):
        deploy.render(spec)
    spec["models"]["target"]["parameters"] = [{"engine": "x"}]
    del spec["models"]["target"]["gpus"]
    with pytest.raises(deploy.SpecError, match="target.gpus"):
        deploy.render(spec)


# -- the request tensors --------------------------------------------------------------------------------
def test_a_greedy_verify_sends_drafts_and_k_plus_one_tokens_without_logits() -> None:
    req = contract.verify_request([5, 6, 7], [1, 2, 3], SamplingParams(), seed=3)
    t = req.tensors
    assert t["input_ids"].tolist() == [[5, 6, 7]] and t["input_lengths"].tolist() == [[3]]
    assert t["request_output_len"].tolist() == [[4]] and t["draft_input_ids"].tolist() == [[1, 2, 3]]
    assert t["runtime_top_k"].tolist() == [[1]] and "draft_logits" not in t and bool(t["streaming"][0, 0])
    for name, value in t.items():  # every tensor in the template's dtype
        assert value.dtype == contract.NUMPY[TEMPLATE_DTYPES[name]], name
    ar = contract.verify_request([5, 6, 7], [], SamplingParams(), seed=3).tensors
    assert ar["request_output_len"].tolist() == [[1]] and not bool(ar["streaming"][0, 0])


def test_a_sampled_verify_always_sends_fp32_draft_logits() -> None:
    params = SamplingParams(temperature=0.7)
    q = torch.softmax(torch.randn(2, 6), -1)
    t = contract.verify_request([5], [1, 4], params, seed=0, probs=q.numpy(), vocab=8).tensors
    logits = t["draft_logits"]
    assert logits.dtype == np.float32 and logits.shape == (1, 2, 8)
    assert torch.allclose(torch.softmax(torch.from_numpy(logits[0]), -1)[:, :6], q, atol=1e-5)
    one_hot = contract.verify_request([5], [1, 4], params, seed=0, vocab=8).tensors["draft_logits"][0]
    assert one_hot.argmax(-1).tolist() == [1, 4] and one_hot.dtype == np.float32
    assert float(t["runtime_top_p"][0, 0]) == 1.0 and float(t["temperature"][0, 0]) == pytest.approx(0.7)


def test_the_first_answer_gives_accepted_and_the_next_token() -> None:
    assert contract.first_answer(np.array([[[1, 2, 9]]], dtype=np.int32), [1, 2, 3]) == (2, 9)
    assert contract.first_answer(np.array([[[7]]], dtype=np.int32), [1, 2, 3]) == (0, 7)
    assert contract.first_answer(np.array([[[1, 2, 3, 4, 0, 0]]], dtype=np.int32), [1, 2, 3], 4) == (3, 4)


def test_a_draft_is_a_plain_generation_of_k_tokens() -> None:
    greedy = contract.draft_request([5, 6, 7], 3, SamplingParams(), seed=3)
    assert greedy["request_output_len"].tolist() == [[3]] and greedy["runtime_top_k"].tolist() == [[1]]
    assert not bool(greedy["streaming"][0, 0]) and greedy["end_id"].tolist() == [[contract.NO_END_ID]]
    assert "return_generation_logits" not in greedy and "draft_input_ids" not in greedy
    sampled = contract.draft_request([5, 6, 7], 2, SamplingParams(temperature=0.7, top_k=20), seed=3)
    assert bool(sampled["return_generation_logits"][0, 0]) and sampled["runtime_top_k"].tolist() == [[20]]
    for t in (greedy, sampled):
        for name, value in t.items():  # every tensor in the template's dtype
            assert value.dtype == contract.NUMPY[TEMPLATE_DTYPES[name]], name
    with pytest.raises(ValueError, match="k must be"):
        contract.draft_request([5], 0, SamplingParams(), seed=0)


def test_a_draft_answer_is_checked_against_the_backend_contract() -> None:
    ids = np.array([[[4, 5, 6, 0]]], dtype=np.int32)
    logits = np.zeros((1, 1, 4, 8), dtype=np.float32)
    toks, rows = contract.draft_answer(ids, 3, 3, logits)
    assert toks == [4, 5, 6] and rows.shape == (3, 8) and rows.dtype == np.float32
    with pytest.raises(ValueError, match="draft of 2 tokens with 3"):
        contract.draft_answer(ids, 3, 2)
    with pytest.raises(ValueError, match="float32"):
        contract.draft_answer(ids, 3, 3, logits.astype(np.float16))
    with pytest.raises(ValueError, match="2 rows for 3"):
        contract.draft_answer(ids, 3, 3, logits[:, :, :2])


# -- through a real tritonserver ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def backend_server(engine_root, tmp_path_factory):
    from ssd_tools.triton_launcher import TritonServer, _set_param, render_repository

    root = tmp_path_factory.mktemp("trtllm_backend")
    repo = render_repository(root / "models", {
        "ssd": {"tokenizer": TARGET, "num_draft_tokens": "3", "fanout_budget": "6", "target_backend": "tensorrtllm"},
        # the weak drafter (6 layers): rounds both accept and reject drafts
        "drafter_primary": {"engine": WEAK, "cores": "1", "threads": "1", "wide_cores": "0,1", "dtype": "float32"},
        "drafter_backup": {"cores": "1"},
    })
    shutil.rmtree(repo / "target")
    for name, engine in (("target", TARGET), ("drafter_trtllm", WEAK)):  # the backend's models, stood in for
        text = deploy.render_model(name, {"interface": "tensorrtllm", "gpus": [0], "max_batch_size": 64,
                                          "parameters": [{"engine": engine},
                                                         {"gpt_model_path": str(engine_root / engine)},
                                                         {"stand_in_max_input_len": str(MAX_INPUT_LEN)}]})
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(text.replace('backend: "tensorrtllm"', 'backend: "python"'))
        (repo / name / "1" / "model.py").symlink_to(REPO / "tests" / "trtllm_backend_stand_in" / "model.py")
    # a second orchestrator whose SD drafts come from the drafter model on the backend
    shutil.copytree(repo / "ssd", repo / "ssd_trtdraft")
    cfg = repo / "ssd_trtdraft" / "config.pbtxt"
    text = cfg.read_text().replace('name: "ssd"', 'name: "ssd_trtdraft"', 1)
    for key, value in (("drafter_backend", "tensorrtllm"), ("drafter_model", "drafter_trtllm"), ("supervise", "false")):
        text = _set_param(text, key, value)
    cfg.write_text(text)
    log = root / "stand_in.jsonl"
    srv = TritonServer(repo, engine_root, log_file=root / "tritonserver.log",
                       extra_env={"TRTLLM_STAND_IN_LOG": str(log)})
    srv.start(timeout=300)
    srv.stand_in_log = log
    yield srv
    srv.stop()


def events(srv) -> list[dict]:
    return [json.loads(line) for line in srv.stand_in_log.read_text().splitlines()]


def post(srv, body: dict, model: str = "ssd") -> dict:
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/{model}/generate", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read().decode())


@pytest.fixture(scope="module")
def reference(engines, codec):
    """The in-process fp32 target's greedy tokens (with the orchestrator's stop rules)."""
    from ssd.decoding.stopping import StopChecker
    from ssd.engine.engine import ExtendCall

    e, out = engines["target"], {}
    for i, p in enumerate(PROMPTS[:2]):
        seq = codec.encode_prompt(p)
        checker = StopChecker(codec.decode, MAX_TOKENS, codec.eos_ids)
        while True:
            t = int(e.extend([ExtendCall(f"trtref{i}", seq, 1)])[0][0].argmax())
            seq.append(t)
            if checker.push([t]):
                break
        e.release(f"trtref{i}")
        out[p] = checker.tokens
    return out


def test_greedy_sd_and_ssd_through_the_backend_equal_ar(backend_server, reference) -> None:
    for mode in ("ar", "sd", "ssd"):
        for prompt, ref in reference.items():
            got = post(backend_server, {"text_input": prompt, "max_tokens": MAX_TOKENS, "mode": mode})
            assert got["output_ids"] == ref, (mode, prompt)
            if mode == "sd":  # (ssd's scheduler may step aside to AR rounds)
                assert json.loads(got["stats"])["acceptance_length"] > 1.0  # drafts were accepted
    ev = events(backend_server)
    requests = [e for e in ev if e["event"] == "request"]
    assert any("draft_input_ids" in e["inputs"] for e in requests)
    for e in requests:  # the backend's dtypes, a batch dimension of 1
        for name, (dtype, shape) in e["inputs"].items():
            assert np.dtype(dtype) == contract.NUMPY[TEMPLATE_DTYPES[name]] and shape[0] == 1, (name, dtype)
        assert "draft_logits" not in e["inputs"]  # greedy: token matching


def test_every_streamed_verify_is_stopped_after_its_first_answer(backend_server, reference) -> None:
    """The orchestrator stops every verify that streams (a stop request with its Triton request id);
    for a lone request the stop lands within the stand-in's iteration, so no verify decodes the
    K + 1 tokens it asked for. (Under the calibration's 16 concurrent verifies a stop may land after
    the request ended; it is sent all the same.)"""
    n0 = len(events(backend_server))
    post(backend_server, {"text_input": PROMPTS[0], "max_tokens": MAX_TOKENS, "mode": "sd", "num_draft_tokens": 3})
    ev = events(backend_server)
    stops = {e["request_id"] for e in ev if e["event"] == "stop"}
    streamed = [e for e in ev if e["event"] == "done" and e["streaming"]]
    assert streamed and all(e["request_id"] in stops for e in streamed)
    lone = [e for e in ev[n0:] if e["event"] == "done" and e["streaming"] and e["first"] < e["drafts"] + 1]
    assert lone, "no verify of the lone request left tokens to decode after its first answer"
    for e in lone:
        assert e["stopped"] and e["first"] + e["decoded_after_first"] < e["drafts"] + 1, e


def test_sampled_verification_sends_fp32_draft_logits(backend_server) -> None:
    n0 = len(events(backend_server))
    got = post(backend_server, {"text_input": PROMPTS[2], "max_tokens": 16, "mode": "sd", "temperature": 0.8,
                                "seed": 5})
    assert len(got["output_ids"]) == 16 or got["finish_reason"] == "stop", got
    new = events(backend_server)[n0:]
    sampled = [e for e in new if e["event"] == "request" and "draft_input_ids" in e["inputs"]]
    assert sampled and not [e for e in new if e["event"] == "error"]
    for e in sampled:
        dtype, shape = e["inputs"]["draft_logits"]
        assert dtype == "float32" and shape[1] == e["inputs"]["draft_input_ids"][1][1] and shape[2] == 49152
        assert "temperature" in e["inputs"] and "runtime_top_p" in e["inputs"]


# -- SD drafting through the drafter model on the backend ------------------------------------------------
def test_greedy_sd_drafting_through_the_backend_equals_ar(backend_server, reference) -> None:
    """ssd_trtdraft drafts SD with generation requests to the stand-in drafter model: K tokens each,
    not streamed, top-k 1, no logits; the output is the target's token for token and drafts are
    accepted (the drafter model's answers were read as drafts)."""
    n0 = len(events(backend_server))
    for mode in ("sd", "ssd"):
        for prompt, ref in reference.items():
            got = post(backend_server, {"text_input": prompt, "max_tokens": MAX_TOKENS, "mode": mode,
                                        "num_draft_tokens": 3}, model="ssd_trtdraft")
            assert got["output_ids"] == ref, (mode, prompt)
            if mode == "sd":
                assert json.loads(got["stats"])["acceptance_length"] > 1.0
    new = events(backend_server)[n0:]
    drafts = [e for e in new if e["model"] == "drafter_trtllm" and e["event"] == "request"]
    assert drafts and not [e for e in new if e["event"] == "error"]
    for e in drafts:
        assert 1 <= e["scalars"]["request_output_len"] <= 3 and e["scalars"]["runtime_top_k"] == 1, e
        assert not e["scalars"]["streaming"] and "return_generation_logits" not in e["inputs"], e
        for name, (dtype, shape) in e["inputs"].items():
            assert np.dtype(dtype) == contract.NUMPY[TEMPLATE_DTYPES[name]] and shape[0] == 1, (name, dtype)
    # the verifies check exactly what the drafter model answered
    done = [e for e in new if e["model"] == "drafter_trtllm" and e["event"] == "done"]
    assert done and all(len(e["out"]) == e["asked"] for e in done)  # K asked, K drafted
    answered = {(e["prefix"], tuple(e["out"])) for e in done}
    verified = {(e["prefix"], tuple(e["draft"])) for e in new if e["model"] == "target" and e["event"] == "done"}
    assert answered & verified


def test_sampled_sd_sends_the_drafter_models_generation_logits_as_fp32_draft_logits(backend_server) -> None:
    """Sampled drafts ask for generation logits; the verify's draft_logits are fp32 and give each
    draft the probability the drafter model drew it with (q from its generation logits under the
    request's temperature), not a one-hot row."""
    n0 = len(events(backend_server))
    got = post(backend_server, {"text_input": PROMPTS[2], "max_tokens": 16, "mode": "sd", "temperature": 0.8,
                                "seed": 5, "num_draft_tokens": 3}, model="ssd_trtdraft")
    assert len(got["output_ids"]) == 16 or got["finish_reason"] == "stop", got
    new = events(backend_server)[n0:]
    assert not [e for e in new if e["event"] == "error"]
    drafts = [e for e in new if e["model"] == "drafter_trtllm" and e["event"] == "request"]
    assert drafts and all(e["scalars"]["return_generation_logits"] for e in drafts)
    assert all(e["scalars"]["temperature"] == pytest.approx(0.8) for e in drafts)
    drawn = {(e["prefix"], tuple(e["out"])): e["p_of_token"] for e in new
             if e["model"] == "drafter_trtllm" and e["event"] == "done"}
    checked = 0
    for e in new:
        if e["model"] == "target" and e["event"] == "request" and "draft_logits" in e["inputs"]:
            assert e["inputs"]["draft_logits"][0] == "float32"
        if e["model"] == "target" and e["event"] == "done" and (e["prefix"], tuple(e["draft"])) in drawn:
            p = drawn[(e["prefix"], tuple(e["draft"]))]
            assert e["q_of_draft"] == pytest.approx(p, rel=1e-4, abs=1e-6), e
            checked += 1
    assert checked, "no verify checked a draft of the drafter model"


def test_bad_draft_requests_get_the_backends_error_responses(backend_server) -> None:
    """An over-long prompt and input_lengths that disagree with input_ids are answered with an
    error response naming the limit or the field, as the backend answers them (not a hang, not a
    crash of the model)."""
    import queue

    import tritonclient.grpc as grpcclient

    def ask(ids: list[int], length: int) -> list:
        answers: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(backend_server.grpc_url)
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        tensors = {"input_ids": np.array([ids], dtype=np.int32), "input_lengths": np.array([[length]], dtype=np.int32),
                   "request_output_len": np.array([[3]], dtype=np.int32)}
        inputs = []
        for name, value in tensors.items():
            inputs.append(grpcclient.InferInput(name, list(value.shape), "INT32"))
            inputs[-1].set_data_from_numpy(value)
        client.async_stream_infer("drafter_trtllm", inputs, request_id="bad-input")
        try:
            return [answers.get(timeout=120)]
        finally:
            client.stop_stream()
            client.close()

    (result, error), = ask(list(range(1, MAX_INPUT_LEN + 2)), MAX_INPUT_LEN + 1)
    assert result is None and error is not None
    assert f"Prompt length ({MAX_INPUT_LEN + 1}) exceeds maximum input length ({MAX_INPUT_LEN})" in str(error)
    (result, error), = ask([1, 2, 3], 5)
    assert result is None and "input_lengths (5)" in str(error)
    (result, error), = ask([1, 2, 3], 3)  # and a good one is still answered: the model lives
    assert error is None and result.as_numpy("output_ids").shape == (1, 1, 3)


def test_the_host_checks_drafter_requests_hold_against_the_contract(backend_server, engines, codec) -> None:
    """tools/trtllm_host_check.py's drafter checks (run for real on a TensorRT-LLM host) against the
    stand-in drafter model: a greedy draft over the generate endpoint is the drafter's own greedy
    tokens, a sampled one brings one generation-logits row per token, an over-long prompt an error."""
    from ssd.engine.engine import ExtendCall
    from ssd_tools.trtllm_host_check import drafter_checks

    prompt = codec.encode_prompt(PROMPTS[0])
    weak, seq, own = engines["weak"], list(prompt), []
    for _ in range(4):
        own.append(int(weak.extend([ExtendCall("hostcheck", seq, 1)])[0][0].argmax()))
        seq.append(own[-1])
    weak.release("hostcheck")
    got = drafter_checks(backend_server, own, prompt, weak.vocab_size)
    assert got["ok"], got
    assert not drafter_checks(backend_server, [own[0] + 1] + own[1:], prompt, weak.vocab_size)["ok"]
