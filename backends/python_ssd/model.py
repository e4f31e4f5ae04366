"""Triton entry point of the `python_ssd` backend: every model with `backend: "python_ssd"`.

Thin on purpose: the model's `role` parameter picks a class from ssd/serving/ (the orchestrator or
an engine server) and everything is delegated to it. For the orchestrator `execute` returns a
coroutine, which the Python backend stub runs on its event loop (async, decoupled).
"""
import os
import sys

# Triton's Python backend stub loads this file by path from the backend directory. Started by
# tools/triton_launcher.py the stub runs in the launcher's venv and would find an installed `ssd`,
# but an image may copy backends/python_ssd without installing it, and an installed `ssd` may be
# another checkout's: the backend always serves the `ssd` that sits next to this file.
sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))

from ssd.serving.roles import create_model  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self.impl = create_model(args)

    def execute(self, requests):
        return self.impl.execute(requests)

    def finalize(self):
        self.impl.finalize()
