"""In-process decoding for the tests: a LocalClient on the session's engines, a generation of
exactly n tokens, and a client wrapper that logs the target's calls."""
from __future__ import annotations

N_TOKENS = 32


def local_client(engines, drafter: str):
    from ssd.decoding.local_client import LocalClient
    from ssd.workers.drafter import DrafterWorker
    from ssd.workers.fast_backup import NgramWorker
    from ssd.workers.target import TargetWorker

    return LocalClient(TargetWorker(engines["target"]), DrafterWorker(engines[drafter]), NgramWorker())


async def generate(client, prompt, cfg, n=N_TOKENS, seq="s", params=None, seed=0, shared=None):
    from ssd.algorithm.sampling import SamplingParams
    from ssd.decoding.generator import Generation

    g = Generation(client, seq, list(prompt), params or SamplingParams(), seed, cfg, shared)
    return await g.take(n), g


class VerifyLog:
    """Wraps a client and logs each target call with its result: ``calls`` holds (call, result)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    async def verify(self, call):
        r = await self.inner.verify(call)
        self.calls.append((call, r))
        return r

    def __getattr__(self, name):
        return getattr(self.inner, name)
