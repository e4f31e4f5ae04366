"""The GPU drafter's engine (ssd/engine/static_engine.py) on the CPU: its fixed-shape steps over the
static KV pool (padding, batched tree attention with a mask, slots, length buckets) against the
dynamic forward. The CUDA-graph capture itself needs a GPU (tools/device_check.py runs it there);
everything it replays is this same function over these same buffers. Here a recording stand-in
for the capture and for the device scope checks that every shape is captured at load and that
capture, replay and every forward run in the engine's CUDA device scope."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_engine


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from ssd.engine.engine import TorchEngine
    from ssd.engine.static_engine import StaticEngine

    folder = make_tiny_engine(tmp_path_factory.mktemp("static") / "m", seed=3, vocab=32, logit_scale=1.0)
    dynamic = TorchEngine(folder, exact=False, max_sequences=8)
    static = StaticEngine(folder, exact=False, max_sequences=3, static_len=48, max_step_rows=8, cuda_graphs=False,
                          min_length=8)
    return dynamic, static


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(x.shape == y.shape and torch.allclose(x, y, atol=1e-5, rtol=1e-4) for x, y in zip(a, b, strict=True))


def test_decode_steps_prefill_rollback_and_padding_match_the_dynamic_forward(pair) -> None:
    from ssd.engine.engine import ExtendCall

    dynamic, static = pair
    g = torch.Generator().manual_seed(0)
    seqs = {s: torch.randint(0, 32, (n,), generator=g).tolist() for s, n in (("a", 11), ("b", 14), ("c", 5))}
    calls = [ExtendCall(s, t, 2) for s, t in seqs.items()]
    assert same(dynamic.extend(calls), static.extend(calls))  # a and b prefill (> 8 rows), c in a step
    for step in range(4):  # three sequences: a batch padded to 4, one row each
        calls = [ExtendCall(s, t + [step, (step * 5) % 32][: 1 + step % 2], 1) for s, t in seqs.items()]
        got_d, got_s = dynamic.extend(calls), static.extend(calls)
        assert same(got_d, got_s)
        for c in calls:
            seqs[c.seq_id] = c.tokens
    rolled = [ExtendCall("a", seqs["a"][:9] + [1, 2, 3], 3)]  # a shorter common prefix: rollback, 3 rows
    assert same(dynamic.extend(rolled), static.extend(rolled))
    # batch, rows and the attention width: 32 of the 48 positions (lengths 8, 32, 48) for these sequences
    assert static.lengths == [8, 32, 48]
    assert {(4, 1, 32), (4, 2, 32), (1, 4, 32)} <= set(static.steps) and static.pool.spare == 3


def test_tree_steps_and_commit_match_the_dynamic_forward(pair) -> None:
    from ssd.engine.engine import ExtendCall, TreeCall

    dynamic, static = pair
    prefix = list(range(3, 20))
    for e in pair:
        e.extend([ExtendCall("t", prefix, 1), ExtendCall("u", prefix[:12], 1)])
    base = len(prefix)
    # roots over different committed lengths (k accepted drafts), then one child per branch
    roots = [TreeCall("t", [5, 6, 7], [base, base + 1, base + 2], [base, base + 1, base + 2], [-1, -1, -1]),
             TreeCall("u", [9, 10], [12, 13], [12, 13], [-1, -1])]
    out_d, out_s = dynamic.tree(roots), static.tree(roots)
    assert same([lg for lg, _ in out_d], [lg for lg, _ in out_s])
    assert [slots for _, slots in out_d] == [slots for _, slots in out_s]
    kids = [TreeCall("t", [1, 2, 3], [base + 1, base + 2, base + 3], [0, 0, 0], out_s[0][1]),
            TreeCall("u", [4, 8], [13, 14], [0, 0], out_s[1][1])]
    assert same([lg for lg, _ in dynamic.tree(kids)], [lg for lg, _ in static.tree(kids)])
    for e in pair:  # the first branch of t becomes the sequence: 5, then its child 1
        e.commit_branch("t", base, [out_s[0][1][0], out_s[0][1][0] + 3], [5, 1])
    nxt = [ExtendCall("t", prefix + [5, 1, 7], 2)]
    assert same(dynamic.extend(nxt), static.extend(nxt))


def test_slots_are_reused_and_limits_are_clear(pair) -> None:
    from ssd.engine.engine import ExtendCall, TreeCall

    dynamic, static = pair
    for s in list(static.sequences):
        static.release(s)
    assert sorted(static.free_slots) == [0, 1, 2]
    for i in range(5):  # more sequences than slots: the least recently used give theirs up
        c = [ExtendCall(f"s{i}", [i, 1, 2, 3], 1)]
        assert same(dynamic.extend(c), static.extend(c))
    assert len(static.sequences) == 3 and not static.free_slots
    with pytest.raises(ValueError, match="max_len 48"):
        static.extend([ExtendCall("long", list(range(49)) , 1)])
    static.extend([ExtendCall("edge", [1] * 46, 1)])
    with pytest.raises(ValueError, match="static_kv_len"):
        static.tree([TreeCall("edge", [1, 2, 3], [46, 46, 46], [46, 46, 46], [-1, -1, -1])])


def test_drafter_worker_speculates_the_same_on_the_static_engine(pair) -> None:
    from ssd.workers.drafter import DrafterWorker
    from ssd.workers.protocol import DraftCall, SpeculateCall

    dynamic, static = pair
    prompt = [7, 3, 9, 1, 4, 4, 2, 8, 5]
    for_each = []
    for e in pair:
        w = DrafterWorker(e)
        draft = w.draft([DraftCall("w", prompt, 3)])[0].tokens
        spec = w.speculate([SpeculateCall("w", prompt, draft, 3, [2, 2, 1, 1])])[0].branches
        for_each.append((draft, spec))
        w.release("w")
    assert for_each[0] == for_each[1] and len(for_each[0][1]) >= 4


def test_the_factory_builds_the_static_drafter(tmp_path) -> None:
    from ssd.engine.static_engine import StaticEngine
    from ssd.config import EngineConfig
    from ssd.workers.factory import build_worker

    folder = make_tiny_engine(tmp_path / "m", seed=4)
    worker = build_worker(EngineConfig.from_parameters({"role": "drafter", "static_kv_len": "40", "max_sequences": "2",
                                                        "weight_quant": "", "head_vocab": "0"}), str(folder))
    assert isinstance(worker.engine, StaticEngine) and worker.engine.pool.static_len == 40
    assert worker.engine.use_graphs is False  # a CPU device: the same steps, run eagerly
    worker = build_worker(EngineConfig.from_parameters({"role": "drafter"}), str(folder))
    assert type(worker.engine).__name__ == "TorchEngine"


def test_attention_reads_only_the_length_bucket_in_use(pair) -> None:
    """A short sequence's step reads 8 cache positions, not the slot's 48, and still matches."""
    from ssd.engine.engine import ExtendCall

    dynamic, static = pair
    for e in pair:
        for sid in list(e.sequences):
            e.release(sid)
    calls = [ExtendCall("short", [3, 1, 4, 1], 1)]
    widths = []
    forward = StaticStepSpy.wrap(widths)
    try:
        assert same(dynamic.extend(calls), static.extend(calls))
        longer = [ExtendCall("short", [3, 1, 4, 1] + list(range(5, 25)), 1)]
        assert same(dynamic.extend(longer[:1]), static.extend(longer[:1]))  # a prefill: the dynamic forward
        longer = [ExtendCall("short", longer[0].tokens + [7], 1)]
        assert same(dynamic.extend(longer), static.extend(longer))
    finally:
        forward.undo()
    assert widths == [8, 32]  # keys and values of each layer: [batch, kv_heads, width, head_dim]


class StaticStepSpy:
    """Records the attention width (the mask's last dimension) of every static step's forward."""

    def __init__(self, original):
        self.original = original

    @classmethod
    def wrap(cls, widths: list[int]):
        from ssd.engine.static_engine import StaticStep

        spy = cls(StaticStep.forward)

        def forward(step, tokens, positions, write_slot, write_pos, slots, mask):
            widths.append(mask.shape[-1])
            return spy.original(step, tokens, positions, write_slot, write_pos, slots, mask)

        StaticStep.forward = forward
        return spy

    def undo(self) -> None:
        from ssd.engine.static_engine import StaticStep

        StaticStep.forward = self.original


def test_every_graph_shape_is_captured_at_load_inside_the_device_scope(tmp_path, monkeypatch) -> None:
    """With graphs on, the engine captures every (batch, rows, length) before it returns (before the
    model is READY), each capture and every later forward inside its CUDA device scope; requests
    then add no shape. A recording stand-in replaces the capture (there is no GPU here)."""
    from ssd.engine.engine import ExtendCall, TorchEngine, TreeCall
    from ssd.engine.static_engine import StaticEngine, StaticStep

    events: list[tuple[str, int]] = []
    depth = DeviceScope.record(monkeypatch, TorchEngine)
    monkeypatch.setattr(StaticEngine, "_graph_pool", staticmethod(lambda: None))
    monkeypatch.setattr(StaticStep, "_capture",
                        lambda step, pool: events.append((f"capture {step.batch}x{step.rows}x{step.length}", depth[0])))
    original = StaticStep.forward
    monkeypatch.setattr(StaticStep, "forward",
                        lambda step, **kw: events.append(("forward", depth[0])) or original(step, **kw))
    folder = make_tiny_engine(tmp_path / "m", seed=5, vocab=32)
    engine = StaticEngine(folder, exact=False, max_sequences=3, static_len=40, max_step_rows=4, cuda_graphs=True,
                          min_length=8)
    shapes = set(engine.shapes())
    assert shapes == {(b, r, n) for b in (1, 2, 4) for r in (1, 2, 4) for n in (8, 32, 40)}
    captured = [e for e in events if e[0].startswith("capture")]
    assert len(captured) == len(shapes) == len(engine.steps) and all(d > 0 for _, d in captured)
    assert engine.capture_s > 0
    events.clear()
    engine.extend([ExtendCall("a", [1, 2, 3], 1), ExtendCall("b", [4, 5], 1)])
    engine.extend([ExtendCall("a", [1, 2, 3, 6], 1)])
    engine.tree([TreeCall("a", [7, 8], [4, 4], [4, 4], [-1, -1])])
    assert set(engine.steps) == shapes  # no shape was added by a request
    assert events and all(name == "forward" and d > 0 for name, d in events)


def test_device_context_enters_the_engines_cuda_device(monkeypatch) -> None:
    """device_context(cuda:4) enters torch.cuda.device(cuda:4); a CPU engine enters nothing."""
    from ssd.engine import engine as engine_module

    entered = []

    class Recorder:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", Recorder)
    with engine_module.device_context(torch.device("cuda", 4)):
        pass
    with engine_module.device_context(torch.device("cpu")):
        pass
    assert entered == [torch.device("cuda", 4)]


def test_the_torch_engine_forwards_inside_its_device_scope(tmp_path, monkeypatch) -> None:
    """The dynamic forward (prefills, the target's verifies) runs in the scope too."""
    from ssd.engine.engine import ExtendCall, TorchEngine

    seen = []
    depth = DeviceScope.record(monkeypatch, TorchEngine)
    engine = TorchEngine(make_tiny_engine(tmp_path / "m", seed=6), exact=False, max_sequences=2)
    forward = engine.model.forward
    engine.model.forward = lambda *a, **k: seen.append(depth[0]) or forward(*a, **k)
    engine.extend([ExtendCall("a", [1, 2, 3, 4], 2)])
    assert seen == [1]


class DeviceScope:
    """A stand-in for an engine's device scope (TorchEngine.on_device) that counts how deep calls
    run inside it: ``record`` installs it and returns the one-item depth list the tests read."""

    def __init__(self, depth: list[int]):
        self.depth = depth

    def __enter__(self):
        self.depth[0] += 1

    def __exit__(self, *exc):
        self.depth[0] -= 1

    @staticmethod
    def record(monkeypatch, engine_class) -> list[int]:
        depth = [0]
        monkeypatch.setattr(engine_class, "on_device", lambda self: DeviceScope(depth))
        return depth
