"""Free drafts, engine-free: the proposal from the sequence and the suffix cache (frequency-scored,
as long as the match earns), the cache's bound and eviction, the per-request lookup estimate and
the scheduler's choice of lookup rounds from it (a chat that turns into an edit moves to lookup;
the edit that turns back into a chat moves back). Exactness on real models: test_free_drafts_exact.py."""
from __future__ import annotations

import random

import pytest

from ssd.algorithm.free_draft import FreeDraftConfig, FreeDrafter, continuation
from ssd.algorithm.lookup_estimate import LookupEstimate, LookupOutlook
from ssd.algorithm.rounds import Choice
from ssd.algorithm.scheduler import Scheduler
from ssd.algorithm.suffix_cache import SuffixCache
from ssd.algorithm.token_index import TokenIndex
from ssd.config import ServerConfig

AR_WIDE, LOOKUP_WIDE = Choice.AR_WIDE, Choice.LOOKUP_WIDE
WIDE_ALLOWED = ("ssd+neural", "ssd+fast", "sd", "ar", "sd@wide", "ar@wide", "lookup@wide")


def text(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5000) for _ in range(n)]


def test_prompt_lookup_copies_the_prompt_as_far_as_the_match_earns():
    code = text(200, 1)
    drafter = FreeDrafter()
    # an edit that has copied 40 tokens of the prompt: the draft goes on copying, at the full K
    assert drafter.propose(code + [7] + code[:40], 16) == code[40:56]
    # a 2-token match is a weak hint: at most 2 tokens (spec_factor 1)
    fresh = FreeDrafter()
    assert fresh.propose(code + [7, 8] + code[10:12], 16) == code[12:14]
    # nothing seen before: no draft (the round is a plain target step)
    assert FreeDrafter().propose(text(50, 2), 16) == []


def test_a_token_after_new_text_drafts_what_followed_it_before():
    """Structured output: a separator right after a new value ends a pair never seen before, yet
    the token after the separator has followed it every time (the 1-token key); a one-token match
    drafts one token."""
    sep, quote = 10, 11
    fields = [[20, 21], [30, 31], [40, 41]]
    record = [t for f in fields for t in f[:1] + [quote, 500 + f[0], sep, quote] + f[1:]]
    drafter = FreeDrafter()
    assert drafter.propose(record + [quote, 999, sep], 8) == [quote]  # 999 is new: (999, sep) never seen


def test_the_sequence_only_grows_between_proposals():
    drafter = FreeDrafter()
    drafter.propose([1, 2, 3, 4], 4)
    with pytest.raises(ValueError, match="only grows"):
        drafter.propose([1, 2, 9, 4, 5], 4)


def test_candidates_are_scored_by_how_often_they_followed():
    cache = SuffixCache(10_000)
    head = [11, 12, 13, 14]
    for tail in ([1, 2, 3], [1, 2, 3], [1, 2, 3], [9, 8, 7]):
        cache.add(head + tail)
    assert FreeDrafter(cache).propose([5] + head, 3) == [1, 2, 3]  # 3 of 4 places agree
    # an even split after the first token falls below the confidence floor: the draft stops there
    cfg = FreeDraftConfig(min_confidence=0.6)
    assert continuation([(4, [1, 2, 3]), (4, [1, 5, 6])], 3, cfg) == [1]
    assert continuation([(4, [1, 2, 3]), (4, [1, 2, 6]), (4, [1, 2, 6])], 3, cfg) == [1, 2, 6]
    # the longest match decides: a 6-token match outranks two 3-token ones
    assert continuation([(3, [4]), (3, [4]), (6, [5])], 1, cfg) == [5]


def test_the_suffix_cache_keeps_its_bound_and_evicts_the_oldest():
    cache = SuffixCache(max_tokens=300)
    docs = [text(100, seed) for seed in range(10)]
    for d in docs:
        cache.add(d)
        assert cache.tokens <= 300
    assert cache.tokens == 300 and cache.evicted == 7 and len(cache.index.docs) == 3
    # an evicted request's text no longer drafts; a kept one's does
    assert FreeDrafter(cache).propose([1] + docs[0][:20], 8) == []
    assert FreeDrafter(cache).propose([1] + docs[9][:20], 8) == docs[9][20:28]
    # no entry of the index points into an evicted document
    live = set(cache.index.docs)
    assert all(doc in live for where in cache.index._where.values() for doc, _ in where)
    # a request longer than the whole bound keeps its last tokens
    cache.add(text(1000, 99))
    assert cache.tokens == 300 and len(cache.index.docs) == 1


def test_the_suffix_cache_can_be_turned_off_and_scoped_to_the_request():
    off = SuffixCache(0)
    off.add(text(50, 3))
    assert off.tokens == 0 and not off.enabled
    assert isinstance(ServerConfig().suffix_cache(), SuffixCache)
    assert ServerConfig(suffix_cache_scope="request").suffix_cache() is None
    assert ServerConfig(suffix_cache_tokens=0).suffix_cache() is None
    assert ServerConfig(free_drafts=False).suffix_cache() is None
    for params, named in (({"suffix_cache_scope": "user"}, "suffix_cache_scope"),
                          ({"suffix_cache_tokens": "-1"}, "suffix_cache_tokens"),
                          ({"lookup_max_k": "40"}, "lookup_max_k")):
        with pytest.raises(ValueError, match=f"parameter '{named}'"):
            ServerConfig.from_parameters(params)


def test_the_index_finds_long_matches_under_the_long_key():
    index = TokenIndex((8, 2))
    common = [1, 2] * 50  # a pair that occurs everywhere
    target = text(30, 4)
    index.extend(0, target + common)
    found = index.matches([9] + target[:12], limit=4, max_match=32)
    assert found == [(0, 12, 12)]  # the one place, with its whole 12-token match


def test_the_lookup_estimate_scores_every_round_and_leaves_unseen_positions_out():
    est = LookupEstimate()
    assert est.score([5, 6, 7], [5, 6, 9]) == 2  # two accepted, the third rejected
    assert est.score([5, 6, 7, 8], [5, 6]) == 2  # the block ends first: nothing rejected
    assert est.score([], [4]) == 0  # no draft offered
    before = est.accept.alpha
    for _ in range(10):
        est.score([1, 2, 3, 4], [9])
    assert est.accept.alpha < before / 2 and est.p_draft.value > 0.5


def test_lookup_is_priced_from_the_rows_and_picks_its_own_k():
    s = wide_scheduler()
    copying = LookupOutlook(alpha=0.95, p_draft=1.0, length=16, k_max=16)
    guessing = LookupOutlook(alpha=0.1, p_draft=1.0, length=16, k_max=16)
    assert s.model.lookup_k(1, copying, wide=True) >= 8 > s.model.lookup_k(1, guessing, wide=True)
    rates = s.model.rates(1, 4, 8, copying)
    assert rates[LOOKUP_WIDE] > 2 * rates[AR_WIDE]
    assert s.model.rates(1, 4, 8, guessing)[LOOKUP_WIDE] < rates[AR_WIDE]
    # no draft expected: the price of one target step (and the lookup's microseconds)
    assert s.model.rates(1, 4, 8, LookupOutlook())[LOOKUP_WIDE] == pytest.approx(rates[AR_WIDE], rel=0.05)


def wide_scheduler() -> Scheduler:
    """The default pair's measured costs: the llama.cpp target's 1/2/3/5-row forwards at 2 threads
    (27.3 / 33.6 / 40.4 / 54.3 ms, about 6.7 ms a row after), 1 thread about 1.8x; the drafter
    step 0.53 of a target row."""
    s = Scheduler()
    for rows, ms in ((1, 27.3), (2, 33.6), (3, 40.4), (5, 54.3), (9, 81.0), (17, 134.0), (32, 235.0)):
        s.model.target_wide.observe(rows, ms / 1000)
        s.model.target.observe(rows, 1.8 * ms / 1000)
        s.model.drafter_wide.observe(rows, 0.53 * ms / 1000)
        s.model.drafter.observe(rows, 0.53 * 1.8 * ms / 1000)
    return s


def decide(s: Scheduler, est: LookupEstimate, seq: str):
    outlook = LookupOutlook.mean([est.outlook()], 16)
    return s.choose(1, 4, 8, WIDE_ALLOWED, seq=seq, adaptive_k=True, lookup=outlook)


def test_a_chat_that_turns_into_an_edit_moves_to_lookup_and_back():
    """One request: its chat rounds' free drafts miss (AR on every core wins), then its answer starts
    copying its prompt (the estimate, scored every round, follows and lookup wins), then it writes
    new text again. A second request decoding a chat meanwhile keeps its own, low estimate."""
    s, est, other = wide_scheduler(), LookupEstimate(), LookupEstimate()
    chat = [decide(s, est, "r") for i in range(12) if not est.score([1, 2, 3, 4], [9, 9])]
    assert chat[-1].choice == AR_WIDE
    edit = []
    for i in range(12):
        est.score(list(range(16)), list(range(17)))  # the whole draft accepted
        edit.append(decide(s, est, "r"))
        other.score([1, 2], [3])
    assert edit[-1].choice == LOOKUP_WIDE and edit[-1].ks[LOOKUP_WIDE] >= 8
    assert next(i for i, d in enumerate(edit) if d.choice == LOOKUP_WIDE) <= 4  # it follows within a few rounds
    assert decide(s, other, "r").choice == AR_WIDE  # the next round serves the chat: its own estimate
    # back to new text: long accepted drafts weigh by their positions, so the way back takes more
    # rounds (of one token and a short draft each), not more tokens
    back = [decide(s, est, "r") for i in range(20) if est.score([1, 2, 3, 4], [9]) == 0]
    assert back[-1].choice == AR_WIDE and back[0].choice == LOOKUP_WIDE


def test_a_new_request_prices_lookup_as_a_target_step_until_a_round_shows_drafts():
    """Before any round a request has shown no free draft: lookup is priced as one target step (no
    higher than AR), even where the verify's extra rows cost next to nothing (this VM's curve:
    112 / 107 / 130 / 235 / 316 ms at 1 / 2 / 4 / 8 / 16 rows). The first round's scoring (an AR
    round's block) is evidence enough: an edit moves to lookup at once."""
    s = Scheduler()
    for rows, ms in ((1, 112.0), (2, 107.0), (4, 130.0), (8, 235.0), (16, 316.0), (32, 560.0)):
        for curve, scale in ((s.model.target_wide, 1.0), (s.model.target, 1.8), (s.model.drafter_wide, 0.53),
                             (s.model.drafter, 0.53 * 1.8)):
            curve.observe(rows, scale * ms / 1000)
    fresh = LookupEstimate()
    rates = s.model.rates(1, 4, 8, LookupOutlook.mean([fresh.outlook()], 16))
    assert rates[LOOKUP_WIDE] <= rates[AR_WIDE]
    assert decide(s, fresh, "r").choice != LOOKUP_WIDE
    edit = LookupEstimate()
    edit.score(list(range(15)), list(range(8)))  # an AR round's 8 tokens, all the free draft's
    assert decide(s, edit, "r").choice == LOOKUP_WIDE


def test_lookup_records_correct_the_prior_not_replace_it():
    """A lookup round's record holds its tokens against its prior's prediction: an edit's fast
    rounds do not make a chat's lookup look fast."""
    from ssd.algorithm.rounds import RoundRecord

    s = wide_scheduler()
    edit = LookupOutlook(alpha=0.95, p_draft=1.0, length=16, k_max=16)
    chat = LookupOutlook(alpha=0.05, p_draft=0.5, length=3, k_max=16)
    d = s.choose(1, 4, 8, WIDE_ALLOWED, lookup=edit)
    for _ in range(20):  # the edit's rounds make half what their prior predicted
        predicted = d.prior[LOOKUP_WIDE]
        s.observe(RoundRecord(LOOKUP_WIDE, "policy", 16, 0, 1, tokens=10, seconds=20 / predicted,
                              source="lookup", drafted=16, hit=None, predicted_rate=predicted))
    est_edit, _ = s.estimates(1, 4, 8, prior=s.model.rates(1, 4, 8, edit))
    est_chat, _ = s.estimates(1, 4, 8, prior=s.model.rates(1, 4, 8, chat))
    assert est_edit[LOOKUP_WIDE] == pytest.approx(0.5 * s.model.rates(1, 4, 8, edit)[LOOKUP_WIDE], rel=0.1)
    assert est_chat[LOOKUP_WIDE] < 0.6 * s.model.rates(1, 4, 8, chat)[LOOKUP_WIDE]
    assert est_chat[LOOKUP_WIDE] < est_chat[AR_WIDE]


def test_lookup_before_its_own_records_is_corrected_as_the_target_alone_is_not_as_the_drafter():
    """Until lookup rounds have run, their price borrows the correction of the rounds that run the
    target alone (AR): a lookup round is a target forward and a free draft. The neural drafter's
    shortfall (its core contended, its drafts accepted less than predicted) is none of lookup's."""
    from ssd.algorithm.rounds import RoundRecord

    s = wide_scheduler()
    edit = LookupOutlook(alpha=0.95, p_draft=1.0, length=16, k_max=16)
    prior = s.model.rates(1, 4, 8, edit)
    for choice, share in ((Choice.SD_WIDE, 0.5), (Choice.AR_WIDE, 1.0)):
        for _ in range(20):  # SD rounds make half their predicted rate, AR rounds what was predicted
            s.observe(RoundRecord(choice, "policy", 4, 0, 1, tokens=4, seconds=4 / (share * prior[choice]),
                                  source="draft" if choice == Choice.SD_WIDE else "none", drafted=4, hit=None))
    est, _ = s.estimates(1, 4, 8, prior=prior)
    assert est[Choice.SD_WIDE] < 0.7 * prior[Choice.SD_WIDE]  # the drafter's shortfall, learned
    assert est[LOOKUP_WIDE] == pytest.approx(prior[LOOKUP_WIDE], rel=0.05)


def test_a_request_may_opt_out_and_pinned_requests_never_get_lookup_rounds():
    from ssd.config import DecodeConfig

    assert DecodeConfig().allowed(wide=True, lookup=True)[-2:] == ("lookup", "lookup@wide")
    assert DecodeConfig().allowed(wide=False, lookup=True)[-1] == "lookup"
    assert not any("lookup" in c for c in DecodeConfig(free_drafts=False).allowed(wide=True, lookup=True))
    assert not any("lookup" in c for c in DecodeConfig().allowed(wide=True, lookup=False))  # server off
    assert DecodeConfig(mode="sd").allowed(wide=True, lookup=True) == ("sd",)
    assert ServerConfig(free_drafts=False).decode_defaults().free_drafts is False
