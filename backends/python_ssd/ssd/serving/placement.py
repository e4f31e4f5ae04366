"""Where an engine process computes, per call: the round's core layout (rounds.Choice).

Split rounds (calls with ``threads`` 0): the engine's own cores (`cores`) and thread count
(`threads`), so target and drafter run side by side. Wide rounds: every core in `wide_cores` and
the call's thread count, for the one engine at work (SD drafts, then verifies; AR verifies). Every
thread of the process is moved (Triton's stub may call execute from more than one thread, and each
keeps its own pool of OpenMP workers, created with its affinity of the moment). An exact target
switches only to thread counts that give its rows the same bits (TorchEngine.allows_threads);
refused, it computes with its own count, so the output never depends on the layout.
"""
from __future__ import annotations

import os


def parse_cores(spec: str) -> set[int]:
    """The cores of ``spec`` this machine has (not the calling thread's affinity, which placement
    changes)."""
    wanted = {int(c) for c in (spec or "").replace(" ", "").split(",") if c != ""}
    return wanted & set(range(os.cpu_count() or 1))


def pin_all_threads(cores: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that ended meanwhile
            pass


class Placement:
    def __init__(self, engine, cores: str, wide_cores: str, threads: int):
        self.engine = engine
        self.cores = parse_cores(cores)
        self.wide_cores = parse_cores(wide_cores) | self.cores
        self.base = threads or 1
        self.current = self.base
        self.enabled = hasattr(engine, "set_threads") and len(self.wide_cores) > len(self.cores)
        self.checked: dict[int, bool] = {}  # thread count -> the engine allows it (checked once)
        if self.enabled and len(self.wide_cores) > self.base:
            # the wide rounds' usual count (one thread a wide core) is checked at load: checked at the
            # first wide round, the check's forwards would be timed as that round's and teach the
            # scheduler a wide round many times slower than it is
            self._allowed(len(self.wide_cores))
        if self.enabled and self.cores:  # the process started on the wide cores (roles.pin_process)
            pin_all_threads(self.cores)

    def use(self, threads: int) -> int:
        """Computes the next calls with ``threads`` (0: split) where allowed; returns the count used."""
        if not self.enabled:
            return self.current
        want = threads if threads > self.base else self.base
        if want != self.base and not self._allowed(want):
            want = self.base
        if want != self.current:
            pin_all_threads(self.wide_cores if want > self.base else (self.cores or self.wide_cores))
            self.engine.set_threads(want)
            self.current = want
        return want

    def _allowed(self, threads: int) -> bool:
        if threads not in self.checked:
            pin_all_threads(self.wide_cores)  # the check runs at the wide count too
            self.checked[threads] = self.engine.allows_threads(threads)
            if self.current == self.base:
                pin_all_threads(self.cores or self.wide_cores)
        return self.checked[threads]
