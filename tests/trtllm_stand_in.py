"""A stand-in for `tensorrt_llm.bindings.executor` (TensorRT-LLM 1.2) that behaves as its source does.

TensorRT-LLM needs a GPU, so the runtime's tests run against this module instead. Each behaviour
below is read from TensorRT-LLM's own source (NVIDIA/TensorRT-LLM, release/1.2), named where it is
reproduced:

- `cpp/tensorrt_llm/executor/executorImpl.cpp` (`Executor::Impl::executionLoop`): the executor
  steps on its own thread, not inside `await_responses`. One pass of its loop: terminate the
  requests cancelled so far (`terminateCancelledRequests`), wait for the iteration in flight
  (`forwardSync`), publish its responses (`populateNewResponses`, `enqueueNewResponses`), fetch the
  newly enqueued requests (`fetchNewRequests`), then launch the next iteration for every active
  request (`forwardAsync`). So the next decode step of a streaming request is already running when
  its answer reaches Python, and a cancel takes effect at the next pass: the final response of a
  cancelled request carries the token(s) of the iteration that was in flight.
- Same file, `fetchNewRequests`: a request that fails validation (`LlmRequest::validate`, the
  generation-logits check) does not raise at enqueue; it gets an error response
  ("Encountered an error when fetching new request: ...").
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
- `executorImpl.cpp` (`fetchNewRequests`): a request asking for generation logits fails unless
  `ExecutorConfig.gather_generation_logits` is set ("To return generation logits,
  gather_generation_logits must be enabled in ExecutorConfig").
- Draft logits are [draft tokens, padded vocab] in the engine's logits dtype: float32 for engines
  built with `--logits_dtype float32` (the backend's `draft_logits` input is `${logits_datatype}`,
  TYPE_FP32 for them: `triton_backend/all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt`).
  The stand-in fails a request whose draft logits have another shape or dtype (stricter than the
  executor, which copies them into a buffer of its own dtype).
- Names and keywords of the classes: `cpp/tensorrt_llm/nanobind/executor/request.cpp`,
  `executorConfig.cpp` (ParallelConfig, OrchestratorConfig), `executor.cpp`;
  `Executor::Impl::awaitResponses(ids, timeout)` waits for each id in turn.

The model is a callable ``target(tokens) -> logits [vocab]``. An iteration takes ``iteration_s``
seconds of "GPU time" on the executor's thread; iterations are counted: ``iterations`` in all,
``decode_iterations[id]`` launched after a request's context step. The engine's limits come from
the engine folder's runtime.json (what trtllm-build's config.json holds on a GPU host).
"""
from __future__ import annotations

import datetime
import json
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

FETCH_ERROR = "Encountered an error when fetching new request: "
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
    unsent: list[int] = field(default_factory=list)  # tokens not yet in a response
    in_flight: list[int] | None = None  # tokens of the launched iteration, attached at the next pass
    started: bool = False
    cancelled: bool = False


class Executor:
    def __init__(self, engine_dir: str, model_type, config: ExecutorConfig, *,
                 target: Callable[[list[int]], torch.Tensor], iteration_s: float = 0.001):
        rt = json.loads((Path(engine_dir) / "runtime.json").read_text())
        self.config, self.target, self.iteration_s = config, target, iteration_s
        self.max_input_len, self.max_seq_len = int(rt["max_input_len"]), int(rt["max_seq_len"])
        external = rt.get("speculative_decoding_mode") == "draft_tokens_external"
        self.max_draft_len = int(rt["max_draft_len"]) if external else 0
        self.vocab_padded = int(rt["vocab_size"])
        self.live: dict[int, _Live] = {}  # active requests
        self.queued: list[tuple[int, Request]] = []
        self.cancelled: set[int] = set()
        self.ready: dict[int, list[Response]] = {}
        self.warnings: list[str] = []
        self.iterations = 0
        self.decode_iterations: dict[int, int] = {}
        self.requests: dict[int, Request] = {}  # every request enqueued, for tests to inspect
        self.batches: list[int] = []  # sizes of enqueue_requests calls
        self._next_id = 1
        self._cv = threading.Condition()
        self._shutdown = False
        self._thread = threading.Thread(target=self._loop, name="executionLoop", daemon=True)
        self._thread.start()

    # -- the client side ----------------------------------------------------------------------
    def enqueue_request(self, request: Request) -> int:
        with self._cv:
            rid, self._next_id = self._next_id, self._next_id + 1
            self.requests[rid] = request
            self.queued.append((rid, request))
            self._cv.notify_all()
        return rid

    def enqueue_requests(self, requests: list[Request]) -> list[int]:
        with self._cv:  # one lock: the loop fetches them together
            self.batches.append(len(requests))
            return [self.enqueue_request(r) for r in requests]

    def cancel_request(self, rid: int) -> None:
        """Takes effect at the loop's next pass (terminateCancelledRequests)."""
        with self._cv:
            self.cancelled.add(rid)

    def await_responses(self, ids: list[int] | None = None, timeout=None) -> list[list[Response]]:
        """Per id in turn: its responses, waiting up to ``timeout`` for the first one."""
        seconds = None if timeout is None else (timeout.total_seconds() if isinstance(timeout, datetime.timedelta)
                                                else float(timeout))
        with self._cv:
            ids = list(ids) if ids is not None else list(self.live)
            out = []
            for rid in ids:
                deadline = None if seconds is None else time.monotonic() + seconds
                while rid not in self.ready:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._cv.wait(left)
                out.append(self.ready.pop(rid, []))
            return out

    def shutdown(self) -> None:
        with self._cv:
            self._shutdown = True
            self.live.clear()
            self.queued.clear()
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # -- the executor's thread: executionLoop ---------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self.live or self.queued or self._shutdown):
                    self._cv.wait()
                if self._shutdown:
                    return
                if self.live:
                    for rid in self.cancelled & set(self.live):  # terminateCancelledRequests
                        self.live[rid].cancelled = True
                        self.cancelled.discard(rid)
                    self._sync_and_respond()
                for rid, request in self.queued:  # fetchNewRequests
                    self._fetch(rid, request)
                self.queued.clear()
                if self.live:
                    self._launch()  # forwardAsync
                self._cv.notify_all()
            time.sleep(self.iteration_s)  # the launched iteration's GPU time

    def _fetch(self, rid: int, request: Request) -> None:
        try:
            self.live[rid] = self._validate(request)
            self.decode_iterations[rid] = 0
        except ValueError as e:
            self.ready.setdefault(rid, []).append(Response(rid, error_msg=FETCH_ERROR + str(e)))

    def _validate(self, request: Request) -> _Live:
        """LlmRequest::validate and fetchNewRequests' checks; a ValueError becomes an error response."""
        prompt = len(request.input_token_ids)
        ext = request.external_draft_tokens_config
        drafts = list(ext.tokens) if ext else []
        if prompt > self.max_input_len:
            raise ValueError(f"Prompt length ({prompt}) exceeds maximum input length ({self.max_input_len}).")
        if len(drafts) > self.max_draft_len:
            raise ValueError(f"Draft tokens length ({len(drafts)}) exceeds maximum draft tokens length "
                             f"({self.max_draft_len}).")
        if ext is not None and ext.logits is not None:
            logits = torch.as_tensor(ext.logits)
            if tuple(logits.shape) != (len(ext.tokens), self.vocab_padded) or logits.dtype != torch.float32:
                raise ValueError(f"stand-in: draft logits must be float32 [draft tokens, padded vocab] = "
                                 f"({len(ext.tokens)}, {self.vocab_padded}), got {logits.dtype} "
                                 f"{tuple(logits.shape)}")
        if request.output_config.return_generation_logits and not self.config.gather_generation_logits:
            raise ValueError(GATHER_ERROR)
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
        seed = request.sampling_config.seed
        gen = torch.Generator().manual_seed(int(seed)) if seed is not None else torch.Generator()
        return _Live(request, drafts, max_tokens, gen)

    def _launch(self) -> None:
        """forwardAsync: one iteration of every active request (its tokens land at the next pass)."""
        self.iterations += 1
        for rid, r in self.live.items():
            if not r.started:
                r.started = True
                added = self._context_step(r)
            else:
                self.decode_iterations[rid] += 1
                seq = list(r.request.input_token_ids) + r.out
                added = [self._draw(self._p(seq, r.request.sampling_config), r.gen)]
            r.in_flight = added

    def _sync_and_respond(self) -> None:
        """forwardSync, then populateNewResponses: a streaming request answers with the tokens it
        added; a finished one (max_tokens, end_id, cancelled) answers a last time and leaves."""
        for rid, r in list(self.live.items()):
            added = (r.in_flight or [])[: r.max_tokens - len(r.out)]
            r.in_flight = None
            r.out += added
            r.unsent += added
            final = (r.cancelled or len(r.out) >= r.max_tokens
                     or (r.request.end_id is not None and r.request.end_id in added))
            if r.request.streaming and (r.unsent or final):
                self._answer(rid, r, r.unsent, final)
            elif final:
                self._answer(rid, r, r.out, final)
            r.unsent = []
            if final:
                del self.live[rid]

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

    def _answer(self, rid: int, r: _Live, tokens: list[int], final: bool) -> None:
        logits = None
        if r.request.output_config.return_generation_logits:
            start = len(r.out) - len(tokens)
            rows = [torch.as_tensor(self.target(list(r.request.input_token_ids) + r.out[:start + i])).float()
                    for i in range(len(tokens))]
            logits = torch.stack(rows)[None] if rows else torch.zeros(1, 0, self.vocab_padded)
        self.ready.setdefault(rid, []).append(Response(rid, Result([list(tokens)], final, logits)))


def executor_module(target: Callable[[list[int]], torch.Tensor], iteration_s: float = 0.001
                    ) -> tuple[types.ModuleType, list[Executor]]:
    """The stand-in module, and the list each Executor it creates is appended to."""
    m = types.ModuleType("tensorrt_llm.bindings.executor")
    made: list[Executor] = []

    def make_executor(engine_dir, model_type, config):
        made.append(Executor(engine_dir, model_type, config, target=target, iteration_s=iteration_s))
        return made[-1]

    m.CommunicationType, m.CommunicationMode = CommunicationType, CommunicationMode
    for cls in (KvCacheConfig, ExecutorConfig, ParallelConfig, OrchestratorConfig, SamplingConfig, OutputConfig, ExternalDraftTokensConfig, Request):
        setattr(m, cls.__name__, cls)
    m.Executor = make_executor
    m.ModelType = types.SimpleNamespace(DECODER_ONLY="decoder_only")
    return m, made
