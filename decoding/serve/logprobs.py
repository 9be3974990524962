"""The engine's per-token log-probabilities (``sampling.TokenLogprob``) in OpenAI's two formats.

* chat (``logprobs: true, top_logprobs: n``): ``choices[i].logprobs = {"content": [{"token",
  "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...n]}, ...]}``;
* completions (``logprobs: n``): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``,
  ``top_logprobs`` one ``{token: logprob}`` per token holding its n most likely alternatives and
  the chosen token (so up to n + 1 entries, as OpenAI's legacy API), ``text_offset`` each
  token's character offset in the choice's text.

A token's ``bytes`` are the UTF-8 bytes of its piece (``Tokenizer.token_bytes``; a piece may hold
part of a character) and its ``token`` string those bytes decoded, an incomplete character's
bytes written as ``\\xNN`` escapes. Alternatives a sampling filter removed (``-inf``, the
engine's ``"processed"`` mode) are left out: JSON has no infinity, and they could not be drawn.
"""

from __future__ import annotations

import math

from decoding.sampling import TokenLogprob
from models.tokenizer import Tokenizer

# What OpenAI reports for a token too unlikely to matter; used should the chosen token's own
# log-probability not be finite.
UNLIKELY = -9999.0


class LogprobFormatter:
    """Turns records into OpenAI's objects; token strings cached per id."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._pieces: dict[int, tuple[str, list[int]]] = {}

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        """``(token string, its bytes as ints)``."""
        out = self._pieces.get(token_id)
        if out is None:
            raw = self.tokenizer.token_bytes(token_id)
            out = self._pieces[token_id] = (raw.decode("utf-8", "backslashreplace"), list(raw))
        return out

    def _entry(self, token_id: int, logprob: float) -> dict:
        token, raw = self.piece(token_id)
        lp = logprob if math.isfinite(logprob) else UNLIKELY
        return {"token": token, "logprob": lp, "bytes": raw}

    def chat(self, records: list[TokenLogprob]) -> list[dict]:
        """``logprobs.content`` for ``records``."""
        return [
            {
                **self._entry(r.token, r.logprob),
                "top_logprobs": [self._entry(t, lp) for t, lp in r.top if math.isfinite(lp)],
            }
            for r in records
        ]

    def completion(self, records: list[TokenLogprob], offsets: list[int]) -> dict:
        """The completions ``logprobs`` object of ``records``, at text ``offsets``."""
        tops = []
        for r in records:
            top = {self.piece(t)[0]: lp for t, lp in r.top if math.isfinite(lp)}
            token = self.piece(r.token)[0]
            top.setdefault(token, self._entry(r.token, r.logprob)["logprob"])
            tops.append(top)
        return {
            "tokens": [self.piece(r.token)[0] for r in records],
            "token_logprobs": [self._entry(r.token, r.logprob)["logprob"] for r in records],
            "top_logprobs": tops,
            "text_offset": list(offsets),
        }
