"""The tritonserver launcher (tools/triton_launcher.py) cleans up after a server that died."""
from __future__ import annotations

import os
import subprocess
import time


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stopping_a_crashed_server_kills_the_processes_it_left(tmp_path):
    """A tritonserver that crashes leaves its Python stubs running in its process group; stop()
    must end them too (a stand-in parent that exits at once, leaving a child, plays the crash)."""
    from ssd_tools.triton_launcher import TritonServer

    pid_file = tmp_path / "child.pid"
    proc = subprocess.Popen(["bash", "-c", f"sleep 300 & echo $! > {pid_file}; exit 11"], start_new_session=True)
    proc.wait(timeout=10)
    child = int(pid_file.read_text())
    assert _alive(child)
    server = TritonServer(repository=tmp_path, engine_root=tmp_path, proc=proc)
    server.stop()
    deadline = time.time() + 5
    while _alive(child) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
