"""A flag the orchestrator raises while a call waits for the target, read by the target between
the steps of a multi-step AR call.

An AR call may decode several tokens (VerifyCall.steps) so that one round trip pays for several;
while it runs, a call that arrives for the target (a new request's prefill, a sequence that missed
the message) waits for it to return: up to ``ar_steps`` one-row forwards, about 200 ms on two
cores. llama-server admits new prompts at every step. With this flag the target ends a multi-step
call after the step in progress when another call waits, returning the tokens decoded so far as an
end-of-sequence stop does (the orchestrator counts rounds by the tokens it gets back, so sampling
stays on the same streams), and the waiting call joins the next message.

Across processes it is one byte of shared memory: a file under /dev/shm named by the server (the
parent process of every Triton stub) and the target model, so servers side by side keep their own.
In one process (tests, benchmarks) it is a plain byte.
"""
from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path


def _folder() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def flag_path(target_model: str) -> Path:
    """The flag's file for ``target_model`` of this server: the same in the orchestrator's stub and
    the target's, which Triton starts as children of one tritonserver process."""
    return _folder() / f"ssd-{os.getppid()}-{target_model}.waiting"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale(folder: Path | None = None) -> list[Path]:
    """Removes the flag files of servers that are gone (a killed server never unloads its
    orchestrator, which unlinks its own); returns them."""
    gone = []
    for f in (folder or _folder()).glob("ssd-*-*.waiting"):
        pid = f.name.split("-")[1]
        if pid.isdigit() and not _alive(int(pid)):
            f.unlink(missing_ok=True)
            gone.append(f)
    return gone


class WaitingFlag:
    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else None
        self._byte = bytearray(1) if path is None else self._map(self.path)

    @staticmethod
    def _map(path: Path) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 1:  # both processes may get here first; the size is the same
                os.ftruncate(fd, 1)
            return mmap.mmap(fd, 1)
        finally:
            os.close(fd)

    @classmethod
    def for_target(cls, target_model: str) -> "WaitingFlag":
        return cls(flag_path(target_model))

    def raise_(self) -> None:
        self._byte[0] = 1

    def clear(self) -> None:
        self._byte[0] = 0

    def is_raised(self) -> bool:
        return self._byte[0] != 0

    def unlink(self) -> None:
        """Removes the file (the orchestrator, when the server unloads it); the mapping stays valid."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
