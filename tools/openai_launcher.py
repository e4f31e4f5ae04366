"""Starts the OpenAI-compatible frontend (frontends/openai_api/server.py) next to a running Triton."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVER = REPO / "frontends" / "openai_api" / "server.py"


@dataclass
class OpenAIFrontend:
    tokenizer: Path
    triton_grpc: str
    port: int = 9000
    host: str = "127.0.0.1"
    model_name: str | None = None
    log_file: Path | None = None
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout: float = 60.0) -> "OpenAIFrontend":
        cmd = [sys.executable, str(SERVER), "--tokenizer", str(self.tokenizer), "--triton", self.triton_grpc,
               "--host", self.host, "--port", str(self.port)]
        if self.model_name:
            cmd += ["--model-name", self.model_name]
        out = open(self.log_file, "w") if self.log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the OpenAI frontend exited with code {self.proc.returncode}; see {self.log_file}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2):
                    return self
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"the OpenAI frontend did not answer within {timeout:.0f} s; see {self.log_file}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
