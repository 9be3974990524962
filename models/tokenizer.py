"""Tokenizers: one ``Tokenizer`` interface, ``load_tokenizer`` for real checkpoints, ``ByteTokenizer``.

- ``load_tokenizer(path)``: a ``.gguf`` file (its ``tokenizer.ggml.*`` metadata, see
  ``models.gguf_vocab``) or a directory with ``tokenizer.json`` (and, when present,
  ``tokenizer_config.json`` / ``chat_template.jinja`` for the chat template, the special tokens
  and the add-BOS rule). Both give an ``HFTokenizer`` on Hugging Face's ``tokenizers`` library.
- ``ByteTokenizer``: UTF-8 bytes 0-255 as ids 0-255 plus BOS/EOS/PAD (256, 257, 258), the
  tokenizer of the shipped code models.

``encode(text)`` is the text alone: special tokens are added only when asked (``add_bos``), but
special-token strings inside the text (``"<|im_start|>"``) map to their ids, as transformers'
``encode(text, add_special_tokens=False)`` does. ``add_bos`` (the attribute) says whether the
model expects a BOS before a prompt.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import tokenizers

from models.chat_template import render_chat_template
from models.gguf_metadata import read_gguf_metadata
from models.gguf_vocab import gguf_vocab


@runtime_checkable
class Tokenizer(Protocol):
    """What generation, chat and streaming need from a tokenizer."""

    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    vocab_size: int
    chat_template: str | None
    add_bos: bool
    special_ids: frozenset[int]

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def apply_chat_template(
        self, messages, *, add_generation_prompt: bool = True, tokenize: bool = True, **kwargs
    ) -> list[int] | str: ...


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte as one printable character, the
    printable Latin-1 bytes as themselves and the others as U+0100 onwards, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    shifted = [b for b in range(256) if b not in keep]
    chars = {chr(b): b for b in keep}
    chars.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return chars


_BYTE_OF = _byte_alphabet()
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _check_text(text) -> None:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")


class ByteTokenizer:
    """Lossless byte-level tokenizer of the shipped models (259 ids; the models pad V to 264).
    Its models were trained on BOS-prefixed documents (``add_bos``); it has no chat template."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259
    chat_template = None
    add_bos = True
    special_ids = frozenset({256, 257, 258})
    _names = {256: "<bos>", 257: "<eos>", 258: "<pad>"}

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids, optionally wrapped in BOS/EOS."""
        _check_text(text)
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of the byte ids in ``ids``; out-of-range ids are dropped, special ids too unless
        ``skip_special_tokens=False`` (then spelled ``<bos>``, ``<eos>``, ``<pad>``), and a byte
        sequence that is not valid UTF-8 (e.g. a generation cut mid-character) decodes with U+FFFD
        replacement characters."""
        out, run = [], bytearray()
        for i in map(int, ids):
            if 0 <= i < 256:
                run.append(i)
            elif i in self._names and not skip_special_tokens:
                out += [run.decode("utf-8", errors="replace"), self._names[i]]
                run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The byte ``token_id`` stands for; a special id's name (``b"<eos>"``)."""
        i = int(token_id)
        return bytes([i]) if 0 <= i < 256 else self._names.get(i, "").encode()

    def apply_chat_template(
        self, messages, *, add_generation_prompt: bool = True, tokenize: bool = True, **kwargs
    ):
        """Always ``ValueError``: the byte-level code models have no chat template."""
        raise ValueError(
            "ByteTokenizer has no chat template (the shipped code models are not chat models)"
        )

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with the special ids, add-BOS rule and chat template of its
    checkpoint. Build it with ``load_tokenizer``."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        vocab_size: int,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        add_bos: bool,
        special_ids: frozenset[int],
        chat_template: str | None,
        source: str,
    ):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self.add_bos = add_bos
        self.special_ids = special_ids
        self.chat_template = chat_template
        self.source = source

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Ids of ``text`` alone; BOS/EOS only when asked (``ValueError`` if the tokenizer has none)."""
        _check_text(text)
        ids = self._tokenizer.encode(text, add_special_tokens=False).ids
        return self._special("bos", add_bos) + ids + self._special("eos", add_eos)

    def _special(self, name: str, wanted: bool) -> list[int]:
        if not wanted:
            return []
        token_id = getattr(self, f"{name}_id")
        if token_id is None:
            raise ValueError(
                f"add_{name}=True but the tokenizer from {self.source} has no {name} token"
            )
        return [token_id]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (ids outside ``[0, vocab_size)`` are dropped; special tokens too unless
        ``skip_special_tokens=False``); invalid UTF-8 decodes to U+FFFD."""
        ids = [i for i in map(int, ids) if 0 <= i < self.vocab_size]
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _byte_level(self) -> bool:
        return isinstance(self._tokenizer.decoder, tokenizers.decoders.ByteLevel)

    @functools.cached_property
    def _added(self) -> frozenset[int]:
        return frozenset(self._tokenizer.get_added_tokens_decoder())

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes ``token_id``'s piece adds to decoded text (part of a character for
        some pieces): a byte-level BPE piece mapped back through its byte alphabet, a
        SentencePiece piece with U+2581 as a space and ``<0xNN>`` as that byte, an added
        token's content; ``b""`` for an id outside the vocabulary."""
        piece = self._tokenizer.id_to_token(int(token_id))
        if piece is None:
            return b""
        if int(token_id) in self._added:
            return piece.encode()
        if self._byte_level:
            return b"".join(bytes([_BYTE_OF[c]]) if c in _BYTE_OF else c.encode() for c in piece)
        if m := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()

    def token(self, token_id: int | None) -> str | None:
        """The vocabulary string of ``token_id`` (``None`` for ``None``)."""
        return None if token_id is None else self._tokenizer.id_to_token(token_id)

    def apply_chat_template(
        self, messages, *, add_generation_prompt: bool = True, tokenize: bool = True, **kwargs
    ) -> list[int] | str:
        """``messages`` (``[{"role": str, "content": str}, ...]``) rendered by the checkpoint's chat
        template; token ids (the rendered text through ``encode``, no extra BOS) or, with
        ``tokenize=False``, the text. ``ValueError`` when there is no template or the messages are
        malformed."""
        if self.chat_template is None:
            raise ValueError(f"the tokenizer from {self.source} has no chat template")
        names = {"bos_token": self.bos_id, "eos_token": self.eos_id, "pad_token": self.pad_id}
        special = {name: self.token(i) for name, i in names.items()}
        text = render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=special,
            **kwargs,
        )
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return f"HFTokenizer({self.source!r}, vocab_size={self.vocab_size})"


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from e
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _token_text(value, path: str, key: str) -> str | None:
    if isinstance(value, dict):  # a serialised AddedToken
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{path}: {key} must be a string or {{'content': str}}, got {value!r}")
    return value


def _config_template(config: dict, path: str) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: chat_template must be a string, got {type(template).__name__}")
    return template


def _load_directory(path: str) -> HFTokenizer:
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tokenizer_file):
        raise FileNotFoundError(f"no tokenizer.json in {path!r}")
    config_file = os.path.join(path, "tokenizer_config.json")
    config = _read_json(config_file) if os.path.isfile(config_file) else {}
    map_file = os.path.join(path, "special_tokens_map.json")
    names = {**(_read_json(map_file) if os.path.isfile(map_file) else {}), **config}
    template = _config_template(config, config_file)
    jinja_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            template = f.read()
    try:
        tok = tokenizers.Tokenizer.from_file(tokenizer_file)
    except Exception as e:  # the Rust side raises plain Exception for malformed files
        raise ValueError(f"{tokenizer_file}: not a valid tokenizer.json ({e})") from e
    ids = {}
    for name in ("bos", "eos", "pad", "unk"):
        text = _token_text(names.get(f"{name}_token"), config_file, f"{name}_token")
        ids[name] = None if text is None else tok.token_to_id(text)
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    special |= {i for i in ids.values() if i is not None}
    add_bos = config.get("add_bos_token")
    if add_bos is None:  # the rule lives in the post-processor (e.g. Llama 3's TemplateProcessing)
        add_bos = ids["bos"] is not None and tok.encode("a").ids[:1] == [ids["bos"]]
    return HFTokenizer(
        tok,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        bos_id=ids["bos"],
        eos_id=ids["eos"],
        pad_id=ids["pad"],
        add_bos=bool(add_bos) and ids["bos"] is not None,
        special_ids=frozenset(special),
        chat_template=template,
        source=path,
    )


def _load_gguf(path: str) -> HFTokenizer:
    vocab = gguf_vocab(read_gguf_metadata(path), path)
    return HFTokenizer(
        vocab.tokenizer,
        vocab_size=vocab.vocab_size,
        bos_id=vocab.bos_id,
        eos_id=vocab.eos_id,
        pad_id=vocab.pad_id,
        add_bos=vocab.add_bos,
        special_ids=vocab.special_ids,
        chat_template=vocab.chat_template,
        source=path,
    )


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer of a ``.gguf`` file or of a checkpoint directory with ``tokenizer.json``.

    ``FileNotFoundError`` when ``path`` does not exist or the directory has no ``tokenizer.json``;
    ``ValueError`` naming the file and the key for an unsupported or malformed vocabulary
    (e.g. an unknown ``tokenizer.ggml.model``), raised before the vocabulary is built.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return _load_directory(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no tokenizer at {path!r} (expected a .gguf file or a directory)")
    if path.endswith(".json"):
        raise ValueError(f"{path}: pass the directory that holds tokenizer.json, not the file")
    return _load_gguf(path)
