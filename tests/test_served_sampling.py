"""Sampled output through the served `ssd` model follows the target's distribution (issue 3, (d)).

Requests at temperature 1 with distinct seeds, 3 tokens each, through the real server (SSD and SD).
The in-process fp32 target (the same engine files and settings the server uses) gives the exact
conditional law of every emitted token; under exactness the randomized PIT values
U = F(t-) + V p(t) are i.i.d. uniform, whatever the rounds' boundaries and cache hits. A chi-square
test on 10 equal bins at alpha = 0.001 per mode (false-alarm rate 0.1% each; seeds are fixed, so
the run is deterministic). A positive control runs the same statistic on tokens drawn from a
tempered (wrong) law and must fail.
"""
from __future__ import annotations

import json
import random
import urllib.request

import pytest
import torch
from scipy import stats

from conftest import PROMPTS

N_REQUESTS = 150
TOKENS = 3
ALPHA = 0.001


def _post(srv, body):
    req = urllib.request.Request(f"http://{srv.http_url}/v2/models/ssd/generate", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _pit_pvalue(us: list[float]) -> float:
    counts = [0] * 10
    for u in us:
        counts[min(int(u * 10), 9)] += 1
    return float(stats.chisquare(counts).pvalue)


def _law(engine, seq_id: str, tokens: list[int]) -> torch.Tensor:
    from ssd.engine.engine import ExtendCall

    return torch.softmax(engine.extend([ExtendCall(seq_id, tokens, 1)])[0][0].double(), dim=-1)


def _pit(p: torch.Tensor, t: int, rng: random.Random) -> float:
    below = float(p[p > p[t]].sum())  # tokens ordered by probability: F(t-) = mass strictly above
    ties = float(p[p == p[t]].sum())
    return below + rng.random() * ties


@pytest.mark.parametrize("mode", ["ssd", "sd"])
def test_served_sampling_follows_target(server, engines, codec, mode):
    target = engines["target"]
    prompt_text = PROMPTS[2]
    prompt = codec.encode_prompt(prompt_text)
    rng = random.Random(1)
    us, us_wrong, rounds_with_drafts = [], [], 0
    for i in range(N_REQUESTS):
        d = _post(server, {"text_input": prompt_text, "max_tokens": TOKENS, "temperature": 1.0,
                           "seed": 1000 + i, "mode": mode, "num_draft_tokens": 2})
        ids = d["output_ids"] if isinstance(d["output_ids"], list) else [d["output_ids"]]
        rounds_with_drafts += json.loads(d["stats"])["rounds"]
        seq = list(prompt)
        for t in ids:
            p = _law(target, f"law{mode}", seq)
            us.append(_pit(p, t, rng))
            wrong = torch.softmax(torch.log(p) / 0.5, dim=-1)  # the law a sampler at temperature 0.5 follows
            us_wrong.append(_pit(wrong, t, rng))
            seq.append(t)
    target.release(f"law{mode}")
    assert rounds_with_drafts > 0
    assert len(us) >= N_REQUESTS * 2
    assert _pit_pvalue(us) > ALPHA, "served sampled output does not follow the target distribution"
    assert _pit_pvalue(us_wrong) < ALPHA, "the test cannot tell a wrong distribution apart"
