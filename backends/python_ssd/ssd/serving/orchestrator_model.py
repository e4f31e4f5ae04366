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
from ..decoding.admission import BudgetExceeded, KvBudget
from ..decoding.calibration import calibrate
from ..decoding.coalescer import CoalescingClient
from ..decoding.generator import Generation, SharedState
from ..decoding.stopping import StopChecker
from ..decoding.text import TextCodec
from ..engine.meta import resolve_engine_dir
from ..workers.waiting import WaitingFlag, remove_stale
from .bls_client import BLSClient
from . import errors
from .metrics import Metrics
from .request_io import parse_request
from .supervisor import EngineSupervisor, looks_like_engine_down

BAD_INPUT = "INVALID_ARG"  # the server-side classes' codes are in errors.CODE


class OrchestratorModel:
    def __init__(self, config: dict, params: dict[str, str]):
        self.cfg = cfg = ServerConfig.from_parameters(params)
        self.codec = TextCodec(resolve_engine_dir(cfg.tokenizer))
        self.defaults = cfg.decode_defaults()
        self.shared = SharedState(policy=Scheduler(forced_mode=cfg.force_mode or None,
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
        bls = BLSClient()
        remove_stale()  # flags of servers killed before they could unlink theirs
        self.waiting = WaitingFlag.for_target(bls.models["target"])
        self.client = CoalescingClient(bls, expected=lambda: self.shared.active,
                                       max_window=cfg.coalesce_window_ms / 1000, waiting=self.waiting) \
            if cfg.coalesce_window_ms > 0 else bls
        self.metrics = Metrics()
        self._calibration: asyncio.Future | None = None  # the engines' costs, measured before the first decode
        self.shared.on_active = self.metrics.set_active  # the gauge follows the one count of decoding requests
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

    def _refusal(self, n_active: int) -> tuple[str, str] | None:
        """Why a valid request cannot start now (message, code), or None."""
        if self.supervisor is not None and not self.supervisor.is_up(self.required_engine):
            return (f"{errors.UNAVAILABLE}'{self.required_engine}' is restarting after its process died; retry in a "
                    "few seconds", errors.CODE[errors.UNAVAILABLE])
        if n_active >= self.cfg.max_active_requests:
            return (f"{errors.BUSY}{self.shared.active} requests decoding and {self.kv.waiting} waiting "
                    f"(max_active_requests={self.cfg.max_active_requests}); retry later", errors.CODE[errors.BUSY])
        return None

    # -- the request loop ---------------------------------------------------------------------------
    async def execute(self, requests):
        await asyncio.gather(*(self._handle(r) for r in requests))

    async def _handle(self, request) -> None:
        sender = request.get_response_sender()
        try:
            req = parse_request(request, self.defaults, self.cfg.default_max_tokens, self.cfg.max_tokens_limit)
            prompt = self.codec.encode_prompt(req.text, req.apply_chat_template)
            if len(prompt) + req.max_tokens > self.cfg.max_seq_len:
                raise ValueError(f"input 'max_tokens': prompt ({len(prompt)} tokens) + max_tokens ({req.max_tokens}) "
                                 f"exceeds the maximum sequence length {self.cfg.max_seq_len}")
        except ValueError as e:
            self.metrics.request_done("invalid", "invalid", None, None)
            self._error(sender, str(e), BAD_INPUT)
            return
        await self._target_back()
        refusal = self._refusal(self.shared.active + self.kv.waiting)
        if refusal is not None:
            self.metrics.busy()
            self._error(sender, *refusal)
            return
        reserve = len(prompt) + req.max_tokens + req.decode.k + 1
        try:
            await self.kv.acquire(reserve)
        except BudgetExceeded as e:
            self.metrics.request_done(req.decode.mode, "busy" if e.retryable else "invalid", None, None)
            self._error(sender, str(e), errors.CODE[errors.BUSY] if e.retryable else BAD_INPUT)
            return
        finally:
            self.metrics.kv_state(self.kv.reserved, self.kv.waiting)
        try:
            await self._decode(request, sender, req, prompt)
        finally:
            self.kv.release(reserve)
            self.metrics.kv_state(self.kv.reserved, self.kv.waiting)

    async def _calibrated(self) -> None:
        """The first request waits for the engines' costs to be measured (decoding/calibration.py),
        and so do the requests that arrive meanwhile. Skipped when a forced mode leaves the
        scheduler nothing to choose."""
        if self.cfg.force_mode:
            return
        if self._calibration is None:
            self._calibration = asyncio.ensure_future(self._measure_costs())
        await asyncio.shield(self._calibration)

    async def _measure_costs(self) -> None:
        batch = self.cfg.max_active_requests
        if self.cfg.max_verify_rows:  # the largest batch whose two-row verify is one tile
            batch = max(1, min(batch, self.cfg.max_verify_rows // 2))
        try:
            await calibrate(self.client, self.shared.policy.model, self.cfg.wide_threads, batch)
        except Exception as e:  # noqa: BLE001 - the curves are then learned from the rounds alone
            print(f"ssd: measuring the engines' costs failed ({type(e).__name__}: {e}); the scheduler "
                  "learns them from the rounds", file=sys.stderr, flush=True)

    async def _decode(self, request, sender, req, prompt) -> None:
        await self._calibrated()
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
            finally:
                await agen.aclose()
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
                sender.send(self._response(text, ids, checker.finish_reason or "length", stats),
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
