"""The two SSD choices' records split by draft source, and the rate put together from those parts.

The two SSD choices (neural or n-gram backup) run the same rounds on a cache hit and differ only
on a miss, one round in 4-5, so their plain records mostly measure luck (traced, served bench: a
2-round probe of the fast backup hit twice, and every later miss ran the n-gram draft at 1.0 token
a round where the neural backup's missed rounds yielded 3.7). So each SSD round also goes into the
part of its choice's record for where its draft came from (a hit, or the backup), and a choice is
rated from the parts (``SsdParts.rate``):
- the share of hit rounds is the model's for this backup (``SpeedupModel.hit_share``, learned
  from every SSD round);
- the hit rounds' tokens are the latest of either SSD choice's at this bucket (a cached draft does
  not depend on the backup);
- a miss round's tokens are what the backup's draft yields on the text decoding now: the neural
  backup drafts, from the true outcome, what the speculation would have cached for it (the same
  drafter), so as much as a hit; an n-gram draft, what the lookup scores on every round whichever
  backup runs (``e_miss["fast"]``). Taken from the backup's own miss rounds, they would describe
  the text those ran on (traced, served bench: the warm-up haiku, drafted at 1-2 tokens a round,
  left the neural backup's misses at 1.5 tokens, the batch moved to the n-gram backup, and since
  the neural one did not run again that record held the batch there: GSM8K SSD 2.20 tok/s against
  SD's 2.51);
- the seconds of a hit round: at batch 1 either choice's latest (the round waits for no backup);
  at a larger batch this choice's own, if it has any (a hit row waits for the rows that missed, so
  its seconds belong to its backup);
- a miss round's seconds: those plus the backup's drafting, which the text does not change: what
  the backup's own miss rounds took over its own hit rounds (once it has ``MEASURED`` misses and a
  hit here), else the model's (``SpeedupModel.backup_seconds``).
"""
from __future__ import annotations

from .estimators import MEASURED, Measured


def other_ssd(choice: str) -> str:
    """The SSD choice with the other backup."""
    return "ssd+fast" if choice == "ssd+neural" else "ssd+neural"


class SsdParts(dict):
    """(SSD choice, bucket, "hit" | "miss") -> Measured."""

    def observe(self, choice: str, bucket: int, source: str, tokens: float, seconds: float, weight: float,
                now: int, counts: bool) -> None:
        """A round of ``choice`` whose draft came from ``source`` (cache: a hit; else the backup's name)."""
        part = (choice, bucket, "hit" if source == "cache" else "miss")
        self.setdefault(part, Measured()).update(tokens, seconds, weight, now, counts=counts)

    def part(self, choice: str, bucket: int, source: str, least: float) -> Measured | None:
        """The hit or miss part of a choice's record at this bucket, once it has ``least`` rounds."""
        m = self.get((choice, bucket, source))
        return m if m is not None and m.count >= least else None

    def forget(self, choice: str, bucket: int) -> None:
        for source in ("hit", "miss"):
            if (m := self.get((choice, bucket, source))) is not None:
                m.forget()

    def rate(self, choice: str, bucket: int, k: int, model) -> float | None:
        """Tokens/s per sequence of an SSD ``choice`` at this bucket, at draft length ``k``, put
        together from the parts (see the top); None while neither SSD choice has a hit round here.
        ``model``: the SpeedupModel (hit shares, the n-gram lookup's score, backup seconds)."""
        kind = choice.partition("+")[2]
        own_hit, other_hit = self.part(choice, bucket, "hit", 1), self.part(other_ssd(choice), bucket, "hit", 1)
        if own_hit is None and other_hit is None:
            return None
        hit = max((h for h in (own_hit, other_hit) if h is not None), key=lambda h: h.last)
        timed = own_hit if bucket > 0 and own_hit is not None else hit
        p = model.hit_share(kind)
        m_tokens = hit.tokens.value if kind == "neural" else model.e_miss["fast"].tokens(k)
        miss = self.part(choice, bucket, "miss", MEASURED)
        if miss is not None and own_hit is not None:
            backup = max(0.0, miss.seconds.value - own_hit.seconds.value)  # both parts of one period
        else:
            backup = model.backup_seconds(kind, 2 ** bucket, k)
        m_seconds = timed.seconds.value + backup
        return (p * hit.tokens.value + (1 - p) * m_tokens) / max(p * timed.seconds.value + (1 - p) * m_seconds, 1e-9)
