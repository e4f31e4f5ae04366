"""The engine supervisor's bookkeeping, with the /proc scan replaced by a list the test controls."""
from __future__ import annotations

from ssd.serving import supervisor as sup


def test_a_stub_that_dies_again_right_after_its_reload_is_reloaded_again(monkeypatch):
    live = {"target": [101], "drafter": [102]}
    monkeypatch.setattr(sup, "stub_instances", lambda parent_pid: {m: list(p) for m, p in live.items() if p})
    calls = []

    def load(model):
        calls.append(("load", model))
        live[model] = [200 + len(calls)]  # a fresh stub, READY when load returns

    s = sup.EngineSupervisor(("target", "drafter"), unload=lambda m: calls.append(("unload", m)), load=load)
    assert s.check_once() == []  # both seen running: watched from now on
    live["target"] = []
    assert s.check_once() == ["target"] and s.restarts == {"target": 1}
    live["target"] = []  # killed again before the watcher looked at the new stub
    assert s.check_once() == ["target"] and s.restarts == {"target": 2}
    assert s.check_once() == [] and s.is_up("target") and s.is_up("drafter")


def test_a_model_still_loading_at_start_is_not_reloaded(monkeypatch):
    live = {"target": []}
    monkeypatch.setattr(sup, "stub_instances", lambda parent_pid: {m: list(p) for m, p in live.items() if p})
    s = sup.EngineSupervisor(("target",), unload=lambda m: None, load=lambda m: None)
    assert s.check_once() == []  # never seen running: Triton is still loading it
    live["target"] = [7]
    assert s.check_once() == [] and s.expected == {"target": 1}
