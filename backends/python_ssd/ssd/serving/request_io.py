"""Reading a generate request (Triton's generate extension + SSD's own knobs) and checking it.

Every problem is a ValueError that names the input, so clients get "input 'top_p': ..." back and
the server carries on with the other requests.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import triton_python_backend_utils as pb_utils

from ..algorithm.sampling import SamplingParams
from ..config import DecodeConfig


@dataclass
class GenerateRequest:
    text: str
    max_tokens: int
    params: SamplingParams
    seed: int
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    apply_chat_template: bool = True
    decode: DecodeConfig = field(default_factory=DecodeConfig)


def _value(request, name: str):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return None
    arr = t.as_numpy().reshape(-1)
    if arr.size == 0:
        return None
    return arr


def _scalar(request, name: str, kind, default):
    arr = _value(request, name)
    if arr is None:
        return default
    v = arr[0]
    try:
        if kind is str:
            return v.decode("utf-8") if isinstance(v, bytes) else str(v)
        if kind is bool:
            if isinstance(v, bytes):
                v = v.decode().lower()
                if v not in ("true", "false", "1", "0"):
                    raise ValueError
                return v in ("true", "1")
            return bool(v)
        return kind(v)
    except (ValueError, TypeError, UnicodeDecodeError):
        raise ValueError(f"input '{name}': expected a {kind.__name__}, got {v!r}") from None


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"input '{name}': {msg}")


def parse_request(request, defaults: DecodeConfig, default_max_tokens: int, max_tokens_limit: int) -> GenerateRequest:
    text = _scalar(request, "text_input", str, None)
    _check(text is not None and text != "", "text_input", "is required and must be a non-empty string")
    max_tokens = _scalar(request, "max_tokens", int, default_max_tokens)
    _check(1 <= max_tokens <= max_tokens_limit, "max_tokens", f"must be in 1..{max_tokens_limit}, got {max_tokens}")
    temperature = _scalar(request, "temperature", float, 0.0)
    _check(0.0 <= temperature <= 100.0, "temperature", f"must be in [0, 100], got {temperature}")
    top_p = _scalar(request, "top_p", float, 1.0)
    _check(0.0 < top_p <= 1.0, "top_p", f"must be in (0, 1], got {top_p}")
    top_k = _scalar(request, "top_k", int, 0)
    _check(top_k >= 0, "top_k", f"must be >= 0 (0 disables it), got {top_k}")
    # No seed: a fresh random one (sampled requests differ, as in vLLM); greedy ignores it.
    seed = _scalar(request, "seed", int, None)
    if seed is None:
        seed = secrets.randbits(62)
    _check(0 <= seed < 2**63, "seed", f"must be in [0, 2^63), got {seed}")
    stop_arr = _value(request, "stop")
    stop = [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in stop_arr] if stop_arr is not None else []
    stop = [s for s in stop if s]
    k = _scalar(request, "num_draft_tokens", int, defaults.k)
    decode = DecodeConfig(
        mode=_scalar(request, "mode", str, defaults.mode).lower(), k=k,
        fanout_budget=_scalar(request, "fanout_budget", int, max(defaults.fanout_budget, k + 1)),
        fanout_shape=_scalar(request, "fanout_shape", str, defaults.fanout_shape),
        saguaro_c=_scalar(request, "saguaro_c", float, defaults.saguaro_c),
        backup=_scalar(request, "backup", str, defaults.backup).lower(),
        step_aside=_scalar(request, "step_aside", bool, defaults.step_aside),
        adaptive_k=_scalar(request, "adaptive_k", bool, defaults.adaptive_k),
        free_drafts=_scalar(request, "free_drafts", bool, defaults.free_drafts))
    decode.validate()  # the same limits as the server's defaults (config.py)
    return GenerateRequest(
        text=text, max_tokens=max_tokens, params=SamplingParams(temperature, top_p, top_k), seed=seed,
        stop=stop, stream=_scalar(request, "stream", bool, False),
        apply_chat_template=_scalar(request, "apply_chat_template", bool, True),
        decode=decode,
    )
