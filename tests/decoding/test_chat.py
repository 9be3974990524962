"""Streaming through the engine and multi-turn chat on SmolLM2."""

from __future__ import annotations

import pytest

import models
from decoding import Engine, generate
from decoding.chat import ChatSession, stream, turn_end_id


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return models.pretrained("smollm2-135m-instruct")


def _engine(model):
    return Engine(model, max_batch=2, num_pages=48, page_size=16, max_seq_len=512)


def test_turn_end_is_im_end(smollm2):
    _, tok = smollm2
    assert turn_end_id(tok) == tok.encode("<|im_end|>")[0] == 2
    assert turn_end_id(models.ByteTokenizer()) == models.ByteTokenizer.eos_id  # no template


def test_stream_matches_generate_and_decodes_in_pieces(smollm2):
    model, tok = smollm2
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}])
    want = generate(model, [ids], max_new_tokens=40, eos_id=2).tokens[0]
    engine, stats, out = _engine(model), {}, []
    pieces = list(stream(engine, tok, ids, max_new_tokens=40, stop_id=2, stats=stats, out_ids=out))
    assert out == want and "".join(pieces) == tok.decode(want)
    assert len(pieces) > 5  # streamed, not one block
    assert stats["new_tokens"] == len(want) and stats["prompt_tokens"] == len(ids)
    assert engine.allocator.num_available == engine.allocator.num_pages  # nothing left held


def test_closing_a_stream_early_aborts_its_request(smollm2):
    model, tok = smollm2
    engine = _engine(model)
    gen = stream(engine, tok, tok.encode("Once upon a time"), max_new_tokens=200)
    next(gen)
    gen.close()
    assert not engine.busy
    assert engine.allocator.num_available == engine.allocator.num_pages


def test_chat_session_keeps_the_conversation(smollm2):
    model, tok = smollm2
    session = ChatSession(_engine(model), tok, max_new_tokens=32)
    first = "".join(session.send("What is the capital of France?"))
    assert "Paris" in first
    "".join(session.send("And of Italy?"))
    assert [m["role"] for m in session.messages] == ["user", "assistant", "user", "assistant"]
    # The second prompt is the first conversation's tokens, exactly, then the new turn.
    text = tok.apply_chat_template(session.messages[:3], tokenize=False)
    assert tok.decode(session._ids, skip_special_tokens=False).startswith(text)
    assert session.stats["prefilled_tokens"] < session.stats["prompt_tokens"] // 2
    session.reset()
    assert session.messages == []


def test_chat_session_needs_a_template(smollm2):
    model, _ = smollm2
    with pytest.raises(ValueError, match="chat template"):
        ChatSession(_engine(model), models.ByteTokenizer())
