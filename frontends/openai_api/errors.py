"""OpenAI's error shape and the status each failure maps to.

400 for a request the server cannot serve as written (with `param` naming the field), 404 for an
unknown model, 503 when Triton cannot be reached or has no room for the request (clients retry
503; a busy refusal carries `Retry-After`, the seconds the `ssd` model's message names), 500 for a
generation that failed inside the server.
"""
from __future__ import annotations

import re

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 500: "server_error",
          503: "service_unavailable"}
# the ssd model names the input in every validation error: "input 'top_p': must be in (0, 1] ..."
_INPUT_ERROR = re.compile(r"input '([a-z_]+)': ")
# a busy refusal ends "retry in N s" (backends/python_ssd/ssd/decoding/admission.py)
_RETRY_IN = re.compile(r"retry in (\d+) s")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after  # seconds, sent as the Retry-After header

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def from_triton(message: str) -> ApiError:
    """A Triton error message -> the OpenAI error the client should see."""
    m = _INPUT_ERROR.search(message)
    if m:
        field = {"text_input": "prompt"}.get(m.group(1), m.group(1))
        return ApiError(400, message[m.start():], field)
    # the ssd model's server-side classes (backends/python_ssd/ssd/serving/errors.py) start with these
    if "server busy: " in message:
        m = _RETRY_IN.search(message)
        return ApiError(503, message, code="server_busy", retry_after=int(m.group(1)) if m else None)
    if "engine unavailable: " in message:
        return ApiError(503, message, code="engine_unavailable")
    if "is not ready" in message or "Request for unknown model" in message:
        return ApiError(503, f"the ssd model is not available: {message}", code="model_not_ready")
    return ApiError(500, message)
