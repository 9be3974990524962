"""``StreamDecoder``: text of a growing token sequence, emitted as soon as it is final.

Decoding token by token does not work: a byte-level BPE token may hold half a UTF-8 character, and
SentencePiece decoders strip the leading space of the text they are given. Decoding the whole
history at every step works but costs O(length) per token. This decoder does what vLLM's and
TGI's incremental detokenizers do: it decodes only a short window of trailing tokens, starting at
a token boundary where the text was complete, and emits what the window's text gained. The window
is a few tokens, longer only inside a run of characters whose bytes straddle every token boundary.

Text ending in U+FFFD is held back (the replacement may be an unfinished character), so an emitted
piece never changes later; ``flush()`` releases whatever is left. The pieces concatenate to
``tokenizer.decode(all ids)``. One exception, for invalid output only: a SentencePiece vocabulary's
run of byte-fallback pieces decodes as a whole, all U+FFFD if any byte in it is invalid, so a
character emitted from the run's valid start stays emitted when a stray byte follows it.
"""

from __future__ import annotations

from collections.abc import Iterable

from models.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class StreamDecoder:
    """Push token ids as they are generated; get back the newly completed text.

    >>> stream = StreamDecoder(tok)
    >>> for token_id in generated:
    ...     print(stream.push(token_id), end="", flush=True)
    >>> print(stream.flush())
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._start = 0  # the window: self.ids[self._start:]
        self._boundary = 0  # a later token boundary where the window's text was complete
        self._emitted = 0  # characters of the window's text already returned

    def _decode(self, start: int) -> str:
        return self.tokenizer.decode(self.ids[start:], skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: int | Iterable[int]) -> str:
        """Add one id or several; return the text they completed (often ``""`` mid-character)."""
        if isinstance(token_ids, int):
            return self._push(token_ids)
        return "".join([self._push(int(i)) for i in token_ids])

    def _push(self, token_id: int) -> str:
        # One token at a time, so every token boundary that ends a character can start a window.
        self.ids.append(token_id)
        text = self._decode(self._start)
        final = len(text.rstrip(_REPLACEMENT))
        piece = text[self._emitted : final]
        self._emitted = max(self._emitted, final)
        if final == len(text):
            # Complete text: restart the window at the previous complete boundary, so the next
            # decode keeps the tokens since then as context (a leading space, a merge partner).
            # An empty window is not a context: a decoder that strips the text's first space
            # (SentencePiece) would strip it from the next token instead.
            fresh = self._decode(self._boundary) if self._boundary > self._start else ""
            if fresh:
                self._start, self._emitted = self._boundary, len(fresh)
            self._boundary = len(self.ids)
        return piece

    def flush(self) -> str:
        """The text still held back (e.g. a trailing invalid byte as U+FFFD); call it at the end."""
        text = self._decode(self._start)
        piece = text[self._emitted :]
        self._emitted = len(text)
        return piece
