"""The drafter's glue pass reuses what drafting already ran (workers/drafter.py): after the neural
backup's draft, or on a cache hit, it runs only the draft's last row, and a committed branch's KV
is the KV a fresh sequence computes."""
from __future__ import annotations

from conftest import PROMPTS

from ssd.workers.drafter import DrafterWorker
from ssd.workers.protocol import DraftCall, SpeculateCall

FANOUT = [3, 2, 2, 1, 1]


def test_glue_pass_runs_only_the_rows_drafting_did_not(engines, codec):
    eng = engines["weak"]
    w = DrafterWorker(eng)
    prompt = codec.encode_prompt(PROMPTS[0])
    draft = w.draft([DraftCall("reuse", prompt, 4)])[0].tokens
    spec = w.speculate([SpeculateCall("reuse", prompt, draft, 4, FANOUT)])[0]
    assert spec.timing[0][0] == 1  # the backup's draft: only its last token's row
    assert [rows for rows, _ in spec.timing[1:]] == [len(spec.branches)] * 4  # then the tree's 4 steps

    # the target accepted 2 tokens and corrected the third to a pre-drafted t*: a hit
    (k, t_star), branch = next((key, b) for key, b in spec.branches.items() if key[0] == 2)
    tokens = prompt + draft[:k] + [t_star]
    hit = w.speculate([SpeculateCall("reuse", tokens, branch, 4, FANOUT)])[0]
    assert hit.timing[0][0] == 1  # the branch's rows are committed, not run again
    assert eng.cached_tokens("reuse") == tokens + branch

    # the committed rows hold the KV a fresh sequence computes: it drafts the same continuation
    again = w.draft([DraftCall("reuse", tokens + branch, 3)])[0].tokens
    fresh = DrafterWorker(eng).draft([DraftCall("reuse-fresh", tokens + branch, 3)])[0].tokens
    assert again == fresh

    # an outcome nothing pre-drafted (an n-gram draft after a miss): the whole glue pass runs
    w.speculate([SpeculateCall("reuse", tokens + branch, again, 3, FANOUT)])
    miss = tokens + branch + [again[0], (again[1] + 1) % eng.vocab_size]
    out = w.speculate([SpeculateCall("reuse", miss, [5, 6, 7], 3, FANOUT)])[0]
    assert out.timing[0][0] == 4
    for seq in ("reuse", "reuse-fresh"):
        w.release(seq)
