"""Starts a real `tritonserver` on CPU with the python_ssd backend, and stops it.

Where the binary comes from: a `tritonserver` on PATH wins (GPU hosts, NGC images); otherwise the one
shipped in the nvidia-pytriton wheel, with its libraries from nvidia_pytriton.libs. The backend
directory is assembled under build/: the stock Python backend (libtriton_python.so + the stub for
this interpreter) and `python_ssd` -> backends/python_ssd. The model repository is rendered from
model_repository/ with parameter overrides (engine folders, cores, threads, defaults).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pytriton_root() -> Path:
    import pytriton  # noqa: PLC0415 - only needed when no system tritonserver exists

    return Path(pytriton.__file__).parent / "tritonserver"


def find_tritonserver() -> tuple[Path, Path | None]:
    """(binary, bundled backends dir or None for a system install)."""
    system = shutil.which("tritonserver")
    if system:
        return Path(system), None
    root = _pytriton_root()
    return root / "bin" / "tritonserver", root


def prepare_backend_dir(build: Path) -> Path:
    binary, bundled = find_tritonserver()
    out = build / "triton_backends"
    py = out / "python"
    py.mkdir(parents=True, exist_ok=True)
    src = bundled / "backends" / "python" if bundled else Path("/opt/tritonserver/backends/python")
    files = [f for f in src.iterdir() if f.is_file()]
    if bundled:
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        files.append(bundled / "python_backend_stubs" / ver / "triton_python_backend_stub")
    for f in files:
        dst = py / f.name
        if dst.exists() and dst.stat().st_size == f.stat().st_size:
            continue
        tmp = py / (f.name + ".tmp")
        shutil.copy2(f, tmp)
        os.replace(tmp, dst)  # atomic: a running server keeps its (identical) old file
    link = out / "python_ssd"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(REPO / "backends" / "python_ssd")
    return out


def load_order(repository: Path) -> tuple[list[str], list[str]]:
    """(models loaded with the server, models loaded once it is ready): the second are those with a
    model_warmup (the orchestrator, whose warmup calls the others over BLS)."""
    startup, deferred = [], []
    for cfg in sorted(Path(repository).glob("*/config.pbtxt")):
        (deferred if "model_warmup" in cfg.read_text() else startup).append(cfg.parent.name)
    return startup, deferred


def _set_param(text: str, key: str, value: str) -> str:
    pat = re.compile(r'(parameters:\s*\{\s*key:\s*"%s"\s*value:\s*\{\s*string_value:\s*")[^"]*(")' % re.escape(key))
    if pat.search(text):
        return pat.sub(lambda m: m.group(1) + value + m.group(2), text)
    return text + f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'


def render_repository(dest: Path, overrides: dict[str, dict[str, str]]) -> Path:
    """Copies model_repository/ to ``dest`` with ``overrides[model][param] = value`` applied."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(REPO / "model_repository", dest)
    for model, params in overrides.items():
        cfg = dest / model / "config.pbtxt"
        text = cfg.read_text()
        for k, v in params.items():
            text = _set_param(text, k, str(v))
        cfg.write_text(text)
    return dest


@dataclass
class TritonServer:
    repository: Path
    engine_root: Path
    build: Path = REPO / "build"
    http_port: int = 0
    grpc_port: int = 0
    metrics_port: int = 0
    address: str = "127.0.0.1"
    log_file: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{self.address}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.address}:{self.grpc_port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        binary, bundled = find_tritonserver()
        if bundled:
            libs = bundled.parent.parent / "nvidia_pytriton.libs"
            env["LD_LIBRARY_PATH"] = ":".join(p for p in (str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
        # The stub embeds this interpreter: point it at this environment's packages explicitly.
        env["PATH"] = str(Path(sys.executable).parent) + ":" + env.get("PATH", "")
        env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]
        env["SSD_ENGINE_ROOT"] = str(self.engine_root)
        env.update(self.extra_env)
        return env

    def model_states(self) -> dict[str, str]:
        """{model: state} from Triton's repository index (READY, LOADING, UNAVAILABLE, ...)."""
        try:
            req = urllib.request.Request(f"http://{self.http_url}/v2/repository/index", data=b"{}", method="POST")
            with urllib.request.urlopen(req, timeout=2) as r:
                return {m["name"]: m.get("state", "") for m in json.load(r)}
        except (OSError, ValueError):
            return {}

    def start(self, timeout: float = 600.0, echo: bool = False, progress=None) -> "TritonServer":
        """Starts tritonserver and waits until it reports ready; ``progress(states)`` (optional) is
        called with model_states() whenever they change."""
        self.http_port = self.http_port or free_port()
        self.grpc_port = self.grpc_port or free_port()
        self.metrics_port = self.metrics_port or free_port()
        backends = prepare_backend_dir(self.build)
        binary, _ = find_tritonserver()
        cmd = [str(binary), f"--model-repository={self.repository}", f"--backend-directory={backends}",
               f"--http-address={self.address}", f"--http-port={self.http_port}",
               f"--grpc-address={self.address}", f"--grpc-port={self.grpc_port}",
               f"--metrics-address={self.address}", f"--metrics-port={self.metrics_port}",
               "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=false",
               "--log-verbose=0", "--exit-timeout-secs=10",
               # explicit: the orchestrator reloads an engine whose process died (docs/reliability.md)
               "--model-control-mode=explicit"]
        # A model with a warmup sample (the orchestrator: its warmup measures the engines' costs over
        # BLS, which Triton refuses until the server is ready) loads once the others are READY, through
        # the repository API; the server reports ready only after its warmup (strict readiness).
        startup, deferred = load_order(self.repository)
        cmd += [f"--load-model={m}" for m in startup]
        out = None if echo else open(self.log_file or (self.build / "tritonserver.log"), "w")
        self.proc = subprocess.Popen(cmd, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + timeout
        states: dict[str, str] = {}
        loader: threading.Thread | None = None
        failed: list[str] = []
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.proc.returncode}; see {self.log_file}")
            if progress is not None:
                now = self.model_states()
                if now and now != states:
                    states = now
                    progress(states)
            if failed:
                self.stop()
                raise RuntimeError(f"tritonserver could not load {failed[0]}; see {self.log_file}")
            if self.ready() and (loader is None or not loader.is_alive()):
                if loader is None and deferred:
                    loader = threading.Thread(target=self._load, args=(deferred, failed), daemon=True)
                    loader.start()
                else:
                    return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"tritonserver not ready after {timeout:.0f} s; see {self.log_file}")

    def _load(self, models: list[str], failed: list[str]) -> None:
        """Loads ``models`` through the repository API (blocks until each is loaded, warmup included);
        appends "<model>: <error>" to ``failed`` on an error."""
        for m in models:
            req = urllib.request.Request(f"http://{self.http_url}/v2/repository/models/{m}/load", data=b"{}",
                                         method="POST")
            try:
                urllib.request.urlopen(req, timeout=3600).close()
            except urllib.error.HTTPError as e:
                failed.append(f"{m}: {e.read().decode(errors='replace')}")
                return
            except OSError as e:
                failed.append(f"{m}: {e}")
                return

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # graceful: Triton unloads models, stubs exit
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        # what is left of the group: a server past its grace period, or the Python stubs of one that
        # crashed, which keep running with their cores and memory
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
