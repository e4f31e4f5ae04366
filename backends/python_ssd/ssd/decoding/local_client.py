"""A WorkerClient that calls the workers in this process (tests, in-process benchmarks).

Calls run in threads so a verify and a speculation can overlap (torch releases the GIL in its
kernels); each worker is guarded by a lock, as an engine process would serialise its own calls.
"""
from __future__ import annotations

import asyncio
import threading

from ..workers.protocol import (ROUTE, DraftCall, DraftResult, FetchCall, SpeculateCall, SpeculateResult, VerifyCall,
                                VerifyResult, worker_method)


class LocalClient:
    def __init__(self, target, drafter=None, fast=None):
        self.target, self.drafter, self.fast = target, drafter, fast
        self._locks = {id(w): threading.Lock() for w in (target, drafter, fast) if w is not None}

    async def _run(self, worker, method: str, calls: list) -> list:
        def run():
            with self._locks[id(worker)]:
                return getattr(worker, method)(calls)
        return await asyncio.to_thread(run)

    async def call_many(self, op: str, calls: list) -> list:
        """One batched worker call for many sequences (what the coalescer sends per round); a
        worker error fails the whole message, as a failed engine request does."""
        worker = {"target": self.target, "drafter": self.drafter, "backup": self.fast}[ROUTE[op]]
        return await self._run(worker, worker_method(op), calls)

    async def _one(self, op: str, call):
        return (await self.call_many(op, [call]))[0]

    async def verify(self, call: VerifyCall) -> VerifyResult:
        return await self._one("verify", call)

    async def draft(self, call: DraftCall) -> DraftResult:
        return await self._one("draft", call)

    async def speculate(self, call: SpeculateCall) -> SpeculateResult:
        return await self._one("speculate", call)

    async def fetch(self, call: FetchCall) -> DraftResult:
        return await self._one("fetch", call)

    async def fast_draft(self, call: DraftCall) -> DraftResult:
        return await self._one("fast_draft", call)

    async def release(self, seq_id: str) -> None:
        await self.release_many([seq_id])

    async def release_many(self, seq_ids: list[str]) -> None:
        for w in (self.target, self.drafter, self.fast):
            if w is not None:
                for s in seq_ids:
                    w.release(s)
