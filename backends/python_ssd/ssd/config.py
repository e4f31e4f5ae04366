"""The orchestrator's settings: every default and limit in one place, checked once.

``ServerConfig`` holds what `model_repository/ssd/config.pbtxt` may set; each `parameters` entry
overrides the field of the same name (``ServerConfig.from_parameters``). ``DecodeConfig`` is one
request's decoding knobs; the server's defaults fill what a request leaves out, and the same
``DecodeConfig.validate`` checks a request, the defaults and what the benches send.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

MODES = ("ar", "sd", "ssd")
BACKUPS = ("auto", "neural", "fast")
FANOUT_SHAPES = ("uniform", "geometric")
CHOICE_NAMES = ("ssd+neural", "ssd+fast", "sd", "ar", "sd@wide", "ar@wide", "lookup", "lookup@wide")  # what force_mode may pin (scheduler.Choice)
SUFFIX_SCOPES = ("global", "request")
LOOKUP_K_MAX = 31  # a free draft's longest: K + 1 verify rows within the target's 32-row tile
# K: a round verifies K + 1 rows per sequence; past 7 the acceptance^K tail adds almost nothing and
# the verify leaves the batch-invariant target's 32-row tile at 4 sequences already
K_MIN, K_MAX = 1, 7
AR_STEPS_MAX = 32  # AR steps of one call: a streamed block, and how long a new request waits to join
# B: branches the drafter pre-drafts per sequence; each is a tree row every speculation step
BUDGET_MAX = 64

# the request input each DecodeConfig field is read from, where the names differ
_INPUT_NAMES = {"k": "num_draft_tokens"}


@dataclass
class DecodeConfig:
    mode: str = "ssd"
    k: int = 4  # num_draft_tokens; with adaptive_k the most a round drafts
    fanout_budget: int = 12  # the bench's budget sweep (docs/benchmarks.md: the defaults)
    fanout_shape: str = "geometric"
    saguaro_c: float = 1.0
    backup: str = "auto"
    step_aside: bool = True  # ssd only: the scheduler may run SD or AR rounds when they predict more
    adaptive_k: bool = True  # ssd only: the scheduler picks each choice's K up to k
    # ssd only: lookup rounds where the server offers them (ServerConfig.free_drafts); false also
    # keeps the request's text out of the suffix cache
    free_drafts: bool = True

    def allowed(self, wide: bool = False, lookup: bool = False) -> tuple[str, ...]:
        """The choices the scheduler may make for this request: ar and sd requests run their mode
        on the split layout (the baselines); an ssd request may step aside to SD and AR, on the
        wide layout too where the server offers it (``wide``), and to free drafts (``lookup``)."""
        if self.mode != "ssd":
            return (self.mode,)
        ssd = ("ssd+neural", "ssd+fast") if self.backup == "auto" else (f"ssd+{self.backup}",)
        if not self.step_aside:
            return ssd
        free = (("lookup", "lookup@wide") if wide else ("lookup",)) if lookup and self.free_drafts else ()
        return ssd + ("sd", "ar") + (("sd@wide", "ar@wide") if wide else ()) + free

    def validate(self, label: Callable[[str], str] = lambda name: f"input '{name}'") -> None:
        """Raises ValueError naming the offending field, as ``label`` spells it (a request input
        by default; config.pbtxt's parameters for the server's defaults)."""
        def check(ok: bool, field: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{label(_INPUT_NAMES.get(field, field))}: {msg}")
        check(self.mode in MODES, "mode", f"must be one of {', '.join(MODES)}, got {self.mode!r}")
        check(self.backup in BACKUPS, "backup", f"must be one of {', '.join(BACKUPS)}, got {self.backup!r}")
        check(K_MIN <= self.k <= K_MAX, "k", f"must be in {K_MIN}..{K_MAX}, got {self.k}")
        check(self.k + 1 <= self.fanout_budget <= BUDGET_MAX, "fanout_budget",
              f"must be in {self.k + 1}..{BUDGET_MAX} (at least num_draft_tokens + 1), got {self.fanout_budget}")
        check(self.fanout_shape in FANOUT_SHAPES, "fanout_shape",
              f"must be one of {', '.join(FANOUT_SHAPES)}, got {self.fanout_shape!r}")
        check(0.0 <= self.saguaro_c <= 1.0, "saguaro_c", f"must be in [0, 1], got {self.saguaro_c}")


@dataclass
class ServerConfig:
    tokenizer: str = "qwen2.5-coder-1.5b"  # engine folder whose tokenizer the server uses
    default_mode: str = "ssd"
    num_draft_tokens: int = 4
    fanout_budget: int = 12
    fanout_shape: str = "geometric"
    saguaro_c: float = 1.0
    backup: str = "auto"
    step_aside: bool = True
    adaptive_k: bool = True
    force_backup: str = ""  # neural | fast: every SSD round uses it ("": the scheduler decides)
    force_mode: str = ""  # one of CHOICE_NAMES pins every ssd round ("": the scheduler decides)
    default_max_tokens: int = 128
    # the llama.cpp target allocates its KV at load for max_sequences x max_len (its own parameters,
    # 16 x 2048 by default): these stay within them
    max_tokens_limit: int = 1024
    max_seq_len: int = 2048
    coalesce_window_ms: float = 50.0  # longest a call waits for the batch's other calls (0: no barrier)
    max_active_requests: int = 16
    # K is lowered until batch x (K + 1) verify rows fit: the batch-invariant CPU target runs larger
    # forwards as several GEMM tiles (0: no cap)
    max_verify_rows: int = 32
    # threads an engine computes with in a wide round (choices "sd@wide", "ar@wide": the engine at
    # work gets every core; engines' `wide_cores`); 0: split rounds only
    wide_threads: int = 2
    # AR steps per target call (multi-step decoding, as vLLM's num_scheduler_steps): the round trip
    # to the target process (~2 ms on CPU) is paid once a call, and a batch of b sequences shares
    # one, so each AR round of a batch of b takes ceil(ar_steps / b) steps. A call still stops at an
    # end token and at max_tokens; streamed AR output comes in blocks of up to that many tokens
    ar_steps: int = 8
    # KV admission (decoding/admission.py): tokens of every engine's KV that requests may reserve
    # together (0: no budget), and how long a request that does not fit yet may wait
    kv_budget_tokens: int = 65536
    kv_wait_s: float = 30.0
    # the engine models whose dead processes are reloaded (serving/supervisor.py)
    supervise: bool = True
    supervise_engines: str = "target,drafter_primary,drafter_backup"
    supervise_interval_s: float = 0.5
    # free drafts (algorithm/free_draft.py): lookup rounds, SD whose drafts come from the request's
    # own text and the suffix cache, offered to the scheduler; their longest draft
    free_drafts: bool = True
    lookup_max_k: int = 16
    # the suffix cache of earlier requests' prompts and outputs: its bound in tokens (0: off; about
    # 150 bytes a token) and its scope: global (every request drafts from every earlier one) or
    # request (a request drafts from its own text only)
    suffix_cache_tokens: int = 65536
    suffix_cache_scope: str = "global"

    @classmethod
    def from_parameters(cls, params: dict[str, str], ignore: tuple[str, ...] = ("role",)) -> "ServerConfig":
        """The defaults, overridden by config.pbtxt's string parameters of the same names (an
        empty string keeps the default). An unknown name is an error: a typo must not pass silently."""
        types = {f.name: f.type for f in fields(cls)}
        values = {}
        for name, raw in params.items():
            if name in ignore:
                continue
            if name not in types:
                raise ValueError(f"parameter '{name}': unknown (known: {', '.join(types)})")
            if raw == "" and types[name] != "str":
                continue
            values[name] = _parse(name, raw, types[name])
        cfg = replace(cls(), **values)
        cfg.validate()
        return cfg

    def decode_defaults(self) -> DecodeConfig:
        return DecodeConfig(mode=self.default_mode, k=self.num_draft_tokens, fanout_budget=self.fanout_budget,
                            fanout_shape=self.fanout_shape, saguaro_c=self.saguaro_c, backup=self.backup,
                            step_aside=self.step_aside, adaptive_k=self.adaptive_k, free_drafts=self.free_drafts)

    def validate(self) -> None:
        names = {"mode": "default_mode"}
        self.decode_defaults().validate(lambda n: f"parameter '{names.get(n, n)}'")

        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"parameter '{name}': {msg}")
        check(self.force_backup in ("", "neural", "fast"), "force_backup",
              f"must be '', 'neural' or 'fast', got {self.force_backup!r}")
        check(self.force_mode in ("",) + CHOICE_NAMES, "force_mode",
              f"must be '' or one of {', '.join(CHOICE_NAMES)}, got {self.force_mode!r}")
        check(self.default_max_tokens >= 1, "default_max_tokens", f"must be >= 1, got {self.default_max_tokens}")
        check(self.default_max_tokens <= self.max_tokens_limit, "max_tokens_limit",
              f"must be >= default_max_tokens ({self.default_max_tokens}), got {self.max_tokens_limit}")
        check(self.max_tokens_limit < self.max_seq_len, "max_seq_len",
              f"must exceed max_tokens_limit ({self.max_tokens_limit}), got {self.max_seq_len}")
        check(self.coalesce_window_ms >= 0, "coalesce_window_ms", f"must be >= 0, got {self.coalesce_window_ms}")
        check(self.max_active_requests >= 1, "max_active_requests", f"must be >= 1, got {self.max_active_requests}")
        check(self.max_verify_rows >= 0, "max_verify_rows", f"must be >= 0, got {self.max_verify_rows}")
        check(self.wide_threads >= 0, "wide_threads", f"must be >= 0, got {self.wide_threads}")
        check(1 <= self.ar_steps <= AR_STEPS_MAX, "ar_steps", f"must be in 1..{AR_STEPS_MAX}, got {self.ar_steps}")
        check(self.kv_budget_tokens >= 0, "kv_budget_tokens", f"must be >= 0, got {self.kv_budget_tokens}")
        check(self.kv_wait_s >= 0, "kv_wait_s", f"must be >= 0, got {self.kv_wait_s}")
        check(self.supervise_interval_s > 0, "supervise_interval_s",
              f"must be > 0, got {self.supervise_interval_s}")
        check(1 <= self.lookup_max_k <= LOOKUP_K_MAX, "lookup_max_k",
              f"must be in 1..{LOOKUP_K_MAX}, got {self.lookup_max_k}")
        check(self.suffix_cache_tokens >= 0, "suffix_cache_tokens", f"must be >= 0, got {self.suffix_cache_tokens}")
        check(self.suffix_cache_scope in SUFFIX_SCOPES, "suffix_cache_scope",
              f"must be one of {', '.join(SUFFIX_SCOPES)}, got {self.suffix_cache_scope!r}")

    def suffix_cache(self):
        """The server's suffix cache, or None where it is off or its scope is the request."""
        from .algorithm.suffix_cache import SuffixCache

        if not self.free_drafts or self.suffix_cache_tokens == 0 or self.suffix_cache_scope != "global":
            return None
        return SuffixCache(self.suffix_cache_tokens)


def _parse(name: str, raw: str, kind: str):
    try:
        if kind == "bool":
            if raw.lower() not in ("true", "false"):
                raise ValueError
            return raw.lower() == "true"
        return {"int": int, "float": float, "str": str}[kind](raw)
    except ValueError:
        raise ValueError(f"parameter '{name}': expected a {kind}, got {raw!r}") from None
