"""The contract of Triton's TensorRT-LLM backend (`backend: "tensorrtllm"`, the 1.2-era release):
the tensors a verify request (to the target model) and a draft request (to the drafter model) send
and read, with their names, dtypes and dims, and how a round's VerifyCall and DraftCall map onto
them. numpy only, so the deployment renderer and the tests use it too.

Source: TensorRT-LLM release/1.2 `triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/
config.pbtxt` (the model's inputs, outputs and parameters) and `triton_backend/inflight_batcher_llm/
src/model_instance_state.cc` (`handleStopRequest`: a request with `stop` true and the Triton request
id of an earlier one cancels it and is answered with one empty final response; `WaitForCancel`: a
Triton-cancelled request is noticed every `cancellation_check_period_ms`). The model is decoupled;
with `streaming` true it answers after every iteration with the tokens it added
(`exclude_input_in_output` true: only new tokens), and a verify's first answer is the accepted drafts
plus one target token, as the executor's (engine/trtllm_engine.py). A draft is a plain generation
of K tokens, non-streaming, as `tensorrt_llm_bls` asks its draft model for drafts (`_spec_generate`
in `triton_backend/all_models/inflight_batcher_llm/tensorrt_llm_bls/1/lib/decode.py`): its one
answer carries `output_ids` [1, beam, K] and, with `return_generation_logits`, `generation_logits`
[1, beam, K, padded vocab] fp32, the raw logits each drafted token was sampled from.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# name -> (Triton dtype, dims without the batch dimension, optional). Scalars are dims [1] with
# reshape { shape: [ ] } in the backend's template.
INPUTS: dict[str, tuple[str, list[int], bool]] = {
    "input_ids": ("TYPE_INT32", [-1], True),
    "input_lengths": ("TYPE_INT32", [1], False),
    "request_output_len": ("TYPE_INT32", [1], False),
    "draft_input_ids": ("TYPE_INT32", [-1], True),
    "draft_logits": ("TYPE_FP32", [-1, -1], True),  # ${logits_datatype}: fp32 for --logits_dtype float32
    "end_id": ("TYPE_INT32", [1], True),
    "temperature": ("TYPE_FP32", [1], True),
    "runtime_top_k": ("TYPE_INT32", [1], True),
    "runtime_top_p": ("TYPE_FP32", [1], True),
    "seed": ("TYPE_UINT64", [1], True),
    "return_generation_logits": ("TYPE_BOOL", [1], True),
    "exclude_input_in_output": ("TYPE_BOOL", [1], True),
    "stop": ("TYPE_BOOL", [1], True),
    "streaming": ("TYPE_BOOL", [1], True),
}
RAGGED = {"input_ids", "draft_input_ids", "draft_logits"}  # allow_ragged_batch in the template
OUTPUTS: dict[str, tuple[str, list[int]]] = {
    "output_ids": ("TYPE_INT32", [-1, -1]),  # [beam, tokens]
    "sequence_length": ("TYPE_INT32", [-1]),  # [beam]
    "cum_log_probs": ("TYPE_FP32", [-1]),
    "output_log_probs": ("TYPE_FP32", [-1, -1]),
    "context_logits": ("TYPE_FP32", [-1, -1]),
    "generation_logits": ("TYPE_FP32", [-1, -1, -1]),
    "batch_index": ("TYPE_INT32", [1]),
    "sequence_index": ("TYPE_INT32", [1]),
}
NUMPY = {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32, "TYPE_UINT64": np.uint64, "TYPE_BOOL": np.bool_}
NEG = -1.0e4  # "minus infinity" for draft logits, as engine/trtllm_engine.py sends them
NO_END_ID = -1  # a verify must not stop at an end token before its answer: the orchestrator stops generations


@dataclass
class VerifyRequest:
    """One verify as the backend's tensors (each with the batch dimension 1)."""

    tensors: dict[str, np.ndarray]
    draft: list[int]


def _scalar(name: str, value) -> np.ndarray:
    return np.array([[value]], dtype=NUMPY[INPUTS[name][0]])


def draft_logits(draft: list[int], probs, vocab: int) -> np.ndarray:
    """[len(draft), vocab] fp32 logits whose softmax is the drafter's q' rows (log q'), or one-hot
    logits for a deterministic draft (n-gram, greedy drafter): TensorRT-LLM softmaxes them as they
    are, so the accept test min(1, p/q') stays exact (engine/trtllm_engine.py says why)."""
    if probs is None:
        out = np.full((len(draft), vocab), NEG, dtype=np.float32)
        out[np.arange(len(draft)), np.asarray(draft)] = 0.0
        return out
    q = np.asarray(probs, dtype=np.float32)
    with np.errstate(divide="ignore"):
        logits = np.maximum(np.log(q), NEG).astype(np.float32)
    if logits.shape[-1] < vocab:  # the engine's vocab may be padded beyond the drafter's rows
        logits = np.pad(logits, ((0, 0), (0, vocab - logits.shape[-1])), constant_values=NEG)
    return np.ascontiguousarray(logits)


def verify_request(tokens: list[int], draft: list[int], params, seed: int, probs=None,
                   vocab: int = 0) -> VerifyRequest:
    """A verify of ``draft`` after ``tokens``: request_output_len K + 1 and, when sampling, draft
    logits always (``vocab``: the engine's padded vocabulary; 0: the rows' own width). Greedy sends
    top_k 1 and no logits: token matching against the argmax is exact."""
    if not tokens:
        raise ValueError("tokens must not be empty")
    t = {"input_ids": np.array([tokens], dtype=np.int32), "input_lengths": _scalar("input_lengths", len(tokens)),
         "request_output_len": _scalar("request_output_len", len(draft) + 1),
         "end_id": _scalar("end_id", NO_END_ID), "exclude_input_in_output": _scalar("exclude_input_in_output", True),
         "streaming": _scalar("streaming", bool(draft)), "seed": _scalar("seed", seed % (2**63 - 1))}
    if params.greedy:
        t["runtime_top_k"] = _scalar("runtime_top_k", 1)
    else:
        t["temperature"] = _scalar("temperature", float(params.temperature))
        t["runtime_top_p"] = _scalar("runtime_top_p", float(params.top_p))  # explicit: top_k 0 + top_p 0 is greedy
        if params.top_k > 0:
            t["runtime_top_k"] = _scalar("runtime_top_k", int(params.top_k))
    if draft:
        t["draft_input_ids"] = np.array([draft], dtype=np.int32)
        if not params.greedy:
            width = vocab or (probs.shape[-1] if probs is not None else max(draft) + 1)
            t["draft_logits"] = draft_logits(draft, probs, width)[None]
    return VerifyRequest(t, list(draft))


def draft_request(tokens: list[int], k: int, params, seed: int) -> dict[str, np.ndarray]:
    """A plain generation of ``k`` draft tokens after ``tokens``: non-streaming, no end token (a
    draft runs its K tokens whatever it meets: the orchestrator's stop rules apply to verified
    tokens only). Greedy sends top_k 1; sampling sends the request's temperature / top-p / top-k
    and asks for the generation logits, the q the verifier needs (``draft_probs``)."""
    if not tokens:
        raise ValueError("tokens must not be empty")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    t = {"input_ids": np.array([tokens], dtype=np.int32), "input_lengths": _scalar("input_lengths", len(tokens)),
         "request_output_len": _scalar("request_output_len", k), "end_id": _scalar("end_id", NO_END_ID),
         "exclude_input_in_output": _scalar("exclude_input_in_output", True),
         "streaming": _scalar("streaming", False), "seed": _scalar("seed", seed % (2**63 - 1))}
    if params.greedy:
        t["runtime_top_k"] = _scalar("runtime_top_k", 1)
    else:
        t["temperature"] = _scalar("temperature", float(params.temperature))
        t["runtime_top_p"] = _scalar("runtime_top_p", float(params.top_p))
        if params.top_k > 0:
            t["runtime_top_k"] = _scalar("runtime_top_k", int(params.top_k))
        t["return_generation_logits"] = _scalar("return_generation_logits", True)
    return t


def draft_answer(output_ids: np.ndarray, length: int | None, k: int,
                 generation_logits: np.ndarray | None = None) -> tuple[list[int], np.ndarray | None]:
    """(draft tokens, their generation logits [n, vocab] fp32 or None) from a draft request's
    answer; refuses an answer that is not the backend's (too many tokens, logits that are not fp32
    or not one row a token)."""
    toks = [int(x) for x in np.asarray(output_ids).reshape(-1)]
    if length is not None:
        toks = toks[:length]
    if not toks or len(toks) > k:
        raise ValueError(f"the TensorRT-LLM backend answered a draft of {k} tokens with {len(toks)}")
    if generation_logits is None:
        return toks, None
    logits = np.asarray(generation_logits)
    if logits.dtype != np.float32:
        raise ValueError(f"generation_logits must be float32 (--logits_dtype float32), got {logits.dtype}")
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.shape[0] < len(toks):
        raise ValueError(f"generation_logits hold {rows.shape[0]} rows for {len(toks)} draft tokens")
    return toks, rows[:len(toks)]


def stop_request() -> dict[str, np.ndarray]:
    """The tensors of a stop request (sent with the Triton request id of the verify to stop); the
    two required inputs must be present, their values are not read."""
    return {"input_lengths": _scalar("input_lengths", 1), "request_output_len": _scalar("request_output_len", 1),
            "stop": _scalar("stop", True)}


def first_answer(output_ids: np.ndarray, draft: list[int], length: int | None = None) -> tuple[int, int]:
    """(accepted, target token) from a verify's first response (``length``: its sequence_length, the
    valid tokens of a padded non-streaming answer): the accepted drafts plus one target token, which
    never equals the draft at its position, so the common prefix is the count."""
    new = [int(x) for x in np.asarray(output_ids).reshape(-1)]
    if length is not None:
        new = new[:length]
    if not new:
        raise ValueError("the TensorRT-LLM backend answered a verify with no token")
    accepted = 0
    while accepted < min(len(draft), len(new) - 1) and new[accepted] == draft[accepted]:
        accepted += 1
    return accepted, new[accepted]
