"""Every model's settings: every default and limit in one place, checked once at load.

``ServerConfig`` holds what `model_repository/ssd/config.pbtxt` may set, the scheduler's knobs
(``PolicyConfig``) included; ``EngineConfig`` what an engine model's (`target`, `drafter_primary`,
`drafter_backup`) may set. Each `parameters` entry overrides the field of the same name
(``from_parameters``); an unknown name or a bad value is refused, naming the parameter and the
model. ``DecodeConfig`` is one request's decoding knobs; the server's defaults fill what a request
leaves out, and the same ``DecodeConfig.validate`` checks a request, the defaults and what the
benches send. Its fields are the request inputs the `ssd` model and the OpenAI frontend accept
(``DECODE_INPUTS``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Callable

from .algorithm.scheduler import PolicyConfig

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
TARGET_BACKENDS = ("python_ssd", "tensorrtllm")  # what serves the target (and the SD drafter)

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


# the request inputs that set a DecodeConfig (the `ssd` model's, the OpenAI frontend's extra body
# fields): input name -> (field, Python type)
_PY_TYPES = {"str": str, "int": int, "float": float, "bool": bool}  # fields' annotations, as strings
DECODE_INPUTS = {_INPUT_NAMES.get(f.name, f.name): (f.name, _PY_TYPES[f.type]) for f in fields(DecodeConfig)}


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
    # more requests wait for a slot, first come first served (decoding/admission.py): at most
    # max_queued_requests of them, each up to queue_wait_s, then "server busy ... retry in N s"
    queue_wait_s: float = 30.0
    max_queued_requests: int = 64
    # a request's deadline (its `timeout_s` input; 0: none), from arrival: past it the generation
    # stops with finish_reason "timeout". The one bound on a non-streamed HTTP generate whose client
    # hung up: Triton's HTTP frontend tells the model nothing then (docs/reliability.md)
    request_timeout_s: float = 300.0
    # K is lowered until batch x (K + 1) verify rows fit: the llama.cpp target's longest exact
    # forward (its logit_rows, 32 where its load check passes); more rows run as several forwards,
    # each reading every weight again (0: no cap)
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
    # what the `target` model is: this backend's engine server (python_ssd) or Triton's own TensorRT-LLM
    # backend (tensorrtllm: verification over its tensors, serving/trtllm_backend_client.py), and then
    # its engine's padded vocabulary, the width of draft logits (0: the drafter's rows as they are)
    target_backend: str = "python_ssd"
    target_vocab_size: int = 0
    # what drafts SD: the torch drafter (python_ssd, `drafter_primary`) or the drafter engine on
    # Triton's TensorRT-LLM backend (tensorrtllm: a generation request of K tokens to the model
    # `drafter_model`); speculation trees stay on `drafter_primary` (docs/tensorrt_llm.md)
    drafter_backend: str = "python_ssd"
    drafter_model: str = "drafter_trtllm"
    # free drafts (algorithm/free_draft.py): lookup rounds, SD whose drafts come from the request's
    # own text and the suffix cache, offered to the scheduler; their longest draft: K + 1 = 32 rows
    # are one forward of the llama.cpp target (its logit_rows), a 33rd would cost a forward of its
    # own (the cost model picks a round's K up to it)
    free_drafts: bool = True
    lookup_max_k: int = 31
    # the suffix cache of earlier requests' prompts and outputs: its bound in tokens (0: off; about
    # 1.2 KB a token with its three keys) and its scope: global (every request drafts from every
    # earlier one) or request (a request drafts from its own text only)
    suffix_cache_tokens: int = 65536
    suffix_cache_scope: str = "global"
    # the scheduler's knobs (algorithm/scheduler.py), set by parameters of their own names
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    @classmethod
    def parameter_names(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "policy"] + [f.name for f in fields(PolicyConfig)]

    @classmethod
    def from_parameters(cls, params: dict[str, str], model: str = "ssd") -> "ServerConfig":
        """The defaults, overridden by config.pbtxt's string parameters of the same names (an
        empty string keeps the default). An unknown name is an error: a typo must not pass silently."""
        with _naming(model):
            own = {f.name for f in fields(cls)} - {"policy"}
            values = _parse_all(params, {**_types(cls, own), **_types(PolicyConfig)})
            policy = PolicyConfig(**{k: v for k, v in values.items() if k not in own})
            cfg = replace(cls(), policy=policy, **{k: v for k, v in values.items() if k in own})
            cfg.validate()
        return cfg

    def decode_defaults(self) -> DecodeConfig:
        return DecodeConfig(mode=self.default_mode, k=self.num_draft_tokens, fanout_budget=self.fanout_budget,
                            fanout_shape=self.fanout_shape, saguaro_c=self.saguaro_c, backup=self.backup,
                            step_aside=self.step_aside, adaptive_k=self.adaptive_k, free_drafts=self.free_drafts)

    def longest_verify_rows(self) -> int:
        """The most rows one sequence's verify takes: K + 1 for the longest K a request may ask for
        or, with free drafts, a lookup may draft, within ``max_verify_rows``."""
        k = max(K_MAX, self.lookup_max_k if self.free_drafts else 0)
        return min(k + 1, self.max_verify_rows) if self.max_verify_rows else k + 1

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
        check(self.queue_wait_s >= 0, "queue_wait_s", f"must be >= 0, got {self.queue_wait_s}")
        check(self.max_queued_requests >= 0, "max_queued_requests", f"must be >= 0, got {self.max_queued_requests}")
        check(self.request_timeout_s >= 0, "request_timeout_s", f"must be >= 0, got {self.request_timeout_s}")
        check(self.max_verify_rows >= 0, "max_verify_rows", f"must be >= 0, got {self.max_verify_rows}")
        check(self.wide_threads >= 0, "wide_threads", f"must be >= 0, got {self.wide_threads}")
        check(1 <= self.ar_steps <= AR_STEPS_MAX, "ar_steps", f"must be in 1..{AR_STEPS_MAX}, got {self.ar_steps}")
        check(self.kv_budget_tokens >= 0, "kv_budget_tokens", f"must be >= 0, got {self.kv_budget_tokens}")
        check(self.kv_wait_s >= 0, "kv_wait_s", f"must be >= 0, got {self.kv_wait_s}")
        check(self.supervise_interval_s > 0, "supervise_interval_s",
              f"must be > 0, got {self.supervise_interval_s}")
        check(self.target_backend in TARGET_BACKENDS, "target_backend",
              f"must be one of {', '.join(TARGET_BACKENDS)}, got {self.target_backend!r}")
        check(self.drafter_backend in TARGET_BACKENDS, "drafter_backend",
              f"must be one of {', '.join(TARGET_BACKENDS)}, got {self.drafter_backend!r}")
        check(self.drafter_backend != "tensorrtllm" or bool(self.drafter_model), "drafter_model",
              "must name the drafter's tensorrtllm model when drafter_backend is 'tensorrtllm'")
        check(self.target_vocab_size >= 0, "target_vocab_size", f"must be >= 0, got {self.target_vocab_size}")
        self.policy.validate()
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


ROLES = ("target", "drafter", "fast_backup")
BACKENDS = ("torch", "openvino", "llamacpp", "tensorrt_llm")
WEIGHT_QUANT = ("", "int8", "int8_full")


@dataclass
class EngineConfig:
    """An engine model's settings. Every field not in ROLE_DEFAULTS has one default for every
    role; the shipped config.pbtxt files restate their role's defaults (tests/test_config.py)."""
    role: str = "target"  # target | drafter | fast_backup (the n-gram backup: no model)
    # the engine folder (under SSD_ENGINE_ROOT, else engines/) and the runtime that serves it: torch,
    # openvino, llamacpp (targets) or tensorrt_llm (targets); "": the folder's `runtime`, else torch
    engine: str = ""
    engine_backend: str = ""
    # CPU placement (serving/placement.py): the process's own cores and thread count (split rounds)
    # and the cores of a wide round; "": unpinned; threads 0: the runtime's own count
    cores: str = ""
    threads: int = 1
    wide_cores: str = ""
    # a row's logits never depend on the other rows, so greedy output is exact under any batch
    batch_invariant: bool = True
    # sequences held at once. llamacpp allocates a KV stream for each at load, max_len (+ draft
    # headroom) tokens long; torch and openvino grow a sequence's KV as it goes and evict the least
    # recently used past the count
    max_sequences: int = 16
    max_len: int = 2048  # llamacpp: the longest sequence, in tokens (torch: the model's own)
    # llamacpp: MB of host RAM for finished sequences' KV past the streams (llama-server's --cache-ram;
    # engine/prefix_store.py), so a prompt whose prefix was seen before is not computed again; 0: off
    cache_ram_mb: float = 384.0
    dtype: str = ""  # torch: the compute dtype ("": the engine folder's)
    device: str = "cpu"  # torch: cpu | cuda | cuda:N
    head_vocab: int = 0  # torch: an output head over the first head_vocab ids only (0: all)
    weight_quant: str = ""  # torch drafters: int8 | int8_full weights ("": the compute dtype)
    static_kv_len: int = 0  # torch: > 0, a static KV pool of that many tokens a sequence (engine/static_engine.py)
    cuda_graphs: str = ""  # torch with static_kv_len: "true" | "false" ("": on a GPU)
    ov_weights: str = ""  # openvino: the weights' format ("": the folder's, else bf16)
    gpu_device_ids: str = ""  # tensorrt_llm: the GPUs of the tensor-parallel group
    ngram_max: int = 4  # fast_backup: the longest and shortest n-gram it looks up
    ngram_min: int = 1

    @classmethod
    def from_parameters(cls, params: dict[str, str], model: str = "") -> "EngineConfig":
        """The defaults of the model's role (its `role` parameter), overridden by its config.pbtxt's
        string parameters of the same names (an empty string keeps the default of a number or a
        bool). An unknown name or a bad value is an error naming the parameter and the model
        (``model``; unnamed, its role)."""
        with _naming(model or params.get("role", "")):
            role = params.get("role", "")
            if role not in ROLES:
                raise ValueError(f"parameter 'role': must be one of {', '.join(ROLES)}, got {role!r}")
            cfg = replace(cls.defaults(role), **_parse_all(params, _types(cls)))
            cfg.validate()
        return cfg

    @classmethod
    def defaults(cls, role: str) -> "EngineConfig":
        return cls(role=role, **ROLE_DEFAULTS[role])

    def validate(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"parameter '{name}': {msg}")
        check(self.engine_backend in ("",) + BACKENDS, "engine_backend",
              f"must be empty or one of {', '.join(BACKENDS)}, got {self.engine_backend!r}")
        check(self.role == "target" or self.engine_backend not in ("llamacpp", "tensorrt_llm"), "engine_backend",
              f"{self.engine_backend} serves the target only; the {self.role} speculates with tree rows, which "
              "needs engine_backend 'torch' or 'openvino' (a TensorRT-LLM drafter for SD is a model of Triton's "
              "tensorrtllm backend, the orchestrator's drafter_backend)")
        for name in ("cores", "wide_cores", "gpu_device_ids"):
            check(all(c.strip().isdigit() for c in getattr(self, name).split(",") if c.strip()), name,
                  f"must be comma-separated numbers, got {getattr(self, name)!r}")
        check(self.threads >= 0, "threads", f"must be >= 0 (0: the runtime's own), got {self.threads}")
        check(self.max_sequences >= 1, "max_sequences", f"must be >= 1, got {self.max_sequences}")
        check(self.max_len >= 1, "max_len", f"must be >= 1, got {self.max_len}")
        check(self.cache_ram_mb >= 0, "cache_ram_mb", f"must be >= 0, got {self.cache_ram_mb}")
        check(self.head_vocab >= 0, "head_vocab", f"must be >= 0 (0: the whole vocabulary), got {self.head_vocab}")
        check(self.weight_quant in WEIGHT_QUANT, "weight_quant",
              f"must be empty, 'int8' or 'int8_full', got {self.weight_quant!r}")
        check(not (self.weight_quant and self.batch_invariant), "weight_quant",
              f"{self.weight_quant!r} changes the logits: it needs batch_invariant false (a drafter)")
        check(self.static_kv_len >= 0, "static_kv_len", f"must be >= 0, got {self.static_kv_len}")
        check(self.cuda_graphs in ("", "true", "false"), "cuda_graphs",
              f"must be empty, 'true' or 'false', got {self.cuda_graphs!r}")
        check(1 <= self.ngram_min <= self.ngram_max, "ngram_min",
              f"must be in 1..ngram_max ({self.ngram_max}), got {self.ngram_min}")


# The default deployment, per role: what a field is where the model's config.pbtxt says nothing.
# The target is exact and its llama.cpp KV is allocated at load (16 streams); the drafter needs no
# exactness (verification is exact whatever it drafts), so its steps take int8 weights and an output
# head over the 32768 most frequent ids, and it holds more sequences, cheaply, on torch.
ROLE_DEFAULTS = {
    "target": dict(engine="qwen2.5-coder-1.5b", cores="0", wide_cores="0,1"),
    "drafter": dict(engine="qwen2.5-coder-0.5b", cores="1", wide_cores="0,1", batch_invariant=False,
                    max_sequences=64, head_vocab=32768, weight_quant="int8_full"),
    "fast_backup": dict(cores="1"),
}


@contextmanager
def _naming(model: str):
    """Prefixes a ValueError raised inside with the model it concerns."""
    try:
        yield
    except ValueError as e:
        raise ValueError(f"model '{model}': {e}") from None


def _types(cls, names=None) -> dict[str, str]:
    return {f.name: f.type for f in fields(cls) if names is None or f.name in names}


def _parse_all(params: dict[str, str], types: dict[str, str]) -> dict:
    """``params`` parsed to the types of the fields of the same names ("role" is every model's);
    an empty string keeps the default of a number or a bool."""
    values = {}
    for name, raw in params.items():
        if name not in types:
            if name == "role":
                continue
            raise ValueError(f"parameter '{name}': unknown (known: {', '.join(types)})")
        if raw == "" and types[name] != "str":
            continue
        values[name] = _parse(name, raw, types[name])
    return values


def _parse(name: str, raw: str, kind: str):
    try:
        if kind == "bool":
            if raw.lower() not in ("true", "false"):
                raise ValueError
            return raw.lower() == "true"
        return _PY_TYPES[kind](raw)
    except ValueError:
        raise ValueError(f"parameter '{name}': expected a {kind}, got {raw!r}") from None
