"""``ByteTokenizer``: UTF-8 bytes 0-255 as ids 0-255, plus BOS/EOS/PAD (256, 257, 258)."""

from __future__ import annotations

from collections.abc import Iterable


class ByteTokenizer:
    """Lossless byte-level tokenizer of the shipped models (259 ids; the models pad V to 264)."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids, optionally wrapped in BOS/EOS."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the byte ids in ``ids``; special and out-of-range ids are dropped, and a byte
        sequence that is not valid UTF-8 (e.g. a generation cut mid-character) decodes with
        U+FFFD replacement characters."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"
