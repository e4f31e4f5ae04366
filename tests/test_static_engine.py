"""The GPU drafter's engine (ssd/engine/static_engine.py) on the CPU: its fixed-shape steps over the
static KV pool (padding, batched tree attention with a mask, slots) against the dynamic forward.
The CUDA-graph capture itself needs a GPU (tools/device_check.py runs it there); everything it
replays is this same function over these same buffers."""
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
    static = StaticEngine(folder, exact=False, max_sequences=3, static_len=48, max_step_rows=8, cuda_graphs=False)
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
    assert {(4, 1), (4, 2), (1, 4)} <= set(static.steps) and static.pool.spare == 3


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
