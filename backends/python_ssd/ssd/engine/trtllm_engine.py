"""The TensorRT-LLM 1.2.x engine for the target (draft_tokens_external).

Same contract as TorchEngine: a call names a sequence and its *full* token list. KV reuse is TRT-LLM's
job here: with KvCacheConfig(enable_block_reuse=True) a request whose tokens start with blocks an
earlier request left behind skips them (content-addressed, so `seq_id` is only bookkeeping and
rejected draft tokens can never leak into a later request: their blocks hash differently).

Verification is one streaming executor request per round: input = prefix,
ExternalDraftTokensConfig(draft, logits), max_tokens = len(draft) + 1. TRT-LLM checks the drafts in
the context step and answers with the accepted tokens plus one target token; left alone the request
would go on decoding plain target tokens up to max_tokens, so it is cancelled on that first answer.
That saves most of the wasted iterations, not all: 1.2's executor launches the next iteration
before it publishes the answer, and reads cancels at the top of its next pass
(executorImpl.cpp, executionLoop), so a cancelled verify decodes one more token (two when the
cancel misses a pass), which its final response carries and nobody uses.
When sampling, draft logits always travel: q' rows as log q', a deterministic draft (n-gram, greedy
drafter) as one-hot logits. Without them TRT-LLM matches the draft against a target sample and
redraws a rejected position from the full p, where the rejected token can come back (biased).
Lengths are checked here before enqueue, because TRT-LLM trims drafts or max_tokens that overflow
its limits with a warning only. tests/trtllm_stand_in.py reproduces these semantics from the source.

tensorrt_llm is imported inside the constructor, so this module imports on CPU-only machines.
"""
from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..algorithm.sampling import SamplingParams
from .engine import common_prefix

NEG = -1.0e4  # "minus infinity" for draft logits: exp underflows to 0 without inf/nan in the kernels
VERIFY_STREAM = 1  # same stream id as workers/target.py


@dataclass
class VerifyItem:
    seq_id: str
    tokens: list[int]  # verified prefix
    draft: list[int]  # empty: an AR step / the prefill
    params: SamplingParams
    draft_probs: torch.Tensor | None = None  # [len(draft), V] q' rows; None: greedy or deterministic draft
    seed: int = 0
    round: int = 0


def round_seed(seed: int, round_index: int, stream: int) -> int:
    """Per-round seed for TRT-LLM's sampler (the torch path mixes the same way in round_generator)."""
    return (seed * 1_000_003 + round_index * 8191 + stream * 131) % (2**63 - 1)


class TrtllmEngine:
    def __init__(self, folder: str | os.PathLike, *, timeout_s: float = 120.0, device_ids: list[int] | None = None):
        """``device_ids``: the GPUs of the engine, one per tensor-parallel rank (as many as the
        engine's tp_size). With more than one, the executor runs in ORCHESTRATOR mode: this
        process spawns one TRT-LLM worker per GPU over MPI (``executorWorker`` from the
        tensorrt_llm package), so tritonserver itself runs as one ordinary process."""
        try:  # lazily: importing tensorrt_llm needs CUDA and its wheels, neither exists on CPU hosts
            import tensorrt_llm.bindings.executor as tle
        except ImportError as e:
            raise RuntimeError(
                "TensorRT-LLM (tensorrt_llm 1.2.x) is not installed: TrtllmEngine runs only in the NGC "
                "tritonserver:<ver>-trtllm-python-py3 image on a GPU. Use the torch engine (TorchEngine) "
                f"here ({e})") from e
        self._tle = tle
        self.folder = Path(folder)
        rt_path = self.folder / "runtime.json"
        if not rt_path.exists():
            raise FileNotFoundError(f"{rt_path} missing: build with `bash build_engines.sh --backend tensorrt_llm`")
        self.runtime: dict[str, Any] = json.loads(rt_path.read_text())
        rt = self.runtime
        self.role: str = rt["role"]
        self.max_draft_len: int = int(rt["max_draft_len"])
        self.max_seq_len: int = int(rt["max_seq_len"])
        self.max_input_len: int = int(rt.get("max_input_len") or self.max_seq_len - self.max_draft_len - 1)
        # drafts per engine step as LlmRequest::validate counts them: a request without drafts still
        # reserves the engine's max_draft_len (0 for an engine built without speculative decoding)
        self.step_drafts = self.max_draft_len if rt.get("speculative_decoding_mode") else 0
        self.vocab_size: int | None = rt.get("vocab_size")
        self.eos_ids = set(rt.get("eos_token_ids", []))
        self.timeout = datetime.timedelta(seconds=timeout_s)
        tp = int(rt.get("tp_size", 1))
        if device_ids is not None and len(device_ids) != tp:
            raise ValueError(f"parameter 'gpu_device_ids' names {len(device_ids)} GPUs, but {self.folder} was built "
                             f"with tp_size {tp}")
        kv = tle.KvCacheConfig(enable_block_reuse=bool(rt.get("enable_kv_cache_reuse", True)),
                               free_gpu_memory_fraction=float(rt["kv_cache_free_gpu_mem_fraction"]))
        # The decoding mode (external draft tokens for the target) comes from the engine's own config.
        cfg = tle.ExecutorConfig(max_beam_width=1, kv_cache_config=kv,
                                 enable_chunked_context=bool(rt.get("enable_chunked_context", True)),
                                 gather_generation_logits=bool(rt.get("gather_generation_logits", True)))
        if device_ids is not None and tp > 1:
            import tensorrt_llm

            worker = Path(tensorrt_llm.__file__).parent / "bin" / "executorWorker"
            cfg.parallel_config = tle.ParallelConfig(
                communication_type=tle.CommunicationType.MPI, communication_mode=tle.CommunicationMode.ORCHESTRATOR,
                device_ids=list(device_ids),
                orchestrator_config=tle.OrchestratorConfig(is_orchestrator=True, worker_executable_path=str(worker)))
        elif device_ids is not None:
            cfg.parallel_config = tle.ParallelConfig(device_ids=list(device_ids))
        engine_dir = (self.folder / rt.get("engine_dir", ".")).resolve()
        self.executor = tle.Executor(str(engine_dir), tle.ModelType.DECODER_ONLY, cfg)
        self._live: dict[str, int] = {}  # seq_id -> committed length, for callers that want it
        self._cancelled: list[int] = []  # verify requests cancelled after their answer: final responses to drain

    # -- helpers ----------------------------------------------------------------------------------
    def _sampling(self, params: SamplingParams, seed: int):
        tle = self._tle
        if params.greedy:
            return tle.SamplingConfig(beam_width=1, top_k=1)
        # top_p is always explicit: TRT-LLM treats top_k == 0 with top_p unset (0) as greedy
        return tle.SamplingConfig(beam_width=1, temperature=float(params.temperature),
                                  top_k=int(params.top_k) if params.top_k > 0 else None,
                                  top_p=float(params.top_p), seed=seed)

    def _draft_logits(self, q: torch.Tensor) -> torch.Tensor:
        """q' rows -> logits whose softmax is q' again. TRT-LLM softmaxes draft logits as they are
        (no temperature / top-k / top-p), so log q' keeps the accept test min(1, p/q') exact."""
        logits = torch.log(q.float().cpu()).nan_to_num(nan=NEG, neginf=NEG).clamp_min(NEG)
        v = self.vocab_size or logits.shape[-1]
        if logits.shape[-1] < v:  # the engine's vocab may be padded beyond the drafter's rows
            logits = torch.nn.functional.pad(logits, (0, v - logits.shape[-1]), value=NEG)
        return logits.contiguous()

    def _one_hot_logits(self, draft: list[int]) -> torch.Tensor:
        """A deterministic draft's q: all mass on the drafted token. The accept test is then
        u < p(d) and the residual max(0, p - q) is p without d: exactly the target's p."""
        logits = torch.full((len(draft), self.vocab_size or max(draft) + 1), NEG)
        logits[torch.arange(len(draft)), torch.tensor(draft)] = 0.0
        return logits

    def check_lengths(self, prompt: int, draft: int, max_tokens: int) -> None:
        """LlmRequest::validate's limits, as errors: TRT-LLM would trim silently instead."""
        if prompt + draft > self.max_input_len:
            raise ValueError(f"prefix of {prompt} tokens + {draft} draft tokens exceeds the engine's max_input_len "
                             f"{self.max_input_len}")
        per_step = draft or self.step_drafts
        if prompt + max_tokens + per_step > self.max_seq_len:
            raise ValueError(f"prefix of {prompt} tokens + {max_tokens} new + {per_step} draft tokens per step exceeds "
                             f"the engine's max_seq_len {self.max_seq_len}")

    def check_verify(self, prefix: int, draft: int) -> None:
        """A verify of ``draft`` tokens after ``prefix`` fits the engine, or a ValueError says why."""
        if prefix < 1:
            raise ValueError("tokens must not be empty")
        if draft > self.max_draft_len:
            raise ValueError(f"draft of {draft} tokens exceeds the engine's max_draft_len {self.max_draft_len}")
        self.check_lengths(prefix, draft, draft + 1)

    def _drain_cancelled(self) -> None:
        """Collects the final responses of cancelled verify requests (no wait)."""
        if not self._cancelled:
            return
        got = self.executor.await_responses(ids=list(self._cancelled), timeout=datetime.timedelta(0))
        for rid, responses in zip(list(self._cancelled), got):
            if any(r.has_error() or r.result.is_final for r in responses):
                self._cancelled.remove(rid)

    def _first_answers(self, ids: list[int]) -> dict[int, list[int]]:
        """Per streaming request: the tokens of its first answer; a request that is not final then
        is cancelled (its last response, drained later, may carry one more token)."""
        got_all: dict[int, list[int]] = {}
        pending = list(ids)
        while pending:
            got = self.executor.await_responses(ids=pending, timeout=self.timeout)
            if not any(got):
                raise TimeoutError(f"TensorRT-LLM: no response within {self.timeout} for {len(pending)} requests")
            for rid, responses in zip(list(pending), got):
                if not responses:
                    continue
                r = responses[0]
                if r.has_error():
                    raise RuntimeError(f"TensorRT-LLM request {rid} failed: {r.error_msg}")
                got_all[rid] = [int(t) for t in r.result.output_token_ids[0]]
                pending.remove(rid)
                if not any(x.result.is_final for x in responses if not x.has_error()):
                    self.executor.cancel_request(rid)
                    self._cancelled.append(rid)
        return got_all

    # -- target: verification ---------------------------------------------------------------------
    def verify_batch(self, items: list[VerifyItem]) -> list[tuple[int, int]]:
        """Enqueues every item, then awaits all: in-flight batching batches them on the GPU."""
        tle = self._tle
        self._drain_cancelled()
        requests = []
        for it in items:
            self.check_verify(len(it.tokens), len(it.draft))
        for it in items:
            ext = None
            if it.draft:
                logits = None  # greedy: token matching against the argmax is exact
                if not it.params.greedy:
                    logits = (self._draft_logits(it.draft_probs) if it.draft_probs is not None
                              else self._one_hot_logits(it.draft))
                ext = tle.ExternalDraftTokensConfig(list(it.draft), logits=logits)
            out_cfg = tle.OutputConfig(exclude_input_from_output=True)
            requests.append(tle.Request(
                input_token_ids=list(it.tokens), max_tokens=len(it.draft) + 1, streaming=bool(it.draft),
                sampling_config=self._sampling(it.params, round_seed(it.seed, it.round, VERIFY_STREAM)),
                output_config=out_cfg, external_draft_tokens_config=ext))
        ids = list(self.executor.enqueue_requests(requests))
        answers = self._first_answers(ids)
        out = []
        for it, rid in zip(items, ids):
            new = answers[rid]
            if not new:
                raise RuntimeError(f"TensorRT-LLM returned no token for sequence {it.seq_id}")
            # The first answer is the accepted drafts plus one target token (the correction or the
            # bonus), and that token never equals the draft at its position (greedy: a mismatch;
            # sampled: the residual is 0 at a rejected token), so the common prefix is the count.
            accepted = min(common_prefix(new, it.draft), len(new) - 1)
            self._live[it.seq_id] = len(it.tokens) + accepted + 1
            out.append((accepted, int(new[accepted])))
        return out

    def verify_external(self, seq_id: str, tokens: list[int], draft: list[int], params: SamplingParams, *,
                        draft_probs: torch.Tensor | None = None, seed: int = 0, round_index: int = 0
                        ) -> tuple[int, int]:
        """-> (accepted, target token)."""
        return self.verify_batch([VerifyItem(seq_id, tokens, draft, params, draft_probs, seed, round_index)])[0]

    # -- bookkeeping ------------------------------------------------------------------------------
    def release(self, seq_id: str) -> None:
        # Nothing to free: finished requests hand their blocks to the reuse pool, which evicts LRU.
        self._live.pop(seq_id, None)

    def shutdown(self) -> None:
        self.executor.shutdown()
