"""How the `ssd` model words and codes its errors, so that any frontend can tell them apart.

Every error carries a Triton error code (INVALID_ARG, UNAVAILABLE, INTERNAL) and a message that
starts with its class. The code reaches clients of Triton's C API; tritonserver 2.51's HTTP
generate endpoints answer every model error with 400, a gRPC stream delivers an error as a message
without a status, and `/infer` does not serve a decoupled model, so the prefix is what a client of
Triton sees (docs/reliability.md). ``http_status`` maps a message back to the status it stands for.
"""
from __future__ import annotations

BUSY = "server busy: "  # retry later: a limit was reached (503)
UNAVAILABLE = "engine unavailable: "  # retry later: an engine process died and is being reloaded (503)
INTERNAL = "internal error: "  # a server-side failure (500)

CODE = {BUSY: "UNAVAILABLE", UNAVAILABLE: "UNAVAILABLE", INTERNAL: "INTERNAL"}


def http_status(message: str) -> int:
    """503 / 500 for the server-side classes above; 400 for anything else (a bad input names its field)."""
    if message.startswith((BUSY, UNAVAILABLE)):
        return 503
    if message.startswith(INTERNAL):
        return 500
    return 400
