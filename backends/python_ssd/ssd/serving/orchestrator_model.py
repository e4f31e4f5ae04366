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

from ..algorithm.scheduler import Scheduler
from ..config import ServerConfig
from ..decoding.coalescer import CoalescingClient
from ..decoding.generator import Generation, SharedState
from ..decoding.stopping import StopChecker
from ..decoding.text import TextCodec
from .bls_client import BLSClient
from .metrics import Metrics
from .request_io import parse_request
from .roles import resolve_engine_dir


class OrchestratorModel:
    def __init__(self, config: dict, params: dict[str, str]):
        self.cfg = cfg = ServerConfig.from_parameters(params)
        self.codec = TextCodec(resolve_engine_dir(cfg.tokenizer))
        self.defaults = cfg.decode_defaults()
        self.shared = SharedState(policy=Scheduler(forced_mode=cfg.force_mode or None,
                                                   forced_backup=cfg.force_backup or None),
                                  max_verify_rows=cfg.max_verify_rows)
        trace = os.environ.get("SSD_POLICY_TRACE")
        self._trace_file = None
        if trace:  # one JSON line per scheduler decision and per measured round
            self._trace_file = open(trace, "a", buffering=1)
            self.shared.policy.trace = lambda ev: self._trace_file.write(
                json.dumps({"t": round(time.time(), 3), **ev}) + "\n")
        # concurrent sequences reach the engines together (see decoding/coalescer.py); 0 disables
        self.client = CoalescingClient(BLSClient(), expected=lambda: self.shared.active,
                                       max_window=cfg.coalesce_window_ms / 1000) \
            if cfg.coalesce_window_ms > 0 else BLSClient()
        self.metrics = Metrics()
        self.active = 0

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
    def _error(sender, msg: str) -> None:
        sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(msg)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

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
            self._error(sender, str(e))
            return
        if self.active >= self.cfg.max_active_requests:
            self.metrics.busy()
            self._error(sender, f"server busy: {self.active} requests decoding (max_active_requests="
                                f"{self.cfg.max_active_requests}); retry later")
            return
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
            stats["b_star"] = pol.model.b_star(dc.k, dc.fanout_budget)
            # counters first: a client that reads /metrics right after its response sees itself
            self.metrics.request_done(req.decode.mode, status, stats, stats["b_star"])
            b, k_now = max(self.active, 1), self.shared.round_k(dc.k)
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
            self.metrics.request_done(req.decode.mode, "error", None, None)
            self._error(sender, f"generation failed: {type(e).__name__}: {e}")
        finally:
            self.active -= 1
            self.metrics.set_active(self.active)
            await self.client.release(seq_id)

    def finalize(self):
        if self._trace_file is not None:
            self._trace_file.close()
