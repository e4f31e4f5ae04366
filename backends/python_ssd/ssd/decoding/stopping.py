"""Where an output ends: EOS, max_tokens and stop strings, applied token by token.

The verifier hands out blocks of several tokens per round; walking them one at a time here makes
SD and SSD stop at exactly the token (and character) where AR would have stopped.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StopChecker:
    decode: callable  # list[int] -> str
    max_tokens: int
    eos_ids: set[int] = field(default_factory=set)
    stop: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    _text: str = ""
    _emitted: int = 0  # characters already streamed
    _cut: int | None = None  # where a stop string starts in the decoded text

    def push(self, new: list[int]) -> bool:
        """Adds tokens in order until a stop condition; returns True when the output is finished."""
        for t in new:
            if self.finish_reason:
                break
            if t in self.eos_ids:
                self.finish_reason = "stop"
                break
            self.tokens.append(t)
            if self.stop:
                text = self.decode(self.tokens)
                hits = [text.find(s) for s in self.stop if text.find(s) >= 0]
                if hits:
                    self._cut = min(hits)  # the stop string itself is not part of the output
                    self.finish_reason = "stop"
                    break
            if len(self.tokens) >= self.max_tokens:
                self.finish_reason = "length"
                break
        text = self.decode(self.tokens)
        self._text = text if self._cut is None else text[:self._cut]
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._text

    def delta(self) -> str:
        """New text since the last call. Holds back a trailing partial UTF-8 character and any tail
        that could still grow into a stop string, so streamed text equals the final text."""
        text = self._text
        end = len(text)
        if not self.finish_reason:
            if text.endswith("\ufffd"):
                end = len(text.rstrip("\ufffd"))
            for s in self.stop:
                for n in range(min(len(s) - 1, end), 0, -1):
                    if text[:end].endswith(s[:n]):
                        end -= n
                        break
        if end <= self._emitted:
            return ""
        out = text[self._emitted:end]
        self._emitted = end
        return out
