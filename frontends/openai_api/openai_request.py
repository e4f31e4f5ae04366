"""An OpenAI request body -> the `ssd` model's generate inputs, checked field by field.

Only what the frontend alone can judge is checked here (shapes, types, OpenAI-only fields such as
`n`); value ranges of the generate inputs are the `ssd` model's to check, and its error names the
input, which becomes the `param` of the 400 (see errors.py). The prompt is rendered here with the
tokenizer's own chat template, the way the `ssd` model renders a generate request, so a one-message
chat is the same token sequence through either endpoint.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ssd_openai.errors import ApiError

# SSD's knobs, accepted as extra body fields and passed through as the generate inputs of the same name
SSD_FIELDS = {
    "mode": str, "num_draft_tokens": int, "fanout_budget": int, "fanout_shape": str, "saguaro_c": float,
    "backup": str, "step_aside": bool, "adaptive_k": bool, "free_drafts": bool, "top_k": int,
}
ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class GenerateCall:
    """What one OpenAI request asks of the `ssd` model."""
    model: str
    text: str
    chat: bool
    stream: bool
    include_usage: bool
    inputs: dict[str, tuple[np.ndarray, str]] = field(default_factory=dict)


def _typed(body: dict, name: str, kind):
    v = body.get(name)
    if v is None:
        return None
    ok = {bool: isinstance(v, bool),
          int: isinstance(v, int) and not isinstance(v, bool),
          float: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: isinstance(v, str)}[kind]
    if not ok:
        raise ApiError(400, f"'{name}' must be a {kind.__name__}, got {type(v).__name__} {v!r}", name)
    return kind(v)


def _put(inputs: dict, name: str, value, kind) -> None:
    if value is None:
        return
    dt = {bool: (np.bool_, "BOOL"), int: (np.int32, "INT32"), float: (np.float32, "FP32"),
          str: (np.object_, "BYTES")}[kind]
    if name == "seed":
        dt = (np.int64, "INT64")
    if kind is str:
        value = value.encode("utf-8")
    inputs[name] = (np.array([value], dtype=dt[0]), dt[1])


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)) or len(stop) > 4:
        raise ApiError(400, "'stop' must be a string or a list of at most 4 strings", "stop")
    return [s for s in stop if s]


def _message_text(i: int, content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text parts can be served
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(400, f"'messages[{i}].content': only text parts are supported", f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"'messages[{i}].content' must be a string or a list of text parts", f"messages[{i}].content")


def chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' is required and must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"'messages[{i}].role' must be one of {', '.join(ROLES)}", f"messages[{i}].role")
        out.append({"role": m["role"], "content": _message_text(i, m.get("content"))})
    return out


def completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' is required and must be a non-empty string (one prompt per request)", "prompt")
    return prompt


def _refuse_unsupported(body: dict) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, f"'n' must be 1 (one choice per request), got {n!r}", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != 1:
        raise ApiError(400, f"'best_of' must be 1, got {best_of!r}", "best_of")
    for name in ("logprobs", "top_logprobs", "echo", "tools", "functions", "suffix"):
        if body.get(name) not in (None, False, [], 0, ""):
            raise ApiError(400, f"'{name}' is not supported by this server", name)


def parse(body, chat: bool, render_chat) -> GenerateCall:
    """``render_chat(messages) -> str`` renders a message list with the tokenizer's chat template."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' is required and must be a string", "model")
    _refuse_unsupported(body)
    if chat:
        text = render_chat(chat_messages(body))
    else:
        text = completion_prompt(body)
    stream = _typed(body, "stream", bool) or False
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    include_usage = bool(stream and options and options.get("include_usage"))
    max_tokens = _typed(body, "max_completion_tokens", int) if chat else None
    if max_tokens is None:
        max_tokens = _typed(body, "max_tokens", int)
    inputs: dict = {}
    # the template is already applied above; the ssd model tokenizes the text as it is
    _put(inputs, "text_input", text, str)
    _put(inputs, "apply_chat_template", False, bool)
    _put(inputs, "stream", stream, bool)
    _put(inputs, "max_tokens", max_tokens, int)
    _put(inputs, "temperature", _typed(body, "temperature", float), float)
    _put(inputs, "top_p", _typed(body, "top_p", float), float)
    seed = _typed(body, "seed", int)
    if seed is not None and seed < 0:
        raise ApiError(400, f"'seed' must be >= 0, got {seed}", "seed")
    _put(inputs, "seed", seed, int)
    stop = _stop(body)
    if stop:
        inputs["stop"] = (np.array([s.encode("utf-8") for s in stop], dtype=np.object_), "BYTES")
    for name, kind in SSD_FIELDS.items():
        _put(inputs, name, _typed(body, name, kind), kind)
    return GenerateCall(model=model, text=text, chat=chat, stream=stream, include_usage=include_usage, inputs=inputs)
