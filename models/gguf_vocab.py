"""A ``tokenizers.Tokenizer`` built from GGUF tokenizer metadata (llama.cpp's key names).

GGUF files carry no ``tokenizer.json``: they store the vocabulary under ``tokenizer.ggml.*``. Two
families are supported, named by ``tokenizer.ggml.model``:

- ``gpt2``: byte-level BPE. ``tokens`` are spelled in GPT-2's byte alphabet, ``merges`` are
  ``"left right"`` strings in rank order, and ``pre`` names the pre-tokenizer regexes the merges
  were learned with (the table below, facts from llama.cpp's ``llama-vocab.cpp``).
- ``llama``: SentencePiece BPE. ``tokens`` use U+2581 for spaces, ``scores`` rank the pieces (a
  higher score merges first), byte-fallback pieces ``<0xNN>`` cover any byte, and
  ``add_space_prefix`` prepends U+2581 to the text. ``tokenizers``' BPE takes ranked merges, so
  they are recovered from the pieces: each piece that splits into two pieces is one merge, ranked
  by its score (the order transformers' GGUF loader gives them).

``token_type`` marks special tokens (llama.cpp's ``TokenType``): CONTROL and UNKNOWN pieces become
special added tokens (matched whole in text, dropped by ``decode(skip_special_tokens=True)``);
USER_DEFINED pieces become plain added tokens (matched whole, kept by decode). Every added token
keeps its GGUF id, so the ids are the model's embedding rows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import tokenizers
from gguf import Keys, TokenType

_K = Keys.Tokenizer

# Pre-tokenizer splits for byte-level BPE, by ``tokenizer.ggml.pre``: each regex splits the pieces
# left by the one before it (``Split(..., "isolated")``), as llama.cpp applies its list.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS = r"\p{N}"
_LLAMA3_NAMES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe")
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt-2": (_GPT2,),
    "default": (_GPT2,),  # what transformers and GPT-2's own tokenizer.json use for "default"
    "mpt": (_GPT2,),
    "olmo": (_GPT2,),
    **{name: (_LLAMA3,) for name in _LLAMA3_NAMES},
    **{name: (_QWEN2,) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2")},
    **{name: (_DIGITS, _GPT2) for name in ("smollm", "starcoder", "refact", "codeshell")},
}
TOKENIZER_MODELS = ("gpt2", "llama")


@dataclass(frozen=True)
class GGUFVocab:
    """What a GGUF file says about its tokenizer, beyond the ``tokenizers.Tokenizer`` itself."""

    tokenizer: tokenizers.Tokenizer
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    add_bos: bool
    special_ids: frozenset[int]
    chat_template: str | None


def _token_id(metadata: dict, key: str, n_tokens: int, path: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_tokens:
        raise ValueError(f"{path}: {key} is {value!r}, not a token id in [0, {n_tokens})")
    return value


def check_gguf_vocab(metadata: dict, path: str) -> None:
    """Raise ``ValueError`` naming ``path`` and the key when the tokenizer metadata is unusable;
    cheap (no tokenizer is built), so callers run it before any heavy work."""
    model = metadata.get(_K.MODEL)
    if model is None:
        raise ValueError(f"{path}: no {_K.MODEL} in the GGUF metadata (no tokenizer in this file)")
    if model not in TOKENIZER_MODELS:
        raise ValueError(
            f"{path}: unsupported {_K.MODEL} {model!r}; supported: {', '.join(TOKENIZER_MODELS)}"
        )
    tokens = metadata.get(_K.LIST)
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{path}: {_K.LIST} is missing or not a non-empty list of strings")
    n = len(tokens)
    for key in (_K.TOKEN_TYPE, _K.SCORES):
        value = metadata.get(key)
        if value is not None and (not isinstance(value, np.ndarray) or value.shape != (n,)):
            raise ValueError(f"{path}: {key} must be an array of {n} numbers (one per token)")
    if model == "gpt2":
        pre = metadata.get(_K.PRE, "default")
        if pre not in PRE_TOKENIZER_SPLITS:
            raise ValueError(
                f"{path}: unsupported {_K.PRE} {pre!r}; supported: {', '.join(PRE_TOKENIZER_SPLITS)}"
            )
        merges = metadata.get(_K.MERGES)
        if not isinstance(merges, list) or not all(
            isinstance(m, str) and m.count(" ") == 1 for m in merges
        ):
            raise ValueError(f"{path}: {_K.MERGES} must be a list of 'left right' strings")
    elif metadata.get(_K.SCORES) is None:
        raise ValueError(f"{path}: a 'llama' (SentencePiece) vocabulary needs {_K.SCORES}")
    for key in (_K.BOS_ID, _K.EOS_ID, _K.PAD_ID, _K.UNK_ID):
        _token_id(metadata, key, n, path)
    template = metadata.get(_K.CHAT_TEMPLATE)
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: {_K.CHAT_TEMPLATE} must be a string")


def _added_tokens(tokens: list[str], types: np.ndarray | None, named: set[int]) -> list[dict]:
    special = set(named)
    user = []
    if types is not None:
        special.update(np.flatnonzero((types == TokenType.CONTROL) | (types == TokenType.UNKNOWN)))
        user = np.flatnonzero(types == TokenType.USER_DEFINED)
    entry = dict(single_word=False, lstrip=False, rstrip=False, normalized=False)
    added = [dict(id=int(i), content=tokens[i], special=True, **entry) for i in sorted(special)]
    added += [dict(id=int(i), content=tokens[i], special=False, **entry) for i in user]
    return sorted(added, key=lambda t: t["id"])


def _vocab(tokens: list[str]) -> dict[str, int]:
    # A duplicated piece maps to its last id, as in llama.cpp's token_to_id.
    return {t: i for i, t in enumerate(tokens)}


def _byte_level(metadata: dict) -> tuple[dict, dict, dict]:
    pre = metadata.get(_K.PRE, "default")
    splits = [
        {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False}
        for r in PRE_TOKENIZER_SPLITS[pre]
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    model = {
        "type": "BPE",
        "vocab": _vocab(metadata[_K.LIST]),
        "merges": [m.split(" ") for m in metadata[_K.MERGES]],
        "byte_fallback": False,
        "fuse_unk": False,
        # llama.cpp (and Llama 3's tokenizer.json) take a whole pre-token that is a vocabulary entry
        "ignore_merges": pre in _LLAMA3_NAMES,
    }
    pre_tokenizer = {
        "type": "Sequence",
        "pretokenizers": [*splits, {**byte_level, "use_regex": False}],
    }
    return model, pre_tokenizer, {**byte_level, "use_regex": True}


def _scored_merges(tokens: list[str], scores: np.ndarray, types: np.ndarray | None) -> list:
    """Ranked merges of a SentencePiece BPE vocabulary: piece ``l + r`` merges ``l`` and ``r`` at the
    rank of its score (higher first; ties: longer left piece, then longer right piece first)."""
    ids = _vocab(tokens)
    skip = np.zeros(len(tokens), bool) if types is None else (types == TokenType.BYTE)
    found = []  # (score, len(l), len(r), order, l, r)
    for i, piece in enumerate(tokens):
        if skip[i] or len(piece) < 2:
            continue
        pairs = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        pairs = sorted((ids[a], ids[b], a, b) for a, b in pairs if a in ids and b in ids)
        score = float(scores[i])
        found += [
            (score, len(a), len(b), len(found) + j, a, b) for j, (*_, a, b) in enumerate(pairs)
        ]
    found.sort(key=lambda m: (-m[0], -m[1], -m[2], m[3]))
    return [[a, b] for *_, a, b in found]


def _sentencepiece(metadata: dict, unk: str | None) -> tuple[dict, dict, dict]:
    tokens = metadata[_K.LIST]
    prefix = bool(metadata.get(_K.ADD_PREFIX, True))
    model = {
        "type": "BPE",
        "vocab": _vocab(tokens),
        "merges": _scored_merges(tokens, metadata[_K.SCORES], metadata.get(_K.TOKEN_TYPE)),
        "unk_token": unk,
        "byte_fallback": True,
        "fuse_unk": True,
    }
    pre_tokenizer = {
        "type": "Metaspace",
        "replacement": "\u2581",
        "prepend_scheme": "first" if prefix else "never",
        "split": False,
    }
    steps = [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if prefix:
        steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return model, pre_tokenizer, {"type": "Sequence", "decoders": steps}


def _default_add_bos(metadata: dict) -> bool:
    # llama.cpp's defaults when the file does not say: SentencePiece and Llama 3 vocabularies
    # start with BOS, other byte-level BPE vocabularies do not.
    return metadata[_K.MODEL] == "llama" or metadata.get(_K.PRE) in _LLAMA3_NAMES


def gguf_vocab(metadata: dict, path: str) -> GGUFVocab:
    """The tokenizer described by GGUF ``metadata`` (from ``read_gguf_metadata(path)``)."""
    check_gguf_vocab(metadata, path)
    tokens = metadata[_K.LIST]
    n = len(tokens)
    ids = {key: _token_id(metadata, key, n, path) for key in (_K.BOS_ID, _K.EOS_ID, _K.PAD_ID)}
    unk_id = _token_id(metadata, _K.UNK_ID, n, path)
    named = {i for i in (*ids.values(), unk_id) if i is not None}
    types = metadata.get(_K.TOKEN_TYPE)
    if metadata[_K.MODEL] == "gpt2":
        model, pre_tokenizer, decoder = _byte_level(metadata)
    else:
        model, pre_tokenizer, decoder = _sentencepiece(
            metadata, tokens[unk_id] if unk_id is not None else None
        )
    added = _added_tokens(tokens, types, named)
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": None,
        "decoder": decoder,
        "model": model,
    }
    add_bos = metadata.get(_K.ADD_BOS)
    return GGUFVocab(
        tokenizer=tokenizers.Tokenizer.from_str(json.dumps(spec, ensure_ascii=False)),
        vocab_size=n,
        bos_id=ids[_K.BOS_ID],
        eos_id=ids[_K.EOS_ID],
        pad_id=ids[_K.PAD_ID],
        add_bos=_default_add_bos(metadata) if add_bos is None else bool(add_bos),
        special_ids=frozenset(t["id"] for t in added if t["special"]),
        chat_template=metadata.get(_K.CHAT_TEMPLATE),
    )
