"""A stand-in for Triton's TensorRT-LLM backend (`backend: "tensorrtllm"`, the 1.2-era release) as a
Triton Python model, for the CI test that drives the orchestrator's GPU path through a real
tritonserver (tests/test_trtllm_backend.py).

Its config is the one tools/deploy.py renders for a `tensorrtllm` model, with only the backend
swapped for `python`, so the inputs, outputs, dtypes, dims and the decoupled policy are the ones the
real backend would get; `initialize` refuses a config whose tensors differ from
serving/trtllm_contract.py. Behaviour, as the backend's source has it
(TensorRT-LLM release/1.2 `triton_backend/inflight_batcher_llm/src/model_instance_state.cc`,
`utils.cc`, and the executor: tests/trtllm_stand_in.py names those files):

- a request with `stop` true cancels the live request with the same Triton request id and is
  answered with one empty final response (`handleStopRequest`);
- a streaming request answers after every iteration with the tokens it added (exclude_input_in_output),
  the first answer being the accepted drafts plus one target token; a non-streaming one answers once;
- drafts are verified as externalDraftTokensKernels.cu does: greedy (top_k 1) by token matching,
  sampled with `draft_logits` by min(1, p/q) and a residual draw from max(0, p - q); draft logits
  must be fp32 [drafts, vocab];
- `output_ids` is [1, beam, tokens] int32 and `sequence_length` [1, beam] int32; with
  `return_generation_logits` an answer also carries `generation_logits` [1, beam, tokens, vocab]
  fp32, the raw logits each of its tokens was drawn from (what `tensorrt_llm_bls` reads from its
  draft model: `_spec_generate` in `tensorrt_llm_bls/1/lib/decode.py`);
- a prompt over the engine's max_input_len gets an error response ("Prompt length (n) exceeds
  maximum input length (m).", `LlmRequest::validate`), as does a request without `input_ids` or
  with `input_lengths` other than its length. The stand-in's max_input_len is its config's
  `stand_in_max_input_len` parameter (the real backend reads it from the engine).

The model is a torch engine in fp32 with batch-invariant forwards (`gpt_model_path` names its
folder: the CI target for `target`, the CI drafter for `drafter_trtllm`), so greedy output equals
the in-process engine's. Every request, stop and finished request is logged, with the model's
name, as a JSON line to $TRTLLM_STAND_IN_LOG for the test to read.
"""
import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

REPO = Path(os.path.realpath(__file__)).parents[2]
sys.path.insert(0, str(REPO / "backends" / "python_ssd"))

import torch  # noqa: E402

from ssd.engine.engine import ExtendCall, TorchEngine  # noqa: E402
from ssd.serving.trtllm_contract import INPUTS, OUTPUTS  # noqa: E402

# one decode iteration's time: a GPU's is ~10 ms, but here the stop's round trip through the
# orchestrator's stub and tritonserver must fit into it on two contended CPU cores
ITERATION_S = 1.0


def _dims(d) -> list[int]:
    return [int(x) for x in d]


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        got = {i["name"]: (i["data_type"], _dims(i["dims"]), bool(i.get("optional", False))) for i in cfg["input"]}
        want = {n: (t, d, o) for n, (t, d, o) in INPUTS.items()}
        if got != want:
            raise ValueError(f"stand-in: the config's inputs differ from the backend contract: {got} != {want}")
        outs = {o["name"]: (o["data_type"], _dims(o["dims"])) for o in cfg["output"]}
        if outs != {n: (t, d) for n, (t, d) in OUTPUTS.items()}:
            raise ValueError(f"stand-in: the config's outputs differ from the backend contract: {outs}")
        if not pb_utils.using_decoupled_model_transaction_policy(cfg):
            raise ValueError("stand-in: the TensorRT-LLM backend's model is decoupled")
        params = {k: v["string_value"] for k, v in cfg.get("parameters", {}).items()}
        self.name = cfg["name"]
        self.max_input_len = int(params.get("stand_in_max_input_len", "2048"))
        self.engine = TorchEngine(params["gpt_model_path"], dtype="float32", exact=True, max_sequences=256)
        self.vocab = self.engine.vocab_size
        self.engine_lock = threading.Lock()
        self.live: dict[str, threading.Event] = {}
        self.live_lock = threading.Lock()
        self.log = open(os.environ["TRTLLM_STAND_IN_LOG"], "a", buffering=1)
        self.log_lock = threading.Lock()

    def _write(self, **event) -> None:
        with self.log_lock:
            self.log.write(json.dumps({"model": self.name, **event}) + "\n")

    # -- requests -----------------------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            rid = request.request_id()
            sender = request.get_response_sender()
            inputs = {}
            for name in INPUTS:
                t = pb_utils.get_input_tensor_by_name(request, name)
                if t is not None:
                    inputs[name] = t.as_numpy()
            if "stop" in inputs and bool(inputs["stop"].reshape(-1)[0]):
                with self.live_lock:
                    ev = self.live.get(rid)
                if ev is not None:
                    ev.set()
                self._write(event="stop", request_id=rid, found=ev is not None)
                sender.send(pb_utils.InferenceResponse(output_tensors=[]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            self._write(event="request", request_id=rid,
                        inputs={n: [str(a.dtype), list(a.shape)] for n, a in inputs.items()},
                        scalars={n: a.reshape(-1)[0].item() for n, a in inputs.items() if a.size == 1})
            stopped = threading.Event()
            with self.live_lock:
                self.live[rid] = stopped
            threading.Thread(target=self._serve, args=(rid, inputs, sender, stopped), daemon=True).start()
        return None

    def _respond(self, sender, tokens: list[int], final: bool, logits: list | None = None) -> None:
        out = [pb_utils.Tensor("output_ids", np.array([[tokens]], dtype=np.int32)),
               pb_utils.Tensor("sequence_length", np.array([[len(tokens)]], dtype=np.int32))]
        if logits is not None:  # [1, beam, tokens, vocab]
            rows = (torch.stack(logits[-len(tokens):]).float().numpy() if tokens
                    else np.zeros((0, self.vocab), np.float32))
            out.append(pb_utils.Tensor("generation_logits", np.ascontiguousarray(rows[None, None], dtype=np.float32)))
        sender.send(pb_utils.InferenceResponse(output_tensors=out),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

    def _serve(self, rid: str, inputs: dict, sender, stopped: threading.Event) -> None:
        try:
            self._generate(rid, inputs, sender, stopped)
        except Exception as e:  # an error response, as the backend sends one
            self._write(event="error", request_id=rid, error=str(e))
            err = pb_utils.TritonError(f"stand-in: {e}")
            try:
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=err),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception:
                pass  # the request was answered in full already
        finally:
            with self.live_lock:
                self.live.pop(rid, None)
            with self.engine_lock:
                self.engine.release(rid)

    def _logits(self, rid: str, tokens: list[int], n: int) -> torch.Tensor:
        with self.engine_lock:
            return self.engine.extend([ExtendCall(rid, tokens, n)])[0]

    def _p(self, logits: torch.Tensor, inputs: dict) -> torch.Tensor | None:
        """The target's distribution after temperature / top-k / top-p; None: greedy (top_k 1)."""
        top_k = int(inputs["runtime_top_k"].reshape(-1)[0]) if "runtime_top_k" in inputs else 0
        if top_k == 1:
            return None
        temp = float(inputs["temperature"].reshape(-1)[0]) if "temperature" in inputs else 1.0
        x = logits.float() / temp
        if top_k > 1:
            x = x.masked_fill(x < torch.topk(x, top_k).values[-1], float("-inf"))
        p = torch.softmax(x, -1)
        top_p = float(inputs["runtime_top_p"].reshape(-1)[0]) if "runtime_top_p" in inputs else 1.0
        if top_p < 1.0:
            sp, idx = torch.sort(p, descending=True)
            sp = sp.masked_fill(sp.cumsum(-1) - sp >= top_p, 0.0)
            p = torch.zeros_like(p).scatter_(-1, idx, sp)
            p = p / p.sum()
        return p

    def _generate(self, rid: str, inputs: dict, sender, stopped: threading.Event) -> None:
        n = int(inputs["input_lengths"].reshape(-1)[0])
        if "input_ids" not in inputs or inputs["input_ids"].size == 0:
            raise ValueError("input_ids is required")
        if n != inputs["input_ids"].reshape(-1).size:
            raise ValueError(f"input_lengths ({n}) differs from the length of input_ids "
                             f"({inputs['input_ids'].reshape(-1).size})")
        if n > self.max_input_len:
            raise ValueError(f"Prompt length ({n}) exceeds maximum input length ({self.max_input_len}).")
        tokens = [int(t) for t in inputs["input_ids"].reshape(-1)[:n]]
        want_logits = "return_generation_logits" in inputs and bool(inputs["return_generation_logits"].reshape(-1)[0])
        kept: list | None = [] if want_logits else None  # each new token's logits row
        draft = [int(t) for t in inputs.get("draft_input_ids", np.zeros(0, np.int32)).reshape(-1)]
        max_new = int(inputs["request_output_len"].reshape(-1)[0])
        streaming = "streaming" in inputs and bool(inputs["streaming"].reshape(-1)[0])
        seed = int(inputs["seed"].reshape(-1)[0]) if "seed" in inputs else 0
        gen = torch.Generator().manual_seed(seed)
        q = None
        if "draft_logits" in inputs:
            logits = inputs["draft_logits"]
            rows = logits.reshape(-1, logits.shape[-1])
            if logits.dtype != np.float32 or rows.shape != (len(draft), self.vocab):
                raise ValueError(f"draft_logits must be float32 [{len(draft)}, {self.vocab}], got {logits.dtype} "
                                 f"{list(rows.shape)}")
            q = torch.softmax(torch.from_numpy(rows.copy()), -1)
        # the context step: the drafts' acceptance, then one token
        rows = self._logits(rid, tokens + draft, len(draft) + 1)
        new: list[int] = []
        for i, d in enumerate(draft + [None]):
            p = self._p(rows[i], inputs)
            if d is None:
                new.append(int(rows[i].argmax()) if p is None else int(torch.multinomial(p, 1, generator=gen)))
                if kept is not None:
                    kept.append(rows[i])
                break
            if p is None:
                ok = int(rows[i].argmax()) == d
                if not ok:
                    new.append(int(rows[i].argmax()))
                    break
            elif q is not None:
                if float(p[d]) / max(float(q[i, d]), 1e-30) < float(torch.rand((), generator=gen)):
                    res = (p - q[i]).clamp_min(0)
                    new.append(int(torch.multinomial(res / res.sum(), 1, generator=gen)))
                    break
            else:
                raise ValueError("a sampled verify without draft_logits redraws rejected drafts from the full p "
                                 "(externalDraftTokensKernels.cu): the orchestrator must send them")
            new.append(d)
        out = new[:max_new]
        decoded, cut = 0, False
        if kept is not None and draft:
            raise ValueError("stand-in: generation logits of a verify with drafts are not modelled")
        if streaming:
            self._respond(sender, out, final=len(out) >= max_new, logits=kept)
            while len(out) < max_new:
                time.sleep(ITERATION_S)
                if stopped.is_set():  # cancelled: a last, empty final response
                    cut = True
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    break
                row = self._logits(rid, tokens + out, 1)[0]
                p = self._p(row, inputs)
                t = int(row.argmax()) if p is None else int(torch.multinomial(p, 1, generator=gen))
                out.append(t)
                decoded += 1
                if kept is not None:
                    kept.append(row)
                self._respond(sender, [t], final=len(out) >= max_new, logits=kept)
        else:
            while len(out) < max_new:
                row = self._logits(rid, tokens + out, 1)[0]
                p = self._p(row, inputs)
                out.append(int(row.argmax()) if p is None else int(torch.multinomial(p, 1, generator=gen)))
                decoded += 1
                if kept is not None:
                    kept.append(row)
            self._respond(sender, out, final=True, logits=kept)
        # what the test matches a draft to its verify by, and the probabilities each side used: p of
        # every token this request drew (from its generation logits), q of every draft it verified
        prefix = hashlib.sha1(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()[:16]
        extra = {}
        if kept is not None:
            ps = [self._p(row, inputs) for row in kept]
            extra["p_of_token"] = [None if p is None else float(p[t]) for p, t in zip(ps, out)]
        if q is not None:
            extra["q_of_draft"] = [float(q[i, d]) for i, d in enumerate(draft)]
        self._write(event="done", request_id=rid, drafts=len(draft), first=len(new), decoded_after_first=decoded,
                    stopped=cut, streaming=streaming, asked=max_new, prefix=prefix, draft=draft, out=out, **extra)

    def finalize(self):
        self.log.close()
