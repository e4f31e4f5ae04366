"""The calls the orchestrator makes to the engine processes, as plain dataclasses.

Control data travels as JSON; probability rows (only needed when sampling) travel as one float32
tensor beside it. The same objects are used in-process (tests, benchmarks) and over Triton BLS.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

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


@dataclass
class VerifyResult:
    accepted: int
    token: int
    timing: list = field(default_factory=list)  # [(rows, seconds)] of the engine's forwards, see below


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


def encode_call(op: str, call) -> tuple[bytes, torch.Tensor | None]:
    d = asdict(call) if not hasattr(call, "draft_probs") else {
        k: v for k, v in asdict(call).items() if k != "draft_probs"}
    if "params" in d and isinstance(call.params, SamplingParams):
        d["params"] = call.params.to_dict()
    probs = getattr(call, "draft_probs", None)
    return json.dumps({"op": op, "call": d}).encode(), probs


def decode_call(payload: bytes, probs: torch.Tensor | None):
    msg = json.loads(payload)
    op = msg["op"]
    if op not in CALLS:
        raise ValueError(f"unknown op {op!r}")
    d = msg["call"]
    if "params" in d:
        d["params"] = SamplingParams.from_dict(d["params"])
    if "key" in d:
        d["key"] = tuple(d["key"])
    call = CALLS[op](**d)
    if op == "verify":
        call.draft_probs = probs if probs is not None and probs.numel() else None
    return op, call


def attach_timing(results: list, timing: list) -> list:
    """A batched call's forwards are reported once (on its first result): the orchestrator feeds
    them to one server-wide cost model, so every sequence of the batch need not repeat them."""
    if results:
        results[0].timing = [[int(r), float(s)] for r, s in timing]
    return results


def encode_result(result) -> tuple[bytes, torch.Tensor | None]:
    if result is None:
        return b"{}", None
    timing = getattr(result, "timing", [])
    if isinstance(result, SpeculateResult):
        d = {"branches": [[k, t, toks] for (k, t), toks in result.branches.items()], "timing": timing}
        return json.dumps(d).encode(), None
    if isinstance(result, DraftResult):
        return json.dumps({"tokens": result.tokens, "timing": timing}).encode(), result.probs
    return json.dumps(asdict(result)).encode(), None


def decode_result(op: str, payload: bytes, probs: torch.Tensor | None):
    d = json.loads(payload)
    if op == "verify":
        return VerifyResult(**d)
    if op == "release":
        return None
    timing = d.get("timing", [])
    if op == "speculate":
        return SpeculateResult({(k, t): toks for k, t, toks in d["branches"]}, timing)
    return DraftResult(d["tokens"], probs if probs is not None and probs.numel() else None, timing)
