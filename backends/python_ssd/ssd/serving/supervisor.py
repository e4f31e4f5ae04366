"""Keeps the engine models alive: a dead engine process is found and its model reloaded.

The Python backend runs each model instance in its own stub process, a child of tritonserver.
When a stub dies (killed, out of memory, a crash in native code) Triton keeps the model READY and
answers every later call with "Stub process ... is not healthy"; reloading the model with unchanged
files is a no-op, so the supervisor unloads it (readiness turns not-ready at once) and loads it
again (a fresh stub, READY when its engine is built). Both go through BLS's model-control API,
which needs tritonserver in explicit model-control mode (tools/triton_launcher.py starts it so).

Detection looks for the stubs in /proc every ``interval`` seconds: a stub's argv carries its
instance name (``<model>_<group>_<index>``) and its parent is tritonserver, this process's parent.
A call that fails with "not healthy" wakes the watcher at once.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

STUB_NAME = "triton_python_backend_stub"
UNHEALTHY_MARKERS = ("is not healthy", "is not ready", "Stub process")


def looks_like_engine_down(message: str) -> bool:
    """True for the errors Triton gives for a model whose process died or is being reloaded."""
    return any(m in message for m in UNHEALTHY_MARKERS)


def stub_instances(parent_pid: int) -> dict[str, list[int]]:
    """{instance name: [pid, ...]} of the live Python-backend stubs whose parent is ``parent_pid``."""
    out: dict[str, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            # the command name may hold spaces: fields after the closing parenthesis are fixed
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if int(ppid) != parent_pid or state in ("Z", "X"):
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except (OSError, ValueError, IndexError):
            continue  # the process ended while we looked
        if not argv or not argv[0].endswith(STUB_NAME):
            continue
        for a in argv[1:]:
            if a.count("_") >= 2 and a.rsplit("_", 2)[-1].isdigit() and a.rsplit("_", 2)[-2].isdigit():
                out.setdefault(a.rsplit("_", 2)[0], []).append(int(entry))
                break
    return out


@dataclass
class EngineSupervisor:
    """Watches ``models`` (engine model names) and reloads one whose stub process is gone.

    ``unload`` / ``load`` are pb_utils.unload_model / pb_utils.load_model in Triton (blocking calls,
    run on this class's own thread); ``on_restart(model, seconds)`` feeds the metrics.
    """

    models: tuple[str, ...]
    unload: Callable[[str], None]
    load: Callable[[str], None]
    on_restart: Callable[[str, float], None] = lambda model, seconds: None
    on_state: Callable[[str, bool], None] = lambda model, up: None
    interval: float = 0.5
    parent_pid: int = field(default_factory=os.getppid)
    down: set[str] = field(default_factory=set)
    restarts: dict[str, int] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    # stubs seen per model: a model is watched once it has been seen running (not while Triton
    # still loads it at start-up), and one with fewer stubs than it had lost an instance
    expected: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "EngineSupervisor":
        self._thread = threading.Thread(target=self._run, name="engine-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def is_up(self, model: str) -> bool:
        return model not in self.down

    def report_failure(self, message: str) -> None:
        """A call failed: if the error says an engine is gone, check now instead of at the next tick."""
        if looks_like_engine_down(message):
            self._wake.set()

    def check_once(self) -> list[str]:
        """Reloads every watched model without a live stub; returns the models it reloaded."""
        alive = stub_instances(self.parent_pid)
        reloaded = []
        for model in self.models:
            n = len(alive.get(model, ()))
            if n >= self.expected.get(model, 1) or model not in self.expected:
                if n:
                    self.expected[model] = max(n, self.expected.get(model, 0))
                continue
            self.down.add(model)
            self.on_state(model, False)
            t0 = time.monotonic()
            try:
                self.unload(model)
                self.load(model)
            except Exception as e:  # noqa: BLE001 - try again at the next tick; the model stays down
                self.failures[model] = f"{type(e).__name__}: {e}"
                continue
            self.failures.pop(model, None)
            # `expected` stays: the reload starts as many stubs as the model had, and a stub that
            # dies before the next look must still count as lost
            self.down.discard(model)
            self.restarts[model] = self.restarts.get(model, 0) + 1
            self.on_state(model, True)
            self.on_restart(model, time.monotonic() - t0)
            reloaded.append(model)
        return reloaded

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 - the watcher must outlive any one bad look at /proc
                pass
            self._wake.wait(self.interval)
            self._wake.clear()
