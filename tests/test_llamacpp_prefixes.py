"""Kept prefixes on the llama.cpp target engine: a released sequence's KV stays in its stream for a
later sequence that starts the same, and past the streams in host RAM (engine/prefix_store.py);
either way the reused rows give the logits a fresh prefill gives (SmolLM2-135M in Q4_K_M)."""
from __future__ import annotations

import pytest
import torch

from conftest import PROMPTS


@pytest.fixture(scope="module")
def prompt_ids(codec):
    return codec.encode_prompt(PROMPTS[5])


def test_a_new_sequence_takes_the_stream_that_holds_its_prefix(llama_target, prompt_ids):
    """A released sequence's KV stays in its stream: a later sequence takes the free stream whose
    kept tokens share the longest prefix with its own (not the lowest one) and computes only the
    rest, with the logits a fresh prefill gives; after a release with keep_prefix=False nothing is
    reused."""
    from ssd.engine.engine import ExtendCall
    from ssd.engine.llamacpp_engine import LlamaCppEngine

    e = LlamaCppEngine(llama_target, threads=1, max_sequences=3, max_len=512)
    other = prompt_ids[::-1]
    fresh = e.extend([ExtendCall("a", prompt_ids, 4)])[0]
    fresh_other = e.extend([ExtendCall("x", other, 2)])[0]
    assert e.take_reused() == {"a": 0, "x": 0}
    assert (e.sequences["a"].index, e.sequences["x"].index) == (0, 1)
    e.release("a")
    e.release("x")
    e.take_timing()
    assert torch.equal(e.extend([ExtendCall("y", other, 2)])[0], fresh_other)
    assert e.sequences["y"].index == 1 and e.take_reused() == {"y": len(other) - 2}
    assert [rows for rows, _ in e.take_timing()] == [2]  # no prompt forward: only the two logit rows
    turn = prompt_ids + [11, 12, 13]  # a conversation's next turn: its history is the kept prefix
    assert torch.equal(e.extend([ExtendCall("b", turn, 7)])[0][:4], fresh)
    assert e.sequences["b"].index == 0 and e.take_reused() == {"b": len(prompt_ids) - 4}
    e.release("b", keep_prefix=False)
    assert torch.equal(e.extend([ExtendCall("c", prompt_ids, 4)])[0], fresh)
    assert e.take_reused() == {"c": 0}


def test_a_prefix_overwritten_in_its_stream_comes_back_from_the_store(llama_target, prompt_ids):
    """With a RAM budget, a stream's kept tokens are saved before another sequence overwrites them;
    a later sequence with that prefix gets it written back (no prompt forward) and the logits of a
    fresh prefill. Without a budget the same sequence computes its prompt again."""
    from ssd.engine.engine import ExtendCall
    from ssd.engine.llamacpp_engine import LlamaCppEngine

    other = prompt_ids[::-1]
    for budget, reused in ((64, len(prompt_ids) - 4), (0, 0)):
        e = LlamaCppEngine(llama_target, threads=1, max_sequences=2, max_len=512, cache_ram_mb=budget)
        fresh = e.extend([ExtendCall("a", prompt_ids, 4)])[0]
        e.release("a")
        for i in range(2):  # two other prompts take both streams: "a"'s tokens are overwritten
            e.extend([ExtendCall(f"x{i}", other[i:], 1)])
        e.release("x0")
        e.release("x1")
        e.take_reused()
        e.take_timing()
        assert torch.equal(e.extend([ExtendCall("c", prompt_ids, 4)])[0], fresh)
        assert e.take_reused() == {"c": reused}
        assert [rows for rows, _ in e.take_timing()] == ([4] if budget else [0])  # restored: no prompt forward
        assert (len(e.store.entries) > 0) == (budget > 0) and e.store.bytes <= budget * 2**20
        # the restored stream decodes on as a freshly prefilled one does
        on = e.extend([ExtendCall("c", prompt_ids + [7, 8], 2)])[0]
        e.release("c", keep_prefix=False)
        e.store.entries.clear()
        assert torch.equal(e.extend([ExtendCall("d", prompt_ids + [7, 8], 2)])[0], on)
        assert e.take_reused()["d"] == 0


def test_the_prefix_store_keeps_the_most_recently_used_within_its_budget():
    from ssd.engine.prefix_store import PrefixStore

    st = PrefixStore(250)
    st.put([1, 2, 3], b"a" * 100)
    st.put([1, 2, 4, 5], b"b" * 100)
    assert st.longest([1, 2, 4, 9]) == (3, (1, 2, 4, 5))  # marks it used
    st.put([7], b"c" * 100)  # over the budget: the least recently used entry goes
    assert list(st.entries) == [(1, 2, 4, 5), (7,)] and st.bytes == 200
    assert st.covers([1, 2, 4]) and not st.covers([1, 2, 3])
    assert st.longest([9]) == (0, None)
    st.put([8], b"d" * 300)  # larger than the whole budget: not kept
    assert (8,) not in st.entries
