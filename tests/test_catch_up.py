"""What a request tells the scheduler about its drafter's backlog: the tokens its drafter cache
lacks (growing by one an AR round, back to a round's block once a round drafts) and the tokens it
still has to make; a finished request leaves the batch's backlog."""
from __future__ import annotations

import asyncio

from conftest import PROMPTS
from decoding_clients import generate, local_client


def test_a_request_reports_what_its_drafter_lacks_and_its_tokens_left(engines, codec):
    from ssd.algorithm.rounds import Choice
    from ssd.algorithm.scheduler import Decision, Scheduler
    from ssd.decoding.generator import DecodeConfig, SharedState

    class Scripted(Scheduler):
        """Runs ``script``'s choices in turn and keeps what each round reported."""

        def __init__(self, script):
            super().__init__()
            self.script, self.seen = script, []

        def choose(self, batch, k, budget, allowed=(), seq=None, adaptive_k=False, owed_rows=0, tokens_left=0.0,
                   lookup=None):
            self.seen.append((owed_rows, tokens_left))
            return Decision(Choice(self.script[min(len(self.seen), len(self.script)) - 1]), "forced")

    n = 24
    policy = Scripted(["ar", "ar", "ar", "sd", "sd", "ar"])
    shared = SharedState(policy=policy)
    out, g = asyncio.run(generate(local_client(engines, "strong"), codec.encode_prompt(PROMPTS[1]),
                                  DecodeConfig(mode="ssd", k=4), n=n, seq="backlog", shared=shared))
    blocks = g.stats.tokens_per_round
    # split prefill: the drafter took the prompt beside the target, so it lacks only the first token
    assert [o for o, _ in policy.seen[:4]] == [1, 2, 3, 4]
    assert policy.seen[4][0] == blocks[3]  # the sd round brought it up to its prefix
    assert policy.seen[5][0] == blocks[4]
    made = 1
    for (_, left), block in zip(policy.seen, blocks):
        assert left == n - made
        made += block
    assert shared.backlog == {} and shared.catch_up() == (0, 0.0)


def _owed_while_running(engines, codec, prompt: str, layout: str, n: int):
    """Decodes ``prompt`` with the batch running ``layout`` (forced every round) and returns the
    generation, the drafter backlog reported at each target call (the first one: during the
    prefill) and the backlog each of the scheduler's decisions saw."""
    from ssd.algorithm.rounds import Choice
    from ssd.algorithm.scheduler import Decision, Scheduler
    from ssd.decoding.generator import DecodeConfig, SharedState

    choice = Choice(layout)

    class Watching(Scheduler):
        def __init__(self):
            super().__init__()
            self.seen = []

        def running(self, allowed=()):
            return choice

        def choose(self, batch, k, budget, allowed=(), seq=None, adaptive_k=False, owed_rows=0, tokens_left=0.0,
                   lookup=None):
            self.seen.append(owed_rows)
            return Decision(choice, "forced")

    shared = SharedState(policy=Watching(), wide_threads=2 if choice.wide else 0)
    inner = local_client(engines, "strong")
    reported = []

    class Spy:
        async def verify(self, call):
            reported.append(shared.catch_up()[0])
            return await inner.verify(call)

        def __getattr__(self, name):
            return getattr(inner, name)

    _, g = asyncio.run(generate(Spy(), codec.encode_prompt(prompt), DecodeConfig(mode="ssd", k=4), n=n,
                                seq=layout, shared=shared))
    return g, reported, shared.policy.seen


def test_a_prompt_prefilled_wide_is_owed_from_the_prefill_on(engines, codec):
    """On a wide layout the drafter does not take the prompt: the request owes it, and says so as
    its prefill starts (a batch's next decision may come before its first round)."""
    g, reported, seen = _owed_while_running(engines, codec, PROMPTS[2], "ar@wide", n=6)
    p = len(codec.encode_prompt(PROMPTS[2]))
    assert g.stats.prefill_threads == 2
    assert reported[0] == p + 1  # during the prefill
    assert seen[:3] == [p + 1, p + 2, p + 3]


def test_a_split_prefill_owes_the_prompt_until_the_drafter_has_it(engines, codec):
    """On the split layout the drafter prefills the prompt beside the target, but until that
    prefill returns (it may be queued behind other requests' in the drafter process) the prompt is
    owed: a drafting round decided meanwhile would wait for it. Once it has returned, the first
    round owes only the first token."""
    g, reported, seen = _owed_while_running(engines, codec, PROMPTS[0], "ar", n=4)
    assert g.stats.prefill_threads == 0
    assert reported[0] == len(codec.encode_prompt(PROMPTS[0])) + 1  # during the prefill: the drafter does not have it yet
    assert seen[0] == 1  # the first round: the drafter holds the prompt
