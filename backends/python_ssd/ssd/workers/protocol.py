"""The calls the orchestrator makes to the engine processes, as plain dataclasses.

A message carries one op's calls of any number of sequences (the coalescer sends a whole round's
calls as one), control data as JSON, probability rows (only needed when sampling) as one float32
tensor beside it. The same objects are used in-process (tests, benchmarks) and over Triton BLS.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

import torch

from ..algorithm.sampling import SamplingParams


@dataclass
class VerifyCall:
    seq_id: str
    tokens: list[int]  # verified prefix (prompt + output so far)
    draft: list[int]  # tokens to check; empty for an AR step (or the prefill)
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    round: int = 0
    draft_probs: torch.Tensor | None = None  # [len(draft), V] q' rows; None: greedy or one-hot
    threads: int = 0  # the round's layout: threads to compute with (0: the engine's own, split)
    steps: int = 1  # an AR call (empty draft): tokens the target may decode itself (workers/target.py)


@dataclass
class VerifyResult:
    accepted: int
    token: int
    decoded: list[int] = field(default_factory=list)  # an AR call of several steps: its tokens before `token`
    timing: list = field(default_factory=list)  # [(rows, seconds)] of the engine's forwards, see below
    # seconds the call's message spent on prompts (new requests' prefills batched with it): time
    # the round waited for, whatever its choice
    prompt_seconds: float = 0.0
    cached_tokens: int = 0  # the call's first for its sequence: prompt tokens whose KV the engine already held


@dataclass
class DraftCall:
    seq_id: str
    tokens: list[int]
    k: int
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    round: int = 0
    saguaro_c: float = 1.0
    fanout: list[int] = field(default_factory=list)  # top-set size per depth for Saguaro
    threads: int = 0  # as VerifyCall.threads


@dataclass
class DraftResult:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [k, V]; None when greedy or deterministic
    timing: list = field(default_factory=list)


@dataclass
class SpeculateCall:
    seq_id: str
    tokens: list[int]  # verified prefix
    draft: list[int]  # the speculation the target is verifying right now
    k: int  # length of the next speculation
    fanout: list[int]  # F_0..F_K
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    round: int = 0
    saguaro_c: float = 1.0


@dataclass
class SpeculateResult:
    branches: dict[tuple[int, int], list[int]]  # outcome (k, t*) -> pre-drafted tokens
    timing: list = field(default_factory=list)


@dataclass
class FetchCall:
    seq_id: str
    key: tuple[int, int]


@dataclass
class ReleaseCall:
    seq_id: str


# "fast_draft" is a DraftCall sent to the fast backup's process
CALLS = {"verify": VerifyCall, "draft": DraftCall, "fast_draft": DraftCall, "speculate": SpeculateCall,
         "fetch": FetchCall, "release": ReleaseCall}
# which engine process serves an op ("release" goes to all three)
ROUTE = {"verify": "target", "draft": "drafter", "speculate": "drafter", "fetch": "drafter", "fast_draft": "backup"}


def worker_method(op: str) -> str:
    """The worker method that serves ``op`` (the fast backup's worker calls its method ``draft``)."""
    return "draft" if op == "fast_draft" else op


class CallError(RuntimeError):
    """One call of a batch failed in the engine process; the others of the batch are unaffected."""


def _fields(call) -> dict:
    d = {f.name: getattr(call, f.name) for f in fields(call) if f.name != "draft_probs"}
    if isinstance(d.get("params"), SamplingParams):
        d["params"] = d["params"].to_dict()
    return d


def _stack(rows: list[torch.Tensor | None]) -> tuple[list[int], torch.Tensor | None]:
    """Ragged [n_i, V] probability blocks as one tensor plus the row count of each (0: none)."""
    counts = [0 if r is None else int(r.shape[0]) for r in rows]
    present = [r for r in rows if r is not None and r.numel()]
    return counts, torch.cat(present) if present else None


def _unstack(counts: list[int], probs: torch.Tensor | None) -> list[torch.Tensor | None]:
    out, at = [], 0
    for n in counts:
        out.append(probs[at:at + n] if n and probs is not None else None)
        at += n
    return out


def encode_calls(op: str, calls: list) -> tuple[bytes, torch.Tensor | None]:
    """Many sequences' calls of one op as one message: one BLS request carries a whole round."""
    counts, probs = _stack([getattr(c, "draft_probs", None) for c in calls])
    return json.dumps({"op": op, "calls": [_fields(c) for c in calls], "prob_rows": counts}).encode(), probs


def decode_calls(payload: bytes, probs: torch.Tensor | None) -> tuple[str, list]:
    """(op, calls); a call that does not decode is a CallError in its place, the rest still run."""
    msg = json.loads(payload)
    op = msg["op"]
    if op not in CALLS:
        raise ValueError(f"unknown op {op!r}")
    rows = _unstack(msg.get("prob_rows", [0] * len(msg["calls"])), probs)
    calls = []
    for d, p in zip(msg["calls"], rows):
        try:
            if "params" in d:
                d["params"] = SamplingParams.from_dict(d["params"])
            if "key" in d:
                d["key"] = tuple(d["key"])
            call = CALLS[op](**d)
            if op == "verify":
                call.draft_probs = p
            calls.append(call)
        except Exception as e:  # noqa: BLE001 - reported to this call's sender only
            calls.append(CallError(f"bad {op} call: {type(e).__name__}: {e}"))
    return op, calls


def attach_timing(results: list, timing: list) -> list:
    """A batched call's forwards are reported once (on its first result): the orchestrator feeds
    them to one server-wide cost model, so every sequence of the batch need not repeat them."""
    if results:
        results[0].timing = [[int(r), float(s)] for r, s in timing]
    return results


def _result_fields(result) -> dict:
    if result is None:
        return {}
    if isinstance(result, Exception):
        return {"error": str(result)}
    if isinstance(result, SpeculateResult):
        return {"branches": [[k, t, toks] for (k, t), toks in result.branches.items()], "timing": result.timing}
    if isinstance(result, DraftResult):
        return {"tokens": result.tokens, "timing": result.timing}
    return asdict(result)


def encode_results(results: list) -> tuple[bytes, torch.Tensor | None]:
    """The answers to one message of calls, in order; an Exception becomes that call's error."""
    counts, probs = _stack([r.probs if isinstance(r, DraftResult) else None for r in results])
    return json.dumps({"results": [_result_fields(r) for r in results], "prob_rows": counts}).encode(), probs


def decode_results(op: str, payload: bytes, probs: torch.Tensor | None) -> list:
    """Results in call order; a call that failed in the engine is a CallError in its place."""
    msg = json.loads(payload)
    out = []
    for d, p in zip(msg["results"], _unstack(msg["prob_rows"], probs)):
        if "error" in d:
            out.append(CallError(d["error"]))
        elif op == "verify":
            out.append(VerifyResult(**d))
        elif op == "release":
            out.append(None)
        elif op == "speculate":
            out.append(SpeculateResult({(k, t): toks for k, t, toks in d["branches"]}, d.get("timing", [])))
        else:
            out.append(DraftResult(d["tokens"], p, d.get("timing", [])))
    return out
