"""The `ssd` model: a decoupled, async orchestrator speaking Triton's generate extension.

Each request becomes one task: tokenize, run the chosen decoding loop (ar | sd | ssd) against the
engine models over BLS, stream text deltas (or send one final response), attach statistics, free the
engines' state. Requests run concurrently; the engines batch what arrives together.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from ..algorithm.policy import CHOICES, ModePolicy
from ..decoding.admission import BudgetExceeded, KvBudget
from ..decoding.coalescer import CoalescingClient
from ..decoding.generator import DecodeConfig, Generation, SharedState
from ..decoding.stopping import StopChecker
from ..decoding.text import TextCodec
from .bls_client import BLSClient
from . import errors
from .metrics import Metrics
from .request_io import parse_request
from .roles import resolve_engine_dir
from .supervisor import EngineSupervisor, looks_like_engine_down

BAD_INPUT = "INVALID_ARG"  # the server-side classes' codes are in errors.CODE


def _p(params: dict[str, str], key: str, default: str) -> str:
    return params.get(key) or default


class OrchestratorModel:
    def __init__(self, config: dict, params: dict[str, str]):
        self.codec = TextCodec(resolve_engine_dir(params["tokenizer"]))
        self.defaults = DecodeConfig(
            mode=_p(params, "default_mode", "ssd"), k=int(_p(params, "num_draft_tokens", "4")),
            fanout_budget=int(_p(params, "fanout_budget", "12")), fanout_shape=_p(params, "fanout_shape", "geometric"),
            saguaro_c=float(_p(params, "saguaro_c", "1.0")), backup=_p(params, "backup", "auto"),
            step_aside=_p(params, "step_aside", "true").lower() == "true",
            adaptive_k=_p(params, "adaptive_k", "true").lower() == "true")
        self.defaults.validate()
        forced, force_mode = _p(params, "force_backup", ""), _p(params, "force_mode", "")
        if forced not in ("", "neural", "fast"):
            raise ValueError(f"parameter force_backup must be '', 'neural' or 'fast', got {forced!r}")
        if force_mode not in ("",) + CHOICES:
            raise ValueError(f"parameter force_mode must be '' or one of {CHOICES}, got {force_mode!r}")
        self.shared = SharedState(policy=ModePolicy(forced_backup=forced or None, forced_mode=force_mode or None),
                                  max_verify_rows=int(_p(params, "max_verify_rows", "32")))
        trace = os.environ.get("SSD_POLICY_TRACE")
        self._trace_file = None
        if trace:  # one JSON line per policy decision and per measured round
            self._trace_file = open(trace, "a", buffering=1)
            self.shared.policy.trace = lambda ev: self._trace_file.write(
                json.dumps({"t": round(time.time(), 3), **ev}) + "\n")
        self.default_max_tokens = int(_p(params, "default_max_tokens", "128"))
        self.max_tokens_limit = int(_p(params, "max_tokens_limit", "2048"))
        self.max_seq_len = int(_p(params, "max_seq_len", "4096"))
        self.max_active = int(_p(params, "max_active_requests", "32"))
        # concurrent sequences reach the engines together (see decoding/coalescer.py); 0 disables
        window_ms = float(_p(params, "coalesce_window_ms", "50"))
        self.client = CoalescingClient(BLSClient(), expected=lambda: self.shared.active,
                                       max_window=window_ms / 1000) if window_ms > 0 else BLSClient()
        self.metrics = Metrics()
        self.active = 0
        self.kv = KvBudget(int(_p(params, "kv_budget_tokens", "0")), float(_p(params, "kv_wait_s", "30")))
        self.required_engine = "target"  # without it nothing decodes; a drafter's absence costs speed only
        self.supervisor = None
        engines = tuple(m for m in _p(params, "supervise_engines", "target,drafter_primary,drafter_backup").split(",") if m)
        if engines and _p(params, "supervise", "true").lower() == "true":
            self.supervisor = EngineSupervisor(
                engines, unload=pb_utils.unload_model, load=pb_utils.load_model,
                on_restart=self.metrics.engine_restarted, on_state=self.metrics.engine_state,
                interval=float(_p(params, "supervise_interval_s", "0.5"))).start()
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
        if n_active >= self.max_active:
            return (f"{errors.BUSY}{self.active} requests decoding and {self.kv.waiting} waiting "
                    f"(max_active_requests={self.max_active}); retry later", errors.CODE[errors.BUSY])
        return None

    # -- the request loop ---------------------------------------------------------------------------
    async def execute(self, requests):
        await asyncio.gather(*(self._handle(r) for r in requests))

    async def _handle(self, request) -> None:
        sender = request.get_response_sender()
        try:
            req = parse_request(request, self.defaults, self.default_max_tokens, self.max_tokens_limit)
            prompt = self.codec.encode_prompt(req.text, req.apply_chat_template)
            if len(prompt) + req.max_tokens > self.max_seq_len:
                raise ValueError(f"input 'max_tokens': prompt ({len(prompt)} tokens) + max_tokens ({req.max_tokens}) "
                                 f"exceeds the maximum sequence length {self.max_seq_len}")
        except ValueError as e:
            self.metrics.request_done("invalid", "invalid", None, None)
            self._error(sender, str(e), BAD_INPUT)
            return
        await self._target_back()
        refusal = self._refusal(self.active + self.kv.waiting)
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

    async def _decode(self, request, sender, req, prompt) -> None:
        self.active += 1
        self.metrics.set_active(self.active)
        seq_id = uuid.uuid4().hex
        gen = Generation(self.client, seq_id, prompt, req.params, req.seed, req.decode, self.shared)
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
            stats["b_star"] = pol.b_star(dc.k, dc.fanout_budget)
            # counters first: a client that reads /metrics right after its response sees itself
            self.metrics.request_done(req.decode.mode, status, stats, stats["b_star"])
            b, k_now = max(self.active, 1), self.shared.round_k(dc.k)
            rates = {}
            if pol.model.known:  # at each choice's K, as the next round sees them
                rates = pol.rates(b, k_now, dc.fanout_budget, pol.model.best_k(b, k_now, dc.fanout_budget))
            self.metrics.policy_state(pol.current, rates)
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
            self.active -= 1
            self.metrics.set_active(self.active)
            await self.client.release(seq_id)

    def finalize(self):
        if self.supervisor is not None:
            self.supervisor.stop()
        if self._trace_file is not None:
            self._trace_file.close()
