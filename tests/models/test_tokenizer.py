import json

import pytest
import tokenizers
from tokenizer_utils import TEXTS, hf_gguf_tokenizer

from models import ByteTokenizer
from models.tokenizer import HFTokenizer, Tokenizer, load_tokenizer


@pytest.mark.parametrize("text", ["", "def f(x):\n    return x\n", "héllo wörld ✓ 𝔘𝔫𝔦", "\x00\t"])
def test_round_trip_is_lossless(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_special_ids_are_distinct_and_dropped_by_decode():
    tok = ByteTokenizer()
    assert len({tok.bos_id, tok.eos_id, tok.pad_id}) == 3
    assert min(tok.bos_id, tok.eos_id, tok.pad_id) >= 256
    assert tok.special_ids == {tok.bos_id, tok.eos_id, tok.pad_id}
    ids = tok.encode("ab", add_bos=True, add_eos=True)
    assert ids == [tok.bos_id, 97, 98, tok.eos_id]
    assert tok.decode(ids + [tok.pad_id]) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>ab<eos>"


def test_cut_multibyte_character_decodes_with_replacement():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"


def test_encode_rejects_bytes():
    with pytest.raises(TypeError, match="text"):
        ByteTokenizer().encode(b"abc")


def test_byte_tokenizer_has_no_chat_template():
    tok = ByteTokenizer()
    assert tok.chat_template is None and tok.add_bos is True
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_both_kinds_satisfy_the_protocol(tmp_path):
    assert isinstance(ByteTokenizer(), Tokenizer)
    assert isinstance(load_tokenizer(_tiny_dir(tmp_path)), Tokenizer)


# --- a directory with tokenizer.json ---------------------------------------------------------

_WORDS = ["<s>", "</s>", "<pad>", "<unk>", "hello", "world", "!", "<|user|>"]


def _tiny_dir(tmp_path, config=None, bos_post_processor=False):
    """A word-level tokenizer.json (+ tokenizer_config.json when ``config`` is given)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(_WORDS)}, unk_token="<unk>")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.add_special_tokens(["<s>", "</s>", "<pad>", "<|user|>"])
    if bos_post_processor:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 0)]
        )
    tok.save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_directory_reads_config(tmp_path):
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "pad_token": "<pad>",
        "add_bos_token": True,
        "chat_template": "{% for m in messages %}<|user|> {{ m['content'] }}{% endfor %}",
    }
    tok = load_tokenizer(_tiny_dir(tmp_path, config))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (0, 1, 2, True)
    assert tok.vocab_size == len(_WORDS)
    assert tok.special_ids == {0, 1, 2, 7}
    assert tok.encode("hello world !") == [4, 5, 6]
    assert tok.encode("hello", add_bos=True, add_eos=True) == [0, 4, 1]
    assert tok.encode("<|user|> hello") == [7, 4]
    assert tok.decode([0, 4, 5, 1]) == "hello world"
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == [7, 4]


def test_directory_chat_template_jinja_file_wins(tmp_path):
    directory = _tiny_dir(tmp_path, {"chat_template": "old"})
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = load_tokenizer(directory)
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False) == (
        "hello!"
    )


def test_directory_add_bos_from_post_processor(tmp_path):
    tok = load_tokenizer(_tiny_dir(tmp_path, {"bos_token": "<s>"}, bos_post_processor=True))
    assert tok.add_bos is True
    assert tok.encode("hello") == [4]  # the text alone: the post-processor's BOS is not added
    plain = load_tokenizer(_tiny_dir(tmp_path / "plain", {"bos_token": "<s>"}))
    assert plain.add_bos is False
    bare = load_tokenizer(_tiny_dir(tmp_path / "bare"))
    assert (bare.bos_id, bare.chat_template, bare.add_bos) == (None, None, False)
    with pytest.raises(ValueError, match="no bos token"):
        bare.encode("hello", add_bos=True)


def test_directory_saved_by_transformers_matches(smollm2_gguf, tmp_path):
    hf = hf_gguf_tokenizer(str(smollm2_gguf))
    hf.save_pretrained(tmp_path / "saved")
    tok = load_tokenizer(tmp_path / "saved")
    gguf_tok = load_tokenizer(smollm2_gguf)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        hf.bos_token_id,
        hf.eos_token_id,
        hf.pad_token_id,
    )
    assert tok.vocab_size == gguf_tok.vocab_size == len(hf)
    assert tok.chat_template == gguf_tok.chat_template
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), text
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == gguf_tok.apply_chat_template(messages)


# --- bad input -------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")


def test_directory_without_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_tokenizer_json_file_instead_of_directory(tmp_path):
    path = _tiny_dir(tmp_path) / "tokenizer.json"
    with pytest.raises(ValueError, match="directory"):
        load_tokenizer(path)


def test_malformed_files(tmp_path):
    directory = _tiny_dir(tmp_path)
    (directory / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        load_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(ValueError, match="chat_template"):
        load_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": 3}))
    with pytest.raises(ValueError, match="bos_token"):
        load_tokenizer(directory)
    (directory / "tokenizer_config.json").unlink()
    (directory / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(directory)


def test_non_str_text_and_no_template(tmp_path):
    tok = load_tokenizer(_tiny_dir(tmp_path))
    with pytest.raises(TypeError, match="text must be a str"):
        tok.encode(["hello"])
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
