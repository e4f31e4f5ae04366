"""llama.cpp's own `llama-server` as a bench peer: the field's standard CPU runtime on the same GGUF files.

The binary comes from tools/llamacpp/build_llama_server.sh (the llama.cpp that the pinned
llama-cpp-python sdist vendors). Two configurations, each a server of its own, pinned with taskset
to the cores our served default uses:
  ar    the target alone, ``threads`` threads
  spec  the target with llama.cpp's speculative decoding (``--spec-type draft-simple``, the drafter
        GGUF, ``n_draft`` drafts a round with no probability cut-off, ``threads`` + ``threads``)
and, named by ``peer_config``, draft-free ``--spec-type`` servers (``NGRAM_FLAGS``: its n-gram
speculation; tools/bench/free_drafts.py, tools/llamacpp/load_sweep.py, loadtest/peer_sweep.py).
Every request sends the token ids our server decodes (the same chat template) to ``/completion``,
greedy (top-k 1), without prompt caching; decode tokens/s is llama.cpp's own
``timings.predicted_per_second``: the tokens after the first (which the prefill's logits give) over
the time after the prefill (timed apart, in ``prompt_ms``).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "tools" / "llamacpp" / "build_llama_server.sh"


def build(python: str | None = None) -> Path:
    """Builds llama-server (or finds the cached build) and returns its path."""
    env = dict(os.environ, **({"PYTHON": python} if python else {}))
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, env=env, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def gguf_by_role(config: Path, engine_root: Path) -> dict[str, Path]:
    """The GGUF file each engine of ``config`` is built from (``build_engines.sh`` caches them)."""
    cfg = yaml.safe_load(config.read_text())
    return {spec["role"]: engine_root / ".cache" / cfg["sources"][spec["source"]]["file"]
            for spec in cfg["engines"].values()}


@dataclass
class PeerConfig:
    model: Path
    draft: Path | None = None  # set: llama.cpp's speculative decoding with this drafter
    n_draft: int = 4
    cores: str = "0,1"
    threads: int = 2
    draft_threads: int = 2
    parallel: int = 1  # slots: concurrent requests the server decodes in one batch
    ctx_per_slot: int = 4096
    extra: tuple[str, ...] = ()  # more flags (a draft-free --spec-type: NGRAM_FLAGS)
    label: str = ""

    @property
    def mode(self) -> str:
        return self.label or ("spec" if self.draft else "ar")


def command(binary: Path, cfg: PeerConfig, port: int) -> list[str]:
    cmd = ["taskset", "-c", cfg.cores, str(binary), "-m", str(cfg.model), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(cfg.threads), "-tb", str(cfg.threads), "--parallel", str(cfg.parallel),
           "-c", str(cfg.ctx_per_slot * cfg.parallel), "--no-webui"]
    if cfg.draft:
        # p-min 0: every round drafts n_draft tokens (a constant K, as our SD and SSD rounds)
        cmd += ["--spec-type", "draft-simple", "-md", str(cfg.draft), "--spec-draft-n-max", str(cfg.n_draft),
                "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "-td", str(cfg.draft_threads),
                "-tbd", str(cfg.draft_threads)]
    return cmd + list(cfg.extra)


# llama-server's draft-free speculation, flags as llama.cpp's docs/speculative.md gives them
NGRAM_FLAGS = {
    "ngram-simple": ("--spec-type", "ngram-simple", "--spec-draft-n-max", "64"),
    "ngram-map-k": ("--spec-type", "ngram-map-k", "--spec-draft-n-max", "64"),
    # "dense models: can reduce --spec-ngram-mod-n-min and --spec-ngram-mod-n-max"
    "ngram-mod": ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "24", "--spec-ngram-mod-n-min", "8",
                  "--spec-ngram-mod-n-max", "32"),
}
LLAMA_SIDES = ("llama-ar", *(f"llama-{t}" for t in NGRAM_FLAGS), "llama-spec")


def peer_config(side: str, ggufs: dict[str, Path], **kw) -> PeerConfig:
    """The server of one named side: ``llama-ar`` (the target alone), ``llama-<n-gram type>`` (a
    draft-free --spec-type of NGRAM_FLAGS) or ``llama-spec`` (draft-simple on the drafter GGUF);
    ``kw`` sets the rest of PeerConfig (parallel, cores, threads, ...)."""
    if side not in LLAMA_SIDES:
        raise ValueError(f"unknown llama-server side {side!r}: one of {', '.join(LLAMA_SIDES)}")
    kind = side.removeprefix("llama-")
    return PeerConfig(ggufs["target"], draft=ggufs["drafter"] if kind == "spec" else None,
                      extra=NGRAM_FLAGS.get(kind, ()), label=side, **kw)


def start_peers(stack, binary: Path, configs: dict[str, PeerConfig], log_dir: Path, tag: str = "") -> dict:
    """One LlamaServer per named config, each entered on ``stack`` (an ExitStack: they stop with it),
    its command printed and its log in ``log_dir``/<name><tag>.log."""
    servers = {}
    for name, cfg in configs.items():
        print(f"[llama] {name}: {' '.join(command(binary, cfg, 0))}", flush=True)
        servers[name] = stack.enter_context(LlamaServer(binary, cfg, log_dir / f"{name}{tag}.log"))
    return servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process; a context manager that stops it on exit."""

    def __init__(self, binary: Path, cfg: PeerConfig, log_file: Path | None = None):
        self.binary, self.cfg, self.port = binary, cfg, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = log_file
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 600) -> "LlamaServer":
        log = open(self.log_file, "w") if self.log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen(command(self.binary, self.cfg, self.port), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode} while loading"
                                   + (f" (log: {self.log_file})" if self.log_file else ""))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # 503 while the model loads, refused before the socket opens
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"llama-server not ready after {timeout:.0f} s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "LlamaServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *_) -> None:
        self.stop()

    def complete(self, ids: list[int], max_tokens: int) -> dict:
        """One greedy generation from the prompt's token ids: llama.cpp's response, plus ``latency_s``."""
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "seed": 1,
                "cache_prompt": False, "return_tokens": True, "stream": False}
        req = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=1800) as r:
            d = json.loads(r.read())
        d["latency_s"] = time.perf_counter() - t0
        return d


def peer_row(resp: dict) -> dict:
    """A bench row from one ``/completion`` response. llama.cpp reports the drafted and accepted
    tokens but not its rounds; each round yields its accepted drafts plus one target token, so the
    rounds after the first token are (tokens after it) - (accepted drafts)."""
    t = resp["timings"]
    drafted, accepted = t.get("draft_n"), t.get("draft_n_accepted")
    row = {"ids": list(resp["tokens"]), "new_tokens": t["predicted_n"], "decode_tokens_per_s": t["predicted_per_second"],
           "prefill_s": t["prompt_ms"] / 1000, "latency_s": resp.get("latency_s"), "prompt_tokens": t["prompt_n"],
           "draft_n": drafted, "draft_n_accepted": accepted, "acceptance_length": None, "draft_acceptance": None}
    if drafted:
        after_first = t["predicted_n"] - 1
        row["draft_acceptance"] = accepted / drafted
        row["acceptance_length"] = after_first / (after_first - accepted)
    return row


def run_peer(binary: Path, cfg: PeerConfig, prompts: list[dict], max_tokens: int, warm_ids: list[int],
             on_row=None, log_file: Path | None = None) -> list[dict]:
    """Every prompt ({dataset, index, ids}) through one server of ``cfg``, after one warm-up request."""
    rows = []
    with LlamaServer(binary, cfg, log_file) as srv:
        srv.complete(warm_ids, 8)
        for p in prompts:
            row = {"dataset": p["dataset"], "prompt": p["index"], "mode": cfg.mode,
                   "k": cfg.n_draft if cfg.draft else 0, "threads": cfg.threads,
                   **peer_row(srv.complete(p["ids"], max_tokens))}
            rows.append(row)
            if on_row:
                on_row(row)
    return rows


def bench_phase(config: Path, engine_root: Path, prompts: list[dict], max_tokens: int, warm_ids: list[int],
                out: Path, on_row=None, n_draft: int = 4, cores: str = "0,1", threads: int = 2) -> list[dict]:
    """The bench's llama.cpp phase: AR, then speculative decoding, on the default pair's GGUF files."""
    binary = build()
    ggufs = gguf_by_role(config, engine_root)
    rows = []
    for cfg in (PeerConfig(ggufs["target"], cores=cores, threads=threads),
                PeerConfig(ggufs["target"], draft=ggufs["drafter"], n_draft=n_draft, cores=cores, threads=threads,
                           draft_threads=threads)):
        print(f"[bench] llama.cpp {cfg.mode}: {' '.join(command(binary, cfg, 0))}", flush=True)
        rows += run_peer(binary, cfg, prompts, max_tokens, warm_ids, on_row, out / f"llama_server_{cfg.mode}.log")
    return rows


def main() -> None:
    import argparse
    import signal

    ap = argparse.ArgumentParser(description="serve: one llama-server on the default pair (the load peer)")
    ap.add_argument("command", choices=["serve"])
    ap.add_argument("--config", type=Path, default=REPO / "engines/default.yaml")
    ap.add_argument("--engine-root", type=Path, default=REPO / "engines")
    ap.add_argument("--model", type=Path, help="a GGUF file (default: the config's target)")
    ap.add_argument("--side", choices=LLAMA_SIDES, default="llama-ar",
                    help="the target alone, with an n-gram --spec-type, or with the config's drafter (llama-spec)")
    ap.add_argument("--parallel", type=int, default=1, help="slots: requests decoded together")
    ap.add_argument("--cores", default="0,1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--port", type=int, default=8090)
    a = ap.parse_args()
    ggufs = gguf_by_role(a.config, a.engine_root)
    if a.model:
        ggufs["target"] = a.model
    cfg = peer_config(a.side, ggufs, cores=a.cores, threads=a.threads, draft_threads=a.threads, parallel=a.parallel)
    srv = LlamaServer(build(), cfg)
    srv.port, srv.url = a.port, f"http://127.0.0.1:{a.port}"
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a KeyboardInterrupt: the server stops too
    with srv:
        print(f"llama-server ({cfg.mode}, {a.parallel} slots) ready at {srv.url}", flush=True)
        try:
            srv.proc.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
