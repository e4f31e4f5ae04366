"""What one decoding round is (RoundRecord) and the choices a round can make (Choice).

Every round of every request produces one record; the server's learner (``Learner``) takes it and
hands it to each estimate that learns from rounds, and the request's statistics add it up.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Choice(str, Enum):
    """What a round runs: the mode, for SSD what drafts after a cache miss, and the core layout.
    Split (the default): target and drafter on a core each, one thread each, so SSD's verify and
    speculation run side by side. Wide ("@wide"): the engine that computes gets every core the
    server has (SD drafts, then verifies, serially; AR verifies), which pays where a second thread
    speeds a forward more than running the drafter beside it does. Lookup: SD whose drafts are free
    (free_draft.py: the request's own text and the suffix cache), the target alone computing."""

    SSD_NEURAL = "ssd+neural"
    SSD_FAST = "ssd+fast"
    SD = "sd"
    AR = "ar"
    SD_WIDE = "sd@wide"
    AR_WIDE = "ar@wide"
    LOOKUP = "lookup"
    LOOKUP_WIDE = "lookup@wide"

    def __str__(self) -> str:
        return self.value

    @property
    def mode(self) -> str:
        return self.value.partition("+")[0].partition("@")[0]

    @property
    def wide(self) -> bool:
        return self.value.endswith("@wide")

    @property
    def backup(self) -> str:
        return self.value.partition("+")[2] or "neural"

    @property
    def uses_drafter(self) -> bool:
        """Whether its rounds run the drafter (and so first bring it up to the sequence)."""
        return self.mode not in ("ar", "lookup")

    def switch_is_free(self, other: "Choice") -> bool:
        """Choices of one mode share everything but the layout (or, for SSD, the backup), and AR
        and lookup need neither a cached draft nor the drafter; any other change costs a round (no
        cached draft; the drafter's catch-up is priced apart, Scheduler.after_catch_up)."""
        return self.mode == other.mode or not other.uses_drafter


SPLIT_CHOICES = tuple(c for c in Choice if not c.wide and c.mode != "lookup")  # what a server without free drafts offers


@dataclass(frozen=True)
class RoundRecord:
    choice: Choice
    reason: str  # why the scheduler chose it (policy | explore | forced | request | warmup | drafter down)
    k: int  # tokens the round could draft
    budget: int  # speculation branches (0: no speculation)
    batch: int  # sequences decoding when the round began
    tokens: int  # tokens it produced: the accepted ones plus the target's own
    seconds: float  # wall time, draft to accepted block
    source: str  # where its draft came from: cache | neural | fast | draft (SD) | lookup | none (AR)
    drafted: int  # draft tokens verified
    hit: bool | None  # whether the verified outcome was pre-drafted (None: nothing was speculated)
    target_timing: tuple = ()  # the engines' forwards as (rows, seconds)
    drafter_timing: tuple = ()
    verify_seconds: float = 0.0  # round trip of the verify call
    speculate_seconds: float = 0.0
    draft_seconds: float = 0.0  # SD's draft or a backup's, when the round had no cached draft
    ngram_accepted: int = 0  # what the n-gram lookup would have had accepted here, scored for free
    ngram_drafted: int = 1
    fanout_at_outcome: int = 0  # branches pre-drafted at the accepted depth (the fan-out fit)
    after_switch: bool = False  # the request's first round after a costly change of choice
    steps: int = 1  # target steps it took: an AR round may decode several tokens in one call
    prompt_seconds: float = 0.0  # of ``seconds``, the target's work on new requests' prompts batched with it
    predicted_rate: float = 0.0  # the cost model's tokens/s for the choice when it was chosen (lookup rounds)

    @property
    def own_seconds(self) -> float:
        """What the round's choice cost: its wall time less the prompts it waited for."""
        return max(self.seconds - self.prompt_seconds, 1e-6)

    @property
    def accepted(self) -> int:
        return self.tokens - 1


class Learner:
    """Takes every round's record to the estimates that learn from it: the cost model (engine
    costs, acceptance, hit rates), the scheduler's measured rates and the fan-out's miss exponent
    (its acceptance is the cost model's)."""

    def __init__(self, scheduler, fanout):
        self.scheduler, self.fanout = scheduler, fanout

    def observe(self, rec: RoundRecord) -> None:
        self.scheduler.model.learn(rec)
        self.scheduler.observe(rec)
        if rec.hit is not None:
            self.fanout.record_lookup(rec.fanout_at_outcome, rec.hit)
