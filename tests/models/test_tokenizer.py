import pytest

from models import ByteTokenizer


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
    ids = tok.encode("ab", add_bos=True, add_eos=True)
    assert ids == [tok.bos_id, 97, 98, tok.eos_id]
    assert tok.decode(ids + [tok.pad_id]) == "ab"


def test_cut_multibyte_character_decodes_with_replacement():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"


def test_encode_rejects_bytes():
    with pytest.raises(TypeError, match="text"):
        ByteTokenizer().encode(b"abc")
