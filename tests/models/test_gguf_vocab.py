"""GGUF vocabularies against transformers' GGUF tokenizer loader: SmolLM2's real file, its
vocabulary under other pre-tokenizers, and a SentencePiece vocabulary learned here."""

import gguf
import numpy as np
import pytest
from tokenizer_utils import TEXTS, hf_gguf_tokenizer, learn_sentencepiece_bpe, write_vocab_gguf

from models.gguf_metadata import read_gguf_metadata
from models.tokenizer import load_tokenizer

K = "tokenizer.ggml."


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_tokenizer(smollm2_gguf), hf_gguf_tokenizer(str(smollm2_gguf))


def test_smollm2_ids_match_transformers(smollm2):
    tok, hf = smollm2
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text  # byte-level BPE is lossless
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


def test_smollm2_special_tokens_and_attributes(smollm2):
    tok, hf = smollm2
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
    assert (tok.vocab_size, tok.add_bos) == (49152, False)
    assert set(hf.all_special_ids) <= tok.special_ids
    assert tok.special_ids == set(range(17))  # the file's CONTROL tokens
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.encode("hi", add_bos=True, add_eos=True) == [1, *tok.encode("hi"), 2]
    assert tok.chat_template.startswith("{% for message in messages %}")


def test_smollm2_splits_digits_individually(smollm2):
    tok, _ = smollm2
    assert len(tok.encode("12345678901234567890")) == 20
    assert tok.decode(tok.encode(" 2024")) == " 2024"


def test_metadata_reader_matches_gguf_reader(smollm2_gguf, tmp_path):
    path = write_vocab_gguf(
        tmp_path / "small.gguf",
        model="gpt2",
        pre="smollm",
        tokens=["a", "b", "ab", "é"],
        token_type=[1, 1, 1, 4],
        merges=["a b"],
        bos_token_id=0,
        add_bos_token=False,
        chat_template="{{ x }}",
    )
    ours = read_gguf_metadata(path)
    fields = gguf.GGUFReader(path).fields
    keys = [k for k in fields if not k.startswith("GGUF.")]
    assert sorted(keys) == sorted(ours)
    for key in keys:
        expected = fields[key].contents()
        assert (
            np.array_equal(ours[key], expected)
            if isinstance(expected, list)
            else (ours[key] == expected and type(ours[key]) is type(expected))
        ), key


@pytest.fixture(scope="module")
def smollm2_metadata(smollm2_gguf):
    return read_gguf_metadata(smollm2_gguf)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_pre_tokenizers_match_transformers(pre, smollm2_metadata, tmp_path):
    """SmolLM2's vocabulary and merges under another pre-tokenizer's splits."""
    m = smollm2_metadata
    path = write_vocab_gguf(
        tmp_path / f"{pre}.gguf",
        model="gpt2",
        pre=pre,
        tokens=m[K + "tokens"],
        token_type=m[K + "token_type"].tolist(),
        merges=m[K + "merges"],
        bos_token_id=1,
        eos_token_id=2,
    )
    tok, hf = load_tokenizer(path), hf_gguf_tokenizer(str(path))
    for text in [*TEXTS, "x = 1234567\n\n  y", "it'S\r\n\r\nok"]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), (pre, text)
    assert tok.add_bos is (pre == "llama-bpe")  # llama.cpp's default when the file is silent


def _tiny_byte_level(tmp_path, pre):
    alphabet = [chr(c) for c in range(ord("0"), ord("9") + 1)] + ["Ġ"]
    return write_vocab_gguf(
        tmp_path / f"{pre}.gguf",
        model="gpt2",
        pre=pre,
        tokens=[*alphabet, "12", "Ġ1"],
        merges=["1 2", "Ġ 1"],
    )


def test_smollm_and_gpt2_pre_tokenizers_differ_on_digits(tmp_path):
    digits = load_tokenizer(_tiny_byte_level(tmp_path, "smollm"))
    runs = load_tokenizer(_tiny_byte_level(tmp_path, "gpt-2"))
    assert digits.encode(" 12") == [10, 1, 2]
    assert runs.encode(" 12") == [10, 11]  # one pre-token " 12": the merge "1 2" ranks first


@pytest.fixture(scope="module")
def sentencepiece_gguf(tmp_path_factory):
    """A SentencePiece ('llama') vocabulary: <unk>/<s>/</s>, 256 byte-fallback pieces, a control
    and a user-defined token, then pieces learned by BPE on a small corpus (score = -rank)."""
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "hello world, hello there: the theory of the thing",
        "unbelievable unbreakable undeniable 12 123",
    ]
    pieces = learn_sentencepiece_bpe(corpus * 3, n_merges=60)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<|user|>", "<tool>"]
    types = [2, 3, 3, *[6] * 256, 3, 4]
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    path = write_vocab_gguf(
        tmp_path_factory.mktemp("spm") / "spm.gguf",
        model="llama",
        tokens=tokens,
        scores=scores,
        token_type=types,
        bos_token_id=1,
        eos_token_id=2,
        unknown_token_id=0,
        add_space_prefix=True,
        chat_template="{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
        "{{ eos_token }}{% endfor %}",
    )
    return path


def test_sentencepiece_matches_transformers(sentencepiece_gguf):
    tok, hf = load_tokenizer(sentencepiece_gguf), hf_gguf_tokenizer(str(sentencepiece_gguf))
    texts = [*TEXTS, "the theory hello", " the  quick\n", "<s>hi</s><|user|>x<tool>y"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids), text
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (1, 2, None, True)
    assert tok.special_ids == {0, 1, 2, 259}  # UNKNOWN and CONTROL; <tool> is user-defined
    messages = [{"role": "user", "content": "hello"}]
    assert tok.apply_chat_template(messages, tokenize=False) == "<s>[user] hello</s>"


def test_sentencepiece_pieces_bytes_and_round_trip(sentencepiece_gguf):
    tok = load_tokenizer(sentencepiece_gguf)
    assert len(tok.encode("the theory")) == 2  # learned pieces "▁the", "▁theory"
    ids = tok.encode("Ω")  # not in the vocabulary: its two UTF-8 bytes
    assert [i - 3 for i in ids[-2:]] == list("Ω".encode())
    for text in ["hello world", "naïve 😀 日本", "a\n\tb"]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("hi<tool>x")) == "hi<tool>x"


def test_token_bytes_join_to_the_text(smollm2, sentencepiece_gguf):
    """``Tokenizer.token_bytes`` (the server's logprob ``bytes``): each piece's bytes, partial
    characters included, join to the encoded text's UTF-8 (SentencePiece: after the space it
    prefixes); special and added tokens are their content."""
    tok, _ = smollm2
    spm = load_tokenizer(sentencepiece_gguf)
    for text in ["hello world", "naïve 😀 日本", "a\n\tb  c"]:
        assert b"".join(tok.token_bytes(i) for i in tok.encode(text)) == text.encode()
        assert b"".join(spm.token_bytes(i) for i in spm.encode(text)) == f" {text}".encode()
    pieces = [tok.token_bytes(i) for i in tok.encode("😀")]  # byte-level pieces of one character
    assert len(pieces) > 1 and b"".join(pieces) == "😀".encode()
    assert spm.token_bytes(spm.encode("Ω")[-1]) == "Ω".encode()[-1:]  # a byte-fallback piece
    assert spm.token_bytes(2) == b"</s>" and tok.token_bytes(2) == b"<|im_end|>"
    assert tok.token_bytes(10**9) == b""


# --- bad input -------------------------------------------------------------------------------


def _keys(**overrides):
    keys = dict(model="gpt2", pre="smollm", tokens=["a", "b", "ab"], merges=["a b"])
    return {**keys, **overrides}


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(model="bert"), "unsupported tokenizer.ggml.model 'bert'"),
        (dict(model=None), "no tokenizer.ggml.model"),
        (dict(pre="made-up"), "unsupported tokenizer.ggml.pre 'made-up'"),
        (dict(bos_token_id=7), "tokenizer.ggml.bos_token_id is 7"),
        (dict(merges=["a b c"]), "tokenizer.ggml.merges"),
        (dict(token_type=[1, 1]), "tokenizer.ggml.token_type"),
        (dict(model="llama", merges=None), "tokenizer.ggml.scores"),
    ],
)
def test_malformed_metadata(overrides, match, tmp_path):
    path = write_vocab_gguf(tmp_path / "bad.gguf", **_keys(**overrides))
    with pytest.raises(ValueError, match=match) as info:
        load_tokenizer(path)
    assert str(path) in str(info.value)


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_tokenizer(tmp_path / "junk.gguf")
    good = write_vocab_gguf(tmp_path / "good.gguf", **_keys())
    (tmp_path / "cut.gguf").write_bytes(good.read_bytes()[:60])
    with pytest.raises(ValueError, match="truncated"):
        load_tokenizer(tmp_path / "cut.gguf")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_tokenizer(tmp_path / "missing.gguf")
