"""A stand-in for `tensorrt_llm.bindings.executor` (TensorRT-LLM 1.2) that behaves as its source does.

TensorRT-LLM needs a GPU, so the runtime's tests run against this module instead. Each behaviour
below is read from TensorRT-LLM's own source (NVIDIA/TensorRT-LLM), named where it is reproduced:

- `cpp/include/tensorrt_llm/batch_manager/llmRequest.h` (`LlmRequest::validate`): a prompt over
  max_input_len is an error; more draft tokens than the engine's max_draft_len is an error;
  prompt + drafts over max_input_len trims the drafts, and prompt + max_tokens + drafts-per-step
  over max_seq_len trims max_tokens, both with a warning only. Without drafts, drafts-per-step is
  the engine's max_draft_len.
- `cpp/tensorrt_llm/kernels/speculativeDecoding/externalDraftTokensKernels.cu`
  (`acceptDraftTokensKernel`, `maskTargetLogitsKernel`) and `cpp/tensorrt_llm/layers/
  externalDraftTokensLayer.cpp`: with draft logits (softmaxed as given, no temperature), draft d is
  rejected when p(d) / q(d) < u, and the rejected position is sampled from max(0, p - q)
  renormalised. Without draft logits, d is accepted when it equals a token sampled from p; on a
  rejection p is left as it is, so the position is redrawn from the full p (the rejected token can
  come back). After all drafts are accepted the next token is sampled from p.
- The context step returns the accepted drafts plus one token; the request then keeps decoding
  one token per iteration until max_tokens (`cpp/tensorrt_llm/batch_manager/` generation loop).
  A streaming request answers after every iteration with the tokens it added; `cancel_request`
  ends it before the next iteration with a final response.
- `cpp/tensorrt_llm/executor/executorImpl.cpp`: a request asking for generation logits fails
  unless `ExecutorConfig.gather_generation_logits` is set ("To return generation logits,
  gather_generation_logits must be enabled in ExecutorConfig").
- Names and keywords of the classes: `cpp/tensorrt_llm/nanobind/executor/request.cpp`,
  `executorConfig.cpp` (ParallelConfig, OrchestratorConfig), `executor.cpp`.

The model is a callable ``target(tokens) -> logits [vocab]``. Iterations run when a caller awaits
an unanswered, unfinished request (every active request advances one step: in-flight batching),
and are counted: ``iterations`` in all, ``decode_iterations[id]`` after a request's context step.
The engine's limits come from the engine folder's runtime.json (what trtllm-build's config.json
holds on a GPU host).
"""
from __future__ import annotations

import json
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

GATHER_ERROR = "To return generation logits, gather_generation_logits must be enabled in ExecutorConfig"


class _Kw:
    def __init__(self, *args, **kw):
        self.__dict__.update(kw)


class KvCacheConfig(_Kw):
    pass


class ExecutorConfig(_Kw):
    def __init__(self, max_beam_width: int = 1, kv_cache_config=None, enable_chunked_context: bool = False,
                 gather_generation_logits: bool = False, parallel_config=None, **kw):
        super().__init__(max_beam_width=max_beam_width, kv_cache_config=kv_cache_config,
                         enable_chunked_context=enable_chunked_context,
                         gather_generation_logits=gather_generation_logits, parallel_config=parallel_config, **kw)


CommunicationType = types.SimpleNamespace(MPI="MPI")
CommunicationMode = types.SimpleNamespace(LEADER="LEADER", ORCHESTRATOR="ORCHESTRATOR")


class OrchestratorConfig(_Kw):
    def __init__(self, is_orchestrator: bool = True, worker_executable_path: str = "", orch_leader_comm=None,
                 spawn_processes: bool = True):
        super().__init__(is_orchestrator=is_orchestrator, worker_executable_path=worker_executable_path)


class ParallelConfig(_Kw):
    def __init__(self, communication_type="MPI", communication_mode="LEADER", device_ids=None, participant_ids=None,
                 orchestrator_config=None, num_nodes=None):
        super().__init__(communication_type=communication_type, communication_mode=communication_mode,
                         device_ids=device_ids, participant_ids=participant_ids,
                         orchestrator_config=orchestrator_config)


class SamplingConfig(_Kw):
    def __init__(self, beam_width: int = 1, top_k=None, top_p=None, temperature=None, seed=None, **kw):
        super().__init__(beam_width=beam_width, top_k=top_k, top_p=top_p, temperature=temperature, seed=seed, **kw)


class OutputConfig(_Kw):
    def __init__(self, return_log_probs: bool = False, return_context_logits: bool = False,
                 return_generation_logits: bool = False, exclude_input_from_output: bool = False, **kw):
        super().__init__(return_generation_logits=return_generation_logits,
                         exclude_input_from_output=exclude_input_from_output, **kw)


class ExternalDraftTokensConfig:
    def __init__(self, tokens, logits=None, acceptance_threshold=None, fast_logits=None):
        self.tokens, self.logits, self.acceptance_threshold = list(tokens), logits, acceptance_threshold


class Request(_Kw):
    def __init__(self, input_token_ids, max_tokens, streaming: bool = False, sampling_config=None,
                 output_config=None, end_id=None, external_draft_tokens_config=None, **kw):
        super().__init__(input_token_ids=list(input_token_ids), max_tokens=int(max_tokens), streaming=streaming,
                         sampling_config=sampling_config or SamplingConfig(), output_config=output_config or
                         OutputConfig(), end_id=end_id, external_draft_tokens_config=external_draft_tokens_config,
                         **kw)


@dataclass
class Result:
    output_token_ids: list[list[int]]
    is_final: bool
    generation_logits: torch.Tensor | None = None


@dataclass
class Response:
    request_id: int
    result: Result | None = None
    error_msg: str = ""

    def has_error(self) -> bool:
        return bool(self.error_msg)


@dataclass
class _Live:
    request: Request
    drafts: list[int]
    max_tokens: int
    gen: torch.Generator | None
    out: list[int] = field(default_factory=list)
    started: bool = False


class Executor:
    def __init__(self, engine_dir: str, model_type, config: ExecutorConfig, *,
                 target: Callable[[list[int]], torch.Tensor]):
        rt = json.loads((Path(engine_dir) / "runtime.json").read_text())
        self.config, self.target = config, target
        self.max_input_len, self.max_seq_len = int(rt["max_input_len"]), int(rt["max_seq_len"])
        external = rt.get("speculative_decoding_mode") == "draft_tokens_external"
        self.max_draft_len = int(rt["max_draft_len"]) if external else 0
        self.vocab_padded = int(rt["vocab_size"])
        self.live: dict[int, _Live] = {}
        self.ready: dict[int, list[Response]] = {}
        self.warnings: list[str] = []
        self.iterations = 0
        self.decode_iterations: dict[int, int] = {}
        self.requests: dict[int, Request] = {}  # every request enqueued, for tests to inspect
        self.batches: list[int] = []  # sizes of enqueue_requests calls
        self._next_id = 1

    # -- enqueue: LlmRequest::validate ------------------------------------------------------------
    def enqueue_request(self, request: Request) -> int:
        rid, self._next_id = self._next_id, self._next_id + 1
        self.requests[rid] = request
        prompt = len(request.input_token_ids)
        ext = request.external_draft_tokens_config
        drafts = list(ext.tokens) if ext else []
        error = ""
        if prompt > self.max_input_len:
            error = f"Prompt length ({prompt}) exceeds maximum input length ({self.max_input_len})."
        elif len(drafts) > self.max_draft_len:
            error = f"Draft tokens length ({len(drafts)}) exceeds maximum draft tokens length ({self.max_draft_len})."
        if error:
            raise RuntimeError(error)
        per_step = self.max_draft_len
        if drafts:
            per_step = len(drafts)
            if prompt + per_step > self.max_input_len:
                per_step = self.max_input_len - prompt
                self.warnings.append(f"Prompt length + number of draft tokens ({prompt} + {len(drafts)}) exceeds "
                                     f"maximum input length ({self.max_input_len}).Number of draft tokens is "
                                     f"changed to ({per_step})")
                drafts = drafts[:per_step]
        max_tokens = request.max_tokens
        if prompt + max_tokens + per_step > self.max_seq_len:
            max_tokens = self.max_seq_len - prompt - per_step
            self.warnings.append(f"Prompt length + number of requested output tokens + draft tokens per step "
                                 f"({prompt} + {request.max_tokens} + {per_step}) exceeds maximum sequence length "
                                 f"({self.max_seq_len}). Number of requested output tokens is changed to ({max_tokens}).")
        if request.output_config.return_generation_logits and not self.config.gather_generation_logits:
            self.ready[rid] = [Response(rid, error_msg=GATHER_ERROR)]  # executorImpl.cpp: the request fails
            return rid
        if ext is not None and ext.logits is not None:
            shape = tuple(torch.as_tensor(ext.logits).shape)
            if shape != (len(ext.tokens), self.vocab_padded):
                raise ValueError(f"stand-in: draft logits must be [draft tokens, padded vocab] = "
                                 f"({len(ext.tokens)}, {self.vocab_padded}), got {shape}")
        seed = request.sampling_config.seed
        gen = torch.Generator().manual_seed(int(seed)) if seed is not None else torch.Generator()
        self.live[rid] = _Live(request, drafts, max_tokens, gen)
        self.decode_iterations[rid] = 0
        return rid

    def enqueue_requests(self, requests: list[Request]) -> list[int]:
        self.batches.append(len(requests))
        return [self.enqueue_request(r) for r in requests]

    def cancel_request(self, rid: int) -> None:
        """The request ends before the next iteration; its final response carries no tokens."""
        r = self.live.get(rid)
        if r is not None:
            self._answer(rid, r, [], final=True)

    # -- the model's distribution, after temperature / top-k / top-p ------------------------------
    def _p(self, tokens: list[int], sc: SamplingConfig) -> torch.Tensor:
        logits = torch.as_tensor(self.target(tokens)).float()
        logits = torch.nn.functional.pad(logits, (0, self.vocab_padded - logits.numel()), value=float("-inf"))
        if sc.top_k == 1 or not (sc.top_k or sc.top_p):  # top_k 0 with top_p 0: greedy
            return torch.nn.functional.one_hot(logits.argmax(), self.vocab_padded).float()
        x = logits / float(sc.temperature or 1.0)
        if sc.top_k:
            x = x.masked_fill(x < torch.topk(x, int(sc.top_k)).values[-1], float("-inf"))
        p = torch.softmax(x, -1)
        if sc.top_p is not None and sc.top_p < 1.0:
            sp, idx = torch.sort(p, descending=True)
            sp = sp.masked_fill(sp.cumsum(-1) - sp >= sc.top_p, 0.0)
            p = torch.zeros_like(p).scatter_(-1, idx, sp)
            p = p / p.sum()
        return p

    @staticmethod
    def _draw(p: torch.Tensor, gen: torch.Generator) -> int:
        return int(torch.multinomial(p, 1, generator=gen))

    # -- one iteration of every live request ------------------------------------------------------
    def _context_step(self, r: _Live) -> list[int]:
        """externalDraftTokensKernels.cu: the drafts' acceptance, then one token."""
        sc, seq, new = r.request.sampling_config, list(r.request.input_token_ids), []
        ext = r.request.external_draft_tokens_config
        q = torch.softmax(torch.as_tensor(ext.logits).float(), -1) if ext is not None and ext.logits is not None else None
        for i, d in enumerate(r.drafts):
            p = self._p(seq, sc)
            if q is not None:  # reject when p(d)/q(d) < u; then sample max(0, p - q)
                u = ext.acceptance_threshold  # a constant threshold when given, else uniform per draft
                u = float(torch.rand((), generator=r.gen)) if u is None else float(u)
                if float(p[d]) / max(float(q[i, d]), 1e-30) < u:
                    res = (p - q[i]).clamp_min(0)
                    return new + [self._draw(res / res.sum(), r.gen)]
            elif self._draw(p, r.gen) != d:  # token matching; a rejection redraws from the full p
                return new + [self._draw(p, r.gen)]
            new.append(d)
            seq.append(d)
        return new + [self._draw(self._p(seq, sc), r.gen)]

    def _iterate(self) -> None:
        self.iterations += 1
        for rid, r in list(self.live.items()):
            if not r.started:
                r.started = True
                added = self._context_step(r)
            else:
                self.decode_iterations[rid] += 1
                added = [self._draw(self._p(list(r.request.input_token_ids) + r.out, r.request.sampling_config), r.gen)]
            added = added[: r.max_tokens - len(r.out)]
            r.out += added
            final = len(r.out) >= r.max_tokens or (r.request.end_id is not None and r.request.end_id in added)
            if r.request.streaming or final:
                self._answer(rid, r, added if r.request.streaming else r.out, final)

    def _answer(self, rid: int, r: _Live, tokens: list[int], final: bool) -> None:
        logits = None
        if r.request.output_config.return_generation_logits:
            start = len(r.out) - len(tokens)
            rows = [torch.as_tensor(self.target(list(r.request.input_token_ids) + r.out[:start + i])).float()
                    for i in range(len(tokens))]
            logits = torch.stack(rows)[None] if rows else torch.zeros(1, 0, self.vocab_padded)
        self.ready.setdefault(rid, []).append(Response(rid, Result([list(tokens)], final, logits)))
        if final:
            del self.live[rid]

    def await_responses(self, ids: list[int] | None = None, timeout=None) -> list[list[Response]]:
        ids = list(ids) if ids is not None else list(self.live)
        while any(i not in self.ready and i in self.live for i in ids):
            self._iterate()
        return [self.ready.pop(i, []) for i in ids]

    def shutdown(self) -> None:
        self.live.clear()


def executor_module(target: Callable[[list[int]], torch.Tensor]) -> tuple[types.ModuleType, list[Executor]]:
    """The stand-in module, and the list each Executor it creates is appended to."""
    m = types.ModuleType("tensorrt_llm.bindings.executor")
    made: list[Executor] = []

    def make_executor(engine_dir, model_type, config):
        made.append(Executor(engine_dir, model_type, config, target=target))
        return made[-1]

    m.CommunicationType, m.CommunicationMode = CommunicationType, CommunicationMode
    for cls in (KvCacheConfig, ExecutorConfig, ParallelConfig, OrchestratorConfig, SamplingConfig, OutputConfig, ExternalDraftTokensConfig, Request):
        setattr(m, cls.__name__, cls)
    m.Executor = make_executor
    m.ModelType = types.SimpleNamespace(DECODER_ONLY="decoder_only")
    return m, made
