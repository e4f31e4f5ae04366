"""The TensorRT-LLM runtime against a stand-in that behaves as TensorRT-LLM 1.2's source does
(tests/trtllm_stand_in.py). The first tests pin the stand-in's own behaviour to the source file it
comes from; the rest hold the runtime (ssd/engine/trtllm_engine.py) to it."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

import trtllm_stand_in as tle
from ssd.algorithm.sampling import SamplingParams

V = 8
P = torch.tensor([0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0])  # the sampled target's distribution at every position
N = 400  # draws per frequency; 4 standard deviations of a frequency near 0.4 are under 0.1


def sampled_target(tokens: list[int]) -> torch.Tensor:
    return torch.log(P)  # temperature 1: softmax gives P back


def greedy_target(tokens: list[int]) -> torch.Tensor:
    """Logits whose argmax depends on the whole sequence (so a wrong draft is a real mismatch)."""
    out = torch.zeros(V)
    out[(sum(tokens) * 7 + len(tokens)) % V] = 5.0
    return out


def oracle(tokens: list[int]) -> int:
    return int(greedy_target(tokens).argmax())


def write_engine(root: Path, role: str, *, max_seq_len: int = 64, max_draft_len: int = 4,
                 max_input_len: int | None = None, tp_size: int = 1) -> Path:
    """An engine folder as tools/trtllm_build.py lays it out, with small limits (``max_input_len``:
    an engine built elsewhere with a larger one)."""
    from ssd_tools.trtllm_build import plan_engine, settings

    s = settings({"tensorrt_llm": {"max_seq_len": max_seq_len, "max_draft_len": max_draft_len,
                                   "max_num_tokens": max_seq_len}})
    hf = root / "engines" / role
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": V}))
    plan = plan_engine(role, {"role": role}, s, root / "engines", root / "engines/trtllm", "python",
                       {"tp_size": tp_size})
    plan.engine_dir.mkdir(parents=True, exist_ok=True)
    rt = plan.engine_dir / "runtime.json"
    rt.write_text(json.dumps({**plan.files[str(rt)], **({"max_input_len": max_input_len} if max_input_len else {})}))
    return plan.engine_dir


def trtllm_target(**params: str):
    """The `target` model's config with engine_backend tensorrt_llm (and ``params``)."""
    from ssd.config import EngineConfig

    return EngineConfig.from_parameters({"role": "target", "engine_backend": "tensorrt_llm", **params})


def install(monkeypatch: pytest.MonkeyPatch, target, iteration_s: float = 0.001) -> list:
    import types

    module, made = tle.executor_module(target, iteration_s)
    pkg = types.ModuleType("tensorrt_llm")
    pkg.__file__ = "/stand-in/site-packages/tensorrt_llm/__init__.py"
    pkg.bindings = types.ModuleType("tensorrt_llm.bindings")
    pkg.bindings.executor = module
    monkeypatch.setitem(sys.modules, "tensorrt_llm", pkg)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings", pkg.bindings)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.bindings.executor", module)
    return made


def first_tokens(executor, draft: list[int], logits=None) -> list[int]:
    """The first output token of N sampled verify requests. With ``logits`` the one-token draft is
    drawn from their softmax q for each request, as a drafter would draw it."""
    out = []
    for seed in range(N):
        if logits is not None:
            draft = [int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=torch.Generator().manual_seed(
                N + seed)))]
        ext = tle.ExternalDraftTokensConfig(draft, logits=logits)
        rid = executor.enqueue_request(tle.Request([1, 2], len(draft) + 1, sampling_config=tle.SamplingConfig(
            temperature=1.0, top_p=1.0, seed=seed), external_draft_tokens_config=ext))
        out.append(executor.await_responses([rid])[0][-1].result.output_token_ids[0][0])
    return out


def freq(tokens: list[int], t: int) -> float:
    return sum(x == t for x in tokens) / len(tokens)


def close(observed: float, expected: float) -> bool:
    return abs(observed - expected) < 4 * math.sqrt(expected * (1 - expected) / N) + 1e-9


# -- the stand-in, behaviour by behaviour ------------------------------------------------------------
def test_kernel_without_draft_logits_redraws_from_full_p(tmp_path: Path) -> None:
    """externalDraftTokensKernels.cu: token matching, and a rejection leaves p untouched, so the
    rejected draft comes back with probability p: P(d) = p(d) + (1 - p(d)) p(d) = p(d)(2 - p(d))."""
    ex = tle.Executor(write_engine(tmp_path, "target"), None, tle.ExecutorConfig(), target=sampled_target)
    got = freq(first_tokens(ex, [0]), 0)
    assert close(got, 0.4 * (2 - 0.4)) and not close(got, 0.4)


def test_kernel_with_draft_logits_keeps_p(tmp_path: Path) -> None:
    """externalDraftTokensKernels.cu: reject when p/q < u, resample from max(0, p - q): the first
    token follows p for a draft drawn from any q (a one-hot q and a spread one)."""
    ex = tle.Executor(write_engine(tmp_path, "target"), None, tle.ExecutorConfig(), target=sampled_target)
    one_hot = torch.full((1, V), -1e4)
    one_hot[0, 0] = 0.0
    spread = torch.log(torch.tensor([[0.1, 0.1, 0.5, 0.1, 0.05, 0.05, 0.05, 0.05]]))
    for logits in (one_hot, spread):
        got = first_tokens(ex, [0], logits)
        assert all(close(freq(got, t), float(P[t])) for t in range(4)), [freq(got, t) for t in range(4)]


def test_outputs_run_to_max_tokens_and_streaming_answers_per_iteration(tmp_path: Path) -> None:
    """A verify request does not stop after accepted + 1: it decodes to max_tokens. The executor
    steps on its own thread and launches the next iteration before the first answer is out, so a
    cancel sent at once still lets one decode iteration run, whose token the last response carries."""
    ex = tle.Executor(write_engine(tmp_path, "target"), None, tle.ExecutorConfig(), target=greedy_target,
                      iteration_s=0.5)
    prefix = [3, 1, 4]
    bad = [(oracle(prefix) + 1) % V] * 4
    rid = ex.enqueue_request(tle.Request(prefix, 5, sampling_config=tle.SamplingConfig(top_k=1),
                                         external_draft_tokens_config=tle.ExternalDraftTokensConfig(bad)))
    (resp,) = ex.await_responses([rid])[0]
    assert len(resp.result.output_token_ids[0]) == 5 and ex.decode_iterations[rid] == 4
    rid = ex.enqueue_request(tle.Request(prefix, 5, streaming=True, sampling_config=tle.SamplingConfig(top_k=1),
                                         external_draft_tokens_config=tle.ExternalDraftTokensConfig(bad)))
    first = ex.await_responses([rid])[0]
    assert [len(r.result.output_token_ids[0]) for r in first] == [1] and not first[0].result.is_final
    assert ex.decode_iterations[rid] == 1  # launched before the answer reached us
    ex.cancel_request(rid)
    (last,) = ex.await_responses([rid])[0]
    assert last.result.is_final and last.result.output_token_ids[0] == [oracle(prefix + [oracle(prefix)])]
    assert ex.decode_iterations[rid] == 1
    ex.shutdown()


def test_the_executor_steps_without_anyone_awaiting(tmp_path: Path) -> None:
    """Iterations run on the executor's thread: a request finishes while nobody awaits it."""
    import time

    ex = tle.Executor(write_engine(tmp_path, "target"), None, tle.ExecutorConfig(), target=greedy_target)
    rid = ex.enqueue_request(tle.Request([3, 1, 4], 6, sampling_config=tle.SamplingConfig(top_k=1)))
    deadline = time.monotonic() + 30
    while rid not in ex.ready and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ex.decode_iterations[rid] == 5 and ex.ready[rid][-1].result.is_final
    ex.shutdown()


def test_bad_requests_get_an_error_response_not_an_exception(tmp_path: Path) -> None:
    """executorImpl.cpp fetchNewRequests: a request that fails validation is answered with an error."""
    ex = tle.Executor(write_engine(tmp_path, "target", max_seq_len=20), None, tle.ExecutorConfig(),
                      target=greedy_target)
    too_long = ex.enqueue_request(tle.Request(list(range(16)), 1))
    half = torch.zeros(1, V, dtype=torch.float16)
    fp16 = ex.enqueue_request(tle.Request([1, 2], 2, sampling_config=tle.SamplingConfig(temperature=1.0, top_p=1.0),
                                          external_draft_tokens_config=tle.ExternalDraftTokensConfig([1], logits=half)))
    fp32 = ex.enqueue_request(tle.Request([1, 2], 2, sampling_config=tle.SamplingConfig(temperature=1.0, top_p=1.0),
                                          external_draft_tokens_config=tle.ExternalDraftTokensConfig(
                                              [1], logits=half.float())))
    (a,), (b,), got = ex.await_responses([too_long, fp16, fp32])
    assert a.has_error() and "exceeds maximum input length" in a.error_msg and "fetching new request" in a.error_msg
    assert b.has_error() and "float32" in b.error_msg
    assert got and not got[-1].has_error()
    ex.shutdown()


def test_length_limits_trim_with_a_warning_only(tmp_path: Path) -> None:
    """llmRequest.h LlmRequest::validate: drafts beyond max_input_len and max_tokens beyond
    max_seq_len are cut, with a warning and no error."""
    ex = tle.Executor(write_engine(tmp_path, "target", max_seq_len=20), None, tle.ExecutorConfig(),
                      target=greedy_target)
    assert ex.max_input_len == 15  # max_seq_len - K - 1
    prompt = list(range(13))
    rid = ex.enqueue_request(tle.Request(prompt, 6, external_draft_tokens_config=tle.ExternalDraftTokensConfig(
        [1, 2, 3, 4]), sampling_config=tle.SamplingConfig(top_k=1)))
    (resp,) = ex.await_responses([rid])[0]
    assert not resp.has_error() and len(ex.warnings) == 2
    assert "draft tokens is changed to (2)" in ex.warnings[0] and "changed to (5)" in ex.warnings[1]


def test_generation_logits_need_gather_generation_logits(tmp_path: Path) -> None:
    """executorImpl.cpp: the request fails unless ExecutorConfig.gather_generation_logits is set."""
    d = write_engine(tmp_path, "drafter")
    req = tle.Request([1, 2], 2, output_config=tle.OutputConfig(return_generation_logits=True))
    ex = tle.Executor(d, None, tle.ExecutorConfig(), target=greedy_target)
    (resp,) = ex.await_responses([ex.enqueue_request(req)])[0]
    assert resp.has_error() and "gather_generation_logits" in resp.error_msg
    ex = tle.Executor(d, None, tle.ExecutorConfig(gather_generation_logits=True), target=greedy_target)
    (resp,) = ex.await_responses([ex.enqueue_request(req)])[0]
    assert resp.result.generation_logits.shape == (1, 2, V)


# -- the runtime against it -------------------------------------------------------------------------
def test_sampled_verify_of_a_deterministic_draft_follows_p(tmp_path: Path, monkeypatch) -> None:
    """An n-gram draft carries no q: the runtime must send one-hot logits, or P(d) = p(2 - p)."""
    install(monkeypatch, sampled_target)
    from ssd.engine.trtllm_engine import TrtllmEngine

    engine = TrtllmEngine(write_engine(tmp_path, "target"))
    params = SamplingParams(temperature=1.0)
    got = [engine.verify_external("s", [1, 2], [0, 1], params, seed=i) for i in range(N)]
    first = [tok if acc == 0 else 0 for acc, tok in got]
    assert all(close(freq(first, t), float(P[t])) for t in range(4)), [freq(first, t) for t in range(4)]


def verify_waste(tmp_path: Path, monkeypatch, cancel: bool) -> list[int]:
    """Decode iterations each of three fully rejected verifies runs after its answer (K = 8)."""
    import time

    made = install(monkeypatch, greedy_target, iteration_s=0.2)
    from ssd.engine.trtllm_engine import TrtllmEngine

    engine = TrtllmEngine(write_engine(tmp_path, "target", max_draft_len=8))
    ex = made[0]
    if not cancel:
        monkeypatch.setattr(ex, "cancel_request", lambda rid: None)
    prefix = [3, 1, 4]
    for i in range(3):
        seq = prefix + [i]
        accepted, token = engine.verify_external("s", seq, [(oracle(seq) + 1) % V] * 8, SamplingParams())
        assert (accepted, token) == (0, oracle(seq))
    deadline = time.monotonic() + 60
    while (ex.live or ex.queued) and time.monotonic() < deadline:  # let every request finish
        time.sleep(0.05)
    ex.shutdown()
    return [ex.decode_iterations[rid] for rid in sorted(ex.decode_iterations)]


def test_verify_cancels_after_its_first_answer(tmp_path: Path, monkeypatch) -> None:
    """A fully rejected verify of K = 8 drafts would decode 8 tokens nobody reads; cancelled on its
    first answer it decodes one (launched before the answer is out), two if the cancel misses a pass."""
    waste = verify_waste(tmp_path, monkeypatch, cancel=True)
    assert len(waste) == 3 and all(1 <= w <= 2 for w in waste), waste


def test_without_the_cancel_the_verify_decodes_to_max_tokens(tmp_path: Path, monkeypatch) -> None:
    """The control of the test above: the same verifies, cancel_request a no-op."""
    assert verify_waste(tmp_path, monkeypatch, cancel=False) == [8, 8, 8]


def test_length_limits_are_checked_before_enqueue(tmp_path: Path, monkeypatch) -> None:
    made = install(monkeypatch, greedy_target)
    from ssd.engine.trtllm_engine import TrtllmEngine

    engine = TrtllmEngine(write_engine(tmp_path, "target", max_seq_len=20, max_input_len=18))
    engine.verify_external("s", list(range(11)), [1, 2, 3, 4], SamplingParams())  # 11 + 4 + 5 fits 20 exactly
    engine.verify_external("s", list(range(15)), [], SamplingParams())  # 15 + 1 + K fits 20 exactly
    for prefix, draft, field in ((list(range(15)), [1, 2, 3, 4], "max_input_len"),
                                 (list(range(12)), [1, 2, 3, 4], "max_seq_len"),
                                 (list(range(19)), [], "max_input_len"),
                                 (list(range(16)), [], "max_seq_len")):
        with pytest.raises(ValueError, match=field):
            engine.verify_external("s", prefix, draft, SamplingParams())
    assert made[0].warnings == []


def test_a_call_over_the_limits_fails_alone(tmp_path: Path, monkeypatch) -> None:
    made = install(monkeypatch, greedy_target)
    from ssd.engine.trtllm_engine import TrtllmEngine
    from ssd.workers.protocol import CallError, VerifyCall
    from ssd.workers.trtllm_target import TrtllmTargetWorker

    worker = TrtllmTargetWorker(TrtllmEngine(write_engine(tmp_path, "target", max_seq_len=20)))
    prefix = [3, 1, 4]
    res = worker.verify([VerifyCall("long", list(range(15)), [1, 2, 3, 4]), VerifyCall("ok", prefix, [oracle(prefix)])])
    assert isinstance(res[0], CallError) and "max_input_len" in str(res[0])
    assert (res[1].accepted, res[1].token) == (1, oracle(prefix + [oracle(prefix)])) and res[1].timing
    assert made[0].batches == [1]  # only the call that fits was enqueued


def test_build_and_runtime_share_the_engine_path(tmp_path: Path, monkeypatch) -> None:
    """The build writes the engine where the served target model looks for it."""
    install(monkeypatch, greedy_target)
    from ssd.workers.factory import build_worker

    write_engine(tmp_path, "target")
    worker = build_worker(trtllm_target(), str(tmp_path / "engines/target"))
    assert worker.engine.folder == tmp_path / "engines/trtllm/target"


def test_tensor_parallel_gpus_must_match_the_build(tmp_path: Path, monkeypatch) -> None:
    made = install(monkeypatch, greedy_target)
    from ssd.workers.factory import build_worker

    write_engine(tmp_path, "target")  # tp_size 1
    build_worker(trtllm_target(gpu_device_ids="3"), str(tmp_path / "engines/target"))
    assert made[-1].config.parallel_config.device_ids == [3]
    with pytest.raises(ValueError, match="gpu_device_ids.*tp_size 1"):
        build_worker(trtllm_target(gpu_device_ids="0,1,2,3"), str(tmp_path / "engines/target"))
    write_engine(tmp_path, "target", tp_size=4)  # one process spawns a worker per GPU: no mpirun around Triton
    build_worker(trtllm_target(gpu_device_ids="0,1,2,3"), str(tmp_path / "engines/target"))
    pc = made[-1].config.parallel_config
    assert pc.device_ids == [0, 1, 2, 3] and pc.communication_mode == "ORCHESTRATOR"
    assert pc.orchestrator_config.worker_executable_path.endswith("bin/executorWorker")
