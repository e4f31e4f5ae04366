"""The `ssd` model: a decoupled, async orchestrator speaking Triton's generate extension.

Each request becomes one task: tokenize, run the chosen decoding loop (ar | sd | ssd) against the
engine models over BLS, stream text deltas (or send one final response), attach statistics, free the
engines' state. Requests run concurrently; the engines batch what arrives together.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from ..algorithm.scheduler import Scheduler
from ..config import ServerConfig
from ..decoding.admission import BudgetExceeded, KvBudget, RequestSlots
from ..decoding.calibration import calibrate
from ..decoding.coalescer import CoalescingClient
from ..decoding.generator import Generation, SharedState
from ..decoding.stopping import StopChecker
from ..decoding.text import TextCodec
from ..engine.meta import resolve_engine_dir
from ..workers.protocol import CallError
from ..workers.waiting import WaitingFlag, remove_stale
from .bls_client import BLSClient
from . import errors
from .metrics import Metrics
from .request_io import parse_request
from .supervisor import EngineSupervisor, looks_like_engine_down

BAD_INPUT = "INVALID_ARG"  # the server-side classes' codes are in errors.CODE
SERVER_STARTING = "Server not ready"  # Triton's answer to a BLS call before the server is ready
# how often a request that waits (for a slot, KV room, the cost calibration) asks Triton whether its
# client cancelled; a decoding request asks after every round
CANCEL_POLL_S = 0.25


class OrchestratorModel:
    def __init__(self, config: dict, params: dict[str, str]):
        self.cfg = cfg = ServerConfig.from_parameters(params, config.get("name", "ssd"))
        self.codec = TextCodec(resolve_engine_dir(cfg.tokenizer))
        self.defaults = cfg.decode_defaults()
        self.shared = SharedState(policy=Scheduler(cfg.policy, forced_mode=cfg.force_mode or None,
                                                   forced_backup=cfg.force_backup or None),
                                  max_verify_rows=cfg.max_verify_rows, wide_threads=cfg.wide_threads,
                                  ar_steps=cfg.ar_steps, free_drafts=cfg.free_drafts,
                                  lookup_max_k=cfg.lookup_max_k, suffix_cache=cfg.suffix_cache())
        trace = os.environ.get("SSD_POLICY_TRACE")
        self._trace_file = None
        if trace:  # one JSON line per scheduler decision and per measured round
            self._trace_file = open(trace, "a", buffering=1)
            self.shared.policy.trace = lambda ev: self._trace_file.write(
                json.dumps({"t": round(time.time(), 3), **ev}) + "\n")
        # concurrent sequences reach the engines together (see decoding/coalescer.py); 0 disables
        if "tensorrtllm" in (cfg.target_backend, cfg.drafter_backend):  # models of Triton's TensorRT-LLM backend
            from .trtllm_backend_client import TrtllmBackendClient
            bls = TrtllmBackendClient(cfg.target_vocab_size, target_on_backend=cfg.target_backend == "tensorrtllm",
                                      drafter_model=cfg.drafter_model if cfg.drafter_backend == "tensorrtllm" else "")
        else:
            bls = BLSClient()
        self.bls = bls
        remove_stale()  # flags of servers killed before they could unlink theirs
        self.waiting = WaitingFlag.for_target(bls.models["target"])
        self.client = CoalescingClient(bls, expected=lambda: self.shared.active,
                                       max_window=cfg.coalesce_window_ms / 1000, waiting=self.waiting) \
            if cfg.coalesce_window_ms > 0 else bls
        self.metrics = Metrics()
        self._calibration: asyncio.Future | None = None  # the engines' costs, measured before the first decode
        self.shared.on_active = self.metrics.set_active  # the gauge follows the one count of decoding requests
        self.slots = RequestSlots(cfg.max_active_requests, cfg.queue_wait_s, cfg.max_queued_requests)
        self.slots.on_queue = self.metrics.queue_state
        self.kv = KvBudget(cfg.kv_budget_tokens, cfg.kv_wait_s)
        self.required_engine = "target"  # without it nothing decodes; a drafter's absence costs speed only
        self.supervisor = None
        engines = tuple(m for m in cfg.supervise_engines.split(",") if m)
        if engines and cfg.supervise:
            self.supervisor = EngineSupervisor(
                engines, unload=pb_utils.unload_model, load=pb_utils.load_model,
                on_restart=self.metrics.engine_restarted, on_state=self.metrics.engine_state,
                interval=cfg.supervise_interval_s).start()
            for m in engines:
                self.metrics.engine_state(m, True)

    # -- helpers ----------------------------------------------------------------------------------
    @staticmethod
    def _response(text: str, ids: list[int], finish: str | None = None, stats: dict | None = None):
        outs = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
                pb_utils.Tensor("output_ids", np.array(ids, dtype=np.int32))]
        if finish is not None:
            outs.append(pb_utils.Tensor("finish_reason", np.array([finish.encode()], dtype=np.object_)))
        if stats is not None:
            outs.append(pb_utils.Tensor("stats", np.array([json.dumps(stats).encode()], dtype=np.object_)))
        return pb_utils.InferenceResponse(output_tensors=outs)

    @staticmethod
    def _error(sender, msg: str, code: str) -> None:
        err = pb_utils.TritonError(msg, getattr(pb_utils.TritonError, code))
        sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    async def _target_back(self) -> bool:
        """A request that arrives while the target reloads waits for it (up to kv_wait_s): only the
        requests in flight when it died fail."""
        deadline = time.monotonic() + self.kv.max_wait
        while self.supervisor is not None and not self.supervisor.is_up(self.required_engine):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def _refusal(self) -> tuple[str, str] | None:
        """Why a valid request cannot start now (message, code), or None."""
        if self.supervisor is not None and not self.supervisor.is_up(self.required_engine):
            return (f"{errors.UNAVAILABLE}'{self.required_engine}' is restarting after its process died; retry in a "
                    "few seconds", errors.CODE[errors.UNAVAILABLE])
        return None

    @staticmethod
    async def _unless_cancelled(request, awaitable) -> bool:
        """Awaits ``awaitable`` while asking Triton every CANCEL_POLL_S whether the client cancelled
        (a gRPC stream's cancel, an HTTP stream's closed connection): False when it did, and
        ``awaitable`` is then cancelled (a queue or budget it waited in forgets it)."""
        task = asyncio.ensure_future(awaitable)
        while True:
            done, _ = await asyncio.wait({task}, timeout=CANCEL_POLL_S)
            if done:
                task.result()
                return True
            if request.is_cancelled():
                if not task.cancel():  # it finished meanwhile: what it took is the caller's
                    task.result()
                    return True
                try:
                    await task
                except asyncio.CancelledError:
                    return False
                return True

    def _cancelled_before_decoding(self, sender, req) -> None:
        self.metrics.request_done(req.decode.mode, "cancelled", None, None)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    # -- the request loop ---------------------------------------------------------------------------
    async def execute(self, requests):
        await asyncio.gather(*(self._handle(r) for r in requests))

    async def _handle(self, request) -> None:
        arrived = time.monotonic()
        sender = request.get_response_sender()
        try:
            req = parse_request(request, self.defaults, self.cfg.default_max_tokens, self.cfg.max_tokens_limit,
                                self.cfg.request_timeout_s)
            prompt = self.codec.encode_prompt(req.text, req.apply_chat_template)
            if len(prompt) + req.max_tokens > self.cfg.max_seq_len:
                raise ValueError(f"input 'max_tokens': prompt ({len(prompt)} tokens) + max_tokens ({req.max_tokens}) "
                                 f"exceeds the maximum sequence length {self.cfg.max_seq_len}")
        except ValueError as e:
            self.metrics.request_done("invalid", "invalid", None, None)
            self._error(sender, str(e), BAD_INPUT)
            return
        await self._target_back()
        refusal = self._refusal()
        if refusal is not None:
            self.metrics.busy()
            self._error(sender, *refusal)
            return
        deadline = arrived + req.timeout_s if req.timeout_s > 0 else None
        # over max_active_requests a request waits in the slot queue (up to queue_wait_s, or its deadline)
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            admitted = await self._unless_cancelled(request, self.slots.acquire(wait))
        except BudgetExceeded as e:
            self.metrics.busy()
            self._error(sender, str(e), errors.CODE[errors.BUSY])
            return
        if not admitted:
            self._cancelled_before_decoding(sender, req)
            return
        freed = False

        def free_slot() -> None:
            nonlocal freed
            if not freed:
                freed = True
                self.slots.release()

        try:
            await self._reserve_and_decode(request, sender, req, prompt, deadline, free_slot)
        finally:
            free_slot()

    async def _reserve_and_decode(self, request, sender, req, prompt, deadline: float | None, free_slot) -> None:
        reserve = len(prompt) + req.max_tokens + req.decode.k + 1
        try:
            reserved = await self._unless_cancelled(request, self.kv.acquire(reserve))
        except BudgetExceeded as e:
            self.metrics.request_done(req.decode.mode, "busy" if e.retryable else "invalid", None, None)
            self._error(sender, str(e), errors.CODE[errors.BUSY] if e.retryable else BAD_INPUT)
            return
        finally:
            self.metrics.kv_state(self.kv.reserved, self.kv.waiting)
        if not reserved:
            self._cancelled_before_decoding(sender, req)
            return
        try:
            if not await self._unless_cancelled(request, self._calibrated()):
                self._cancelled_before_decoding(sender, req)
            elif self._calibration is None:  # the warmup sample while the server starts: nothing to do yet
                sender.send(self._response("", [], "length", {"skipped": "the server is starting"}),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                await self._decode(request, sender, req, prompt, deadline, free_slot)
        finally:
            self.kv.release(reserve)
            self.metrics.kv_state(self.kv.reserved, self.kv.waiting)

    async def _calibrated(self) -> bool:
        """The first request waits for the engines' costs to be measured (decoding/calibration.py),
        and so do the requests that arrive meanwhile. That first request is the model's warmup
        sample, which Triton runs before it reports the model READY, so clients never pay for the
        measurement. A forced mode leaves the scheduler nothing to choose: no measurement.
        False when Triton still refuses BLS because the server is starting (a launcher that loads
        every model at once, not after the engines as tools/triton_launcher.py does): the sample
        then does nothing (``_calibration`` is None again) and the first client request measures."""
        if self._calibration is None:
            self._calibration = asyncio.ensure_future(self._measure_costs())
        if not await asyncio.shield(self._calibration):
            self._calibration = None
            return False
        return True

    async def _measure_costs(self) -> bool:
        batch = self.cfg.max_active_requests
        if self.cfg.max_verify_rows:  # the largest batch whose two-row verify is one tile
            batch = max(1, min(batch, self.cfg.max_verify_rows // 2))
        try:  # any engine model answers so (the drafter is always this backend's own)
            await self.bls.ping("drafter")
        except CallError as e:
            if SERVER_STARTING in str(e):
                return False
            print(f"ssd: an engine model does not answer ({e})", file=sys.stderr, flush=True)
        if self.cfg.force_mode:
            return True
        try:
            await calibrate(self.client, self.shared.policy.model, self.cfg.wide_threads, batch,
                            self.cfg.longest_verify_rows(), self.shared.policy.trace)
        except Exception as e:  # noqa: BLE001 - the curves are then learned from the rounds alone
            print(f"ssd: measuring the engines' costs failed ({type(e).__name__}: {e}); the scheduler "
                  "learns them from the rounds", file=sys.stderr, flush=True)
        return True

    async def _decode(self, request, sender, req, prompt, deadline: float | None, free_slot) -> None:
        seq_id = uuid.uuid4().hex
        gen = Generation(self.client, seq_id, prompt, req.params, req.seed, req.decode, self.shared, req.max_tokens)
        checker = StopChecker(self.codec.decode, req.max_tokens, self.codec.eos_ids, req.stop)
        status, sent_ids = "ok", 0
        try:
            agen = gen.run()
            try:
                async for block in agen:
                    done = checker.push(block)
                    if request.is_cancelled():
                        status = "cancelled"
                        break
                    if req.stream and not done:
                        delta = checker.delta()
                        if delta:
                            sender.send(self._response(delta, checker.tokens[sent_ids:]))
                            sent_ids = len(checker.tokens)
                    if done:
                        break
                    if deadline is not None and time.monotonic() >= deadline:
                        status = "timeout"  # the tokens so far go out, as TensorRT-LLM's timed-out requests
                        break
            finally:
                await agen.aclose()
                # the slot is free before the client hears the end: a client that sends its next
                # request at once finds it free (the engines' clean-up below runs meanwhile)
                free_slot()
            gen.stats.new_tokens = len(checker.tokens)  # what the client got, after stop conditions
            stats = gen.stats.to_dict()
            pol, dc = self.shared.policy, req.decode
            stats["b_star"] = pol.model.b_star(dc.k, dc.fanout_budget)
            # counters first: a client that reads /metrics right after its response sees itself
            self.metrics.request_done(req.decode.mode, status, stats, stats["b_star"])
            b, k_now = max(self.shared.active, 1), self.shared.round_k(dc.k)
            rates = {}
            if pol.model.known:  # at each choice's K, as the next round sees them
                rates, _ = pol.estimates(b, k_now, dc.fanout_budget, pol.model.best_k(b, k_now, dc.fanout_budget))
            self.metrics.policy_state(str(pol.current), {str(c): r for c, r in rates.items()})
            if status == "cancelled":
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                text = checker.delta() if req.stream else checker.text
                ids = checker.tokens[sent_ids:] if req.stream else checker.tokens
                finish = "timeout" if status == "timeout" else checker.finish_reason or "length"
                sender.send(self._response(text, ids, finish, stats),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as e:  # noqa: BLE001 - an engine failure ends this request, not the server
            msg = f"generation failed: {type(e).__name__}: {e}"
            down = looks_like_engine_down(msg)
            if self.supervisor is not None:
                self.supervisor.report_failure(msg)
            self.metrics.request_done(req.decode.mode, "unavailable" if down else "error", None, None)
            kind = errors.UNAVAILABLE if down else errors.INTERNAL
            tail = "; the engine is being reloaded, retry in a few seconds" if down else ""
            self._error(sender, kind + msg + tail, errors.CODE[kind])
        finally:
            await self.client.release(seq_id)

    def finalize(self):
        self.waiting.unlink()
        if self.supervisor is not None:
            self.supervisor.stop()
        if self._trace_file is not None:
            self._trace_file.close()
