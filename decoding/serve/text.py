"""One choice's text as its tokens arrive: UTF-8-safe pieces with stop strings cut out.

Stop strings are matched on the decoded text, so a stop string split over several tokens (or
inside one) is found. Text that could still be the start of a stop string is held back until
the next tokens decide it, so nothing emitted is ever taken back: the emitted pieces
concatenate to the final text, which ends just before the earliest stop string and never
contains one.
"""

from __future__ import annotations

from models.stream_decoder import StreamDecoder
from models.tokenizer import Tokenizer


class ChoiceText:
    """``push(ids)`` -> the newly final text; ``flush()`` at the end; ``stopped`` once a stop
    string matched (later tokens are ignored)."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] = ()):
        self._decoder = StreamDecoder(tokenizer)
        self._stop = [s for s in stop if s]
        self.text = ""  # decoded so far (cut at the stop string once one matched)
        self._emitted = 0
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.text += self._decoder.push(ids)
        return self._advance(final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        self.text += self._decoder.flush()
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        # A match cannot start inside emitted text: that text was never a stop string's prefix.
        hits = [i for s in self._stop if (i := self.text.find(s, self._emitted)) >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
            end = len(self.text)
        else:
            end = len(self.text) if final else len(self.text) - self._held()
        piece, self._emitted = self.text[self._emitted : end], max(self._emitted, end)
        return piece

    def _held(self) -> int:
        """The longest unemitted suffix of the text that begins some stop string."""
        tail = self.text[self._emitted :]
        for k in range(min(len(tail), max(map(len, self._stop), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self._stop):
                return k
        return 0
