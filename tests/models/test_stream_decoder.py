"""StreamDecoder: pieces that concatenate to the full decode, never a U+FFFD that later changes,
text as soon as its bytes are complete, and a bounded decode window."""

import random

import pytest
from tokenizer_utils import TEXTS, learn_sentencepiece_bpe, write_vocab_gguf

from models.stream_decoder import StreamDecoder
from models.tokenizer import ByteTokenizer, load_tokenizer

STREAM_TEXTS = [
    *TEXTS,
    "Emoji run: 😀😃😄😁😆😅🤣😂🙂🙃 🇫🇷🇩🇪🇯🇵 👩🏽‍💻 done.",
    "<|im_start|>assistant\nThe capital of France is Paris. 🗼<|im_end|>",
    "mixed: naïve 日本 العربية 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 — “quotes” …",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_tokenizer(smollm2_gguf)


def _stream(tok, ids, rng, **kwargs):
    stream, pieces, i = StreamDecoder(tok, **kwargs), [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        pieces.append(stream.push(ids[i : i + n] if n > 1 else ids[i]))
        i += n
    return pieces, stream.flush()


def _check_stream(tok, ids, seeds=range(4), **kwargs):
    full = tok.decode(ids, **kwargs)
    for seed in seeds:
        pieces, rest = _stream(tok, ids, random.Random(seed), **kwargs)
        assert "".join(pieces) + rest == full
        if "\ufffd" not in full:
            assert "\ufffd" not in "".join(pieces)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_smollm2_stream_equals_full_decode(smollm2, skip_special_tokens):
    for text in STREAM_TEXTS:
        _check_stream(smollm2, smollm2.encode(text), skip_special_tokens=skip_special_tokens)


def _check_prefixes(tok, ids, **kwargs):
    """Every emitted prefix is a prefix of the final text: nothing emitted ever changes."""
    full, stream, emitted = tok.decode(ids, **kwargs), StreamDecoder(tok, **kwargs), ""
    for token_id in ids:
        emitted += stream.push(token_id)
        assert full.startswith(emitted)
    assert emitted + stream.flush() == full


def test_random_ids_never_change_emitted_text(smollm2):
    """Random ids: byte fragments, stray continuation bytes, special tokens, in any order."""
    rng = random.Random(0)
    byte_tokens = [i for i in range(smollm2.vocab_size) if len(smollm2.token(i)) == 1]
    for _ in range(20):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.7 else rng.randrange(49152)]
        ids += [
            rng.choice(byte_tokens) if rng.random() < 0.7 else rng.randrange(49152)
            for _ in range(40)
        ]
        _check_prefixes(smollm2, ids)
        _check_prefixes(smollm2, ids, skip_special_tokens=False)


def test_character_split_across_tokens_appears_when_complete(smollm2):
    ids = smollm2.encode(" 😀")
    assert len(ids) > 1 and smollm2.decode(ids[:1]).endswith("\ufffd")  # bytes over two tokens
    stream = StreamDecoder(smollm2)
    assert stream.push(smollm2.encode("Hi")) == "Hi"
    pieces = [stream.push(i) for i in ids]
    assert pieces[:-1] == [""] * (len(ids) - 1) or "".join(pieces[:-1]) == " "
    assert "".join(pieces) == " 😀"
    assert stream.flush() == ""


def test_word_appears_as_soon_as_its_token_does(smollm2):
    stream = StreamDecoder(smollm2)
    assert [stream.push(i) for i in smollm2.encode("Hello world")] == ["Hello", " world"]


def test_decode_window_stays_small(smollm2):
    """Cheap per token: each push decodes a few trailing tokens, not the history."""
    lengths = []

    class Counting:
        def __getattr__(self, name):
            return getattr(smollm2, name)

        def decode(self, ids, **kwargs):
            lengths.append(len(ids))
            return smollm2.decode(ids, **kwargs)

    ids = smollm2.encode(" ".join(STREAM_TEXTS) * 4)
    assert len(ids) > 800
    _check_stream(Counting(), ids, seeds=[0])
    assert max(lengths[1:]) <= 8  # the first call is the reference full decode


def test_invalid_bytes_are_released_by_flush():
    tok = ByteTokenizer()
    stream = StreamDecoder(tok)
    assert stream.push(0xFF) == ""  # could be an unfinished character: held back
    assert stream.push(ord("a")) == "\ufffda"
    assert stream.push([0xF0, 0x9F]) == ""
    assert stream.flush() == "\ufffd"
    assert stream.push([0x98, 0x80]) == ""  # lone continuation bytes after a flush


def test_byte_tokenizer_stream():
    tok = ByteTokenizer()
    for text in STREAM_TEXTS:
        _check_stream(tok, tok.encode(text, add_bos=True, add_eos=True))


def test_sentencepiece_stream_keeps_inner_spaces(tmp_path):
    """SentencePiece decoders strip the text's first space: the window must not lose inner ones."""
    pieces = learn_sentencepiece_bpe(["hello world and the other world"] * 3, n_merges=20)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    path = write_vocab_gguf(
        tmp_path / "spm.gguf",
        model="llama",
        tokens=tokens,
        scores=[0.0] * 259 + [-float(r) for r in range(len(pieces))],
        token_type=[2, 3, 3, *[6] * 256, *[1] * len(pieces)],
        bos_token_id=1,
        eos_token_id=2,
        unknown_token_id=0,
    )
    tok = load_tokenizer(path)
    for text in ["hello world and the other world", "  two  spaces 😀 ünï", "a </s> b"]:
        ids = tok.encode(text, add_bos=True)
        _check_stream(tok, ids)
        _check_stream(tok, ids, skip_special_tokens=False)
    # Random pieces, but no byte pieces: tokenizers decodes a run of byte pieces together and
    # turns all of it into U+FFFD when any byte is invalid, so a character already emitted from
    # the run's valid start could not be taken back (valid UTF-8 never does this).
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.choice([0, 1, 2, *range(259, tok.vocab_size)]) for _ in range(30)]
        _check_prefixes(tok, ids)
        _check_prefixes(tok, ids, skip_special_tokens=False)
