"""Helpers for the tokenizer tests: transformers' tokenizer of a GGUF file (loaded once per
process), GGUF vocabularies written by the tests, and a tiny SentencePiece-style BPE learner."""

from __future__ import annotations

import collections
import functools
import os
import pathlib

import gguf
import numpy as np

# Text that exercises pre-tokenizers and byte-level BPE: code, whitespace runs, Unicode, emoji
# (ZWJ sequences, flags, skin tones), digit runs, special tokens in text, contractions.
TEXTS = [
    "",
    " ",
    "Hello world",
    "def f(x):\n    return x ** 2  # square\n\tpass\n",
    "if (a&&b) { c->d[0] = 'e'; }  // C\r\n",
    "a\tb\t\tc   d\n\n\ne  \n \n",
    "   leading spaces",
    "trailing spaces   ",
    "\n\n\n",
    "12345678901234567890 3.14159 1,000,000 -42 0x1F 2024-06-01",
    "héllo wörld naïve café Ñandú Straße",
    "日本語のテキスト、中文字符。한국어",
    "שלום עולם مرحبا بالعالم",
    "😀 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷🇯🇵 ✓ 𝔘𝔫𝔦",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "I'm can't we've they'll she'd it's HE'S",
    "MiXeD CaSe and ALLCAPS",
    "email@example.com https://x.org/a?b=c#d",
]


def model_dir_and_name(path: os.PathLike) -> tuple[str, str]:
    path = pathlib.Path(path)
    return str(path.parent), path.name


@functools.cache
def hf_gguf_tokenizer(path: str):
    """transformers' own tokenizer of the GGUF file at ``path`` (slow: cached)."""
    from transformers import AutoTokenizer

    directory, name = model_dir_and_name(path)
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def write_vocab_gguf(path: os.PathLike, **keys) -> pathlib.Path:
    """A GGUF file with ``keys`` (``tokenizer.ggml.*`` names without the prefix, e.g.
    ``model="llama", tokens=[...]``) and one dummy tensor."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    setters = {
        "model": writer.add_tokenizer_model,
        "pre": writer.add_tokenizer_pre,
        "tokens": writer.add_token_list,
        "scores": writer.add_token_scores,
        "token_type": writer.add_token_types,
        "merges": writer.add_token_merges,
        "bos_token_id": writer.add_bos_token_id,
        "eos_token_id": writer.add_eos_token_id,
        "unknown_token_id": writer.add_unk_token_id,
        "padding_token_id": writer.add_pad_token_id,
        "add_bos_token": writer.add_add_bos_token,
        "add_space_prefix": writer.add_add_space_prefix,
        "chat_template": writer.add_chat_template,
    }
    for key, value in keys.items():
        if value is not None:
            setters[key](value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return pathlib.Path(path)


def learn_sentencepiece_bpe(corpus: list[str], n_merges: int) -> list[str]:
    """Pieces of a SentencePiece-style BPE learned on ``corpus`` (spaces as U+2581, each word
    prefixed with one), single characters first, then merged pieces in the order learned."""
    words = collections.Counter("\u2581" + w for line in corpus for w in line.split(" ") if w)
    split = {w: list(w) for w in words}
    pieces = sorted({c for w in words for c in w})
    for _ in range(n_merges):
        pairs = collections.Counter()
        for w, n in words.items():
            s = split[w]
            for a, b in zip(s, s[1:], strict=False):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        pieces.append(a + b)
        for w in words:
            s, out, i = split[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            split[w] = out
    return pieces
