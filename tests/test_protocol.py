"""The engine message format (workers/protocol.py): one message carries many sequences' calls."""
from __future__ import annotations

import torch

from ssd.algorithm.sampling import SamplingParams
from ssd.workers.protocol import (CallError, DraftResult, SpeculateResult, VerifyCall, VerifyResult, decode_calls,
                                  decode_results, encode_calls, encode_results)


def test_calls_round_trip_with_ragged_probability_rows():
    p3, p1 = torch.rand(3, 7), torch.rand(1, 7)
    calls = [VerifyCall("a", [1, 2], [3, 4, 5], SamplingParams(0.7), 9, 2, p3),
             VerifyCall("b", [1], [], SamplingParams(), 0, 0, None),  # greedy: no rows
             VerifyCall("c", [4], [6], SamplingParams(1.0, top_p=0.9), 1, 5, p1)]
    payload, probs = encode_calls("verify", calls)
    assert probs.shape == (4, 7)  # one tensor for the whole message
    op, back = decode_calls(payload, probs)
    assert op == "verify" and [c.seq_id for c in back] == ["a", "b", "c"]
    assert torch.equal(back[0].draft_probs, p3) and back[1].draft_probs is None and torch.equal(back[2].draft_probs, p1)
    assert back[0].params == calls[0].params and back[2].params.top_p == 0.9 and back[0].round == 2


def test_a_malformed_call_fails_alone():
    payload = (b'{"op": "verify", "calls": [{"seq_id": "a", "tokens": [1], "draft": []},'
               b' {"seq_id": "b", "tokens": [1], "draft": [], "bogus": 1}], "prob_rows": [0, 0]}')
    _, calls = decode_calls(payload, None)
    assert isinstance(calls[0], VerifyCall)
    assert isinstance(calls[1], CallError) and "bogus" in str(calls[1])


def test_results_round_trip_with_errors_in_place():
    q = torch.rand(2, 5)
    results = [DraftResult([4, 2], q, [[8, 0.5]]), RuntimeError("drafter.draft failed: boom"), DraftResult([7], None)]
    out = decode_results("draft", *encode_results(results))
    assert out[0].tokens == [4, 2] and torch.equal(out[0].probs, q) and out[0].timing == [[8, 0.5]]
    assert isinstance(out[1], CallError) and "boom" in str(out[1])
    assert out[2].tokens == [7] and out[2].probs is None
    spec = decode_results("speculate", *encode_results([SpeculateResult({(1, 9): [3, 4]}, [])]))[0]
    assert spec.branches == {(1, 9): [3, 4]}
    (v,) = decode_results("verify", *encode_results([VerifyResult(2, 11)]))
    assert (v.accepted, v.token) == (2, 11)
