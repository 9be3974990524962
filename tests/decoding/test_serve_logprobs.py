"""Log-probabilities through the server, with the ``openai`` client on a free loopback port:
chat (``logprobs``/``top_logprobs``) on a tiny random model over SmolLM2's tokenizer and chat
template (byte-level BPE pieces, partial characters included), completions (``logprobs: n``)
on the byte-level code model. Values equal ``log_softmax`` of a forward pass over the greedy
tokens; streamed chunks carry the same records as the whole response; bad values get 400 with
OpenAI's error object.
"""

from __future__ import annotations

import functools

import httpx
import jax
import numpy as np
import openai
import pytest
from conftest import random_transformer
from flax import nnx

import models
from decoding import Engine
from decoding.chat import encode_prompt, turn_end_id
from decoding.serve.local import running_server

CHAT = "tiny-chat"
CODE = "code-target"
SEQ = 128
QUESTION = [{"role": "user", "content": "Name a colour."}]
TOL = 1e-5


@pytest.fixture(scope="module")
def chat_setup(smollm2_gguf):
    """A tiny random model over SmolLM2's vocabulary, its tokenizer, and a server of it."""
    tok = models.load_tokenizer(smollm2_gguf)
    model = random_transformer(1, scale=0.1, vocab_size=tok.vocab_size, max_position=SEQ)
    with running_server(make_engine(model), tok, model_name=CHAT) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        yield model, tok, url, client


@pytest.fixture(scope="module")
def code_setup():
    model, tok = models.pretrained(CODE)
    with running_server(make_engine(model), tok, model_name=CODE) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        yield model, tok, url, client


def make_engine(model) -> Engine:
    return Engine(model, max_batch=2, num_pages=32, page_size=16, max_seq_len=SEQ)


def reference(model, prompt: list[int], n: int, eos_id) -> tuple[list[int], np.ndarray]:
    """Greedy tokens of ``prompt`` and the log-softmax [n, V] of a full forward pass at the
    positions that predicted them. The tokens come from an engine like the server's (its steps
    are compiled already); the checks below make them the forward pass's argmax chain."""
    eng = make_engine(model)
    rid = eng.submit(prompt, n, eos_id=eos_id)
    out = eng.run_until_done()[rid]
    lp = np.asarray(_log_softmax(*nnx.split(model), np.asarray([prompt + out], np.int32)))[0]
    return out, lp[len(prompt) - 1 : len(prompt) - 1 + len(out)]


@functools.partial(jax.jit, static_argnums=0)
def _log_softmax(graphdef, params, tokens):
    logits = nnx.merge(graphdef, params)(tokens)
    return jax.nn.log_softmax(logits.astype(np.float32), axis=-1)


def assert_same_records(got, want) -> None:
    """Chat logprob entries: the same tokens and alternatives, log-probabilities within TOL."""

    def flat(entries):
        return [[e.logprob, *(t.logprob for t in e.top_logprobs)] for e in entries]

    def names(entries):
        return [(e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs]) for e in entries]

    assert names(got) == names(want)
    np.testing.assert_allclose(flat(got), flat(want), atol=TOL)


def test_chat_logprobs_equal_forward_pass_streamed_and_not(chat_setup):
    model, tok, _, client = chat_setup
    kw = dict(model=CHAT, messages=QUESTION, max_tokens=12, temperature=0)
    out = client.chat.completions.create(logprobs=True, top_logprobs=4, **kw)
    choice = out.choices[0]
    content = choice.logprobs.content
    prompt = tok.apply_chat_template(QUESTION)
    ids, ref = reference(model, prompt, 12, turn_end_id(tok))
    kept = [t for t in ids if t != turn_end_id(tok)]  # the end-of-turn token has no text
    assert len(content) == len(kept) and choice.message.content == tok.decode(ids)
    assert b"".join(bytes(e.bytes) for e in content) == choice.message.content.encode()
    for e, token, row in zip(content, kept, ref, strict=False):
        assert bytes(e.bytes) == tok.token_bytes(token)
        assert e.token == tok.token_bytes(token).decode("utf-8", "backslashreplace")
        assert abs(e.logprob - row[token]) < TOL
        assert len(e.top_logprobs) == 4 and e.top_logprobs[0].logprob == e.logprob  # greedy
        want = np.argsort(-row, kind="stable")[:4]
        assert [bytes(t.bytes) for t in e.top_logprobs] == [tok.token_bytes(i) for i in want]
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], row[want], atol=TOL)
        assert sum(np.exp(t.logprob) for t in e.top_logprobs) <= 1 + 1e-6
    chunks = list(client.chat.completions.create(logprobs=True, top_logprobs=4, stream=True, **kw))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    # The same tokens; values within rounding (the second request's prompt comes from the prefix
    # cache, so its last page is prefilled in a shorter chunk).
    assert_same_records(streamed, content)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    # Not asked (or logprobs false): none.
    assert client.chat.completions.create(**kw).choices[0].logprobs is None
    assert client.chat.completions.create(logprobs=False, **kw).choices[0].logprobs is None
    zero = client.chat.completions.create(logprobs=True, **kw).choices[0].logprobs.content
    np.testing.assert_allclose([e.logprob for e in zero], [e.logprob for e in content], atol=TOL)
    assert all(e.top_logprobs == [] for e in zero)


def test_completion_logprobs_streamed_and_not(code_setup):
    model, tok, _, client = code_setup
    prompt = "def add(a, b):"
    kw = dict(model=CODE, prompt=prompt, max_tokens=16, temperature=0, logprobs=3)
    choice = client.completions.create(**kw).choices[0]
    lp = choice.logprobs
    ids, eos = encode_prompt(prompt, tok, model.config)
    out, ref = reference(model, ids, 16, eos)
    kept = [t for t in out if t != eos]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(kept)
    # The trained code model's logits are larger than the random models': the paged steps and
    # the full forward pass round them differently by about 1e-5 relative, so the bound is too.
    close = dict(rtol=TOL, atol=TOL)
    text = choice.text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for j, (token, row) in enumerate(zip(kept, ref, strict=False)):
        piece = tok.token_bytes(token).decode("utf-8", "backslashreplace")
        assert lp.tokens[j] == piece
        if token < 128:  # one character: it sits at its offset in the text
            assert text[lp.text_offset[j]] == piece
        np.testing.assert_allclose(lp.token_logprobs[j], row[token], **close)
        top = lp.top_logprobs[j]  # the 3 most likely, the chosen (greedy: the first) among them
        assert len(top) == 3 and top[piece] == lp.token_logprobs[j] == max(top.values())
        want = np.argsort(-row, kind="stable")[:3]
        np.testing.assert_allclose(sorted(top.values(), reverse=True), row[want], **close)
    chunks = list(client.completions.create(stream=True, **kw))
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    streamed = [t for p in parts for t in p.token_logprobs]
    np.testing.assert_allclose(streamed, lp.token_logprobs, **close)
    tops = [t for p in parts for t in p.top_logprobs]
    assert [sorted(t) for t in tops] == [sorted(t) for t in lp.top_logprobs]
    for got, want in zip(tops, lp.top_logprobs, strict=True):
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), **close)
    assert [t for p in parts for t in p.text_offset] == lp.text_offset
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text


def test_stop_string_cuts_the_records(code_setup):
    """The records end at the token that completed the stop string."""
    model, tok, _, client = code_setup
    prompt = "import os\n"
    full = client.completions.create(model=CODE, prompt=prompt, max_tokens=24, temperature=0)
    stop = full.choices[0].text[5:7]
    choice = client.completions.create(
        model=CODE, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], logprobs=0
    ).choices[0]
    assert choice.finish_reason == "stop"
    text = full.choices[0].text
    cut = text.index(stop) + len(stop)  # the stop string's last character ends the records
    assert "".join(choice.logprobs.tokens) == text[:cut]
    assert all(
        top == {t: lp}
        for top, t, lp in zip(
            choice.logprobs.top_logprobs,
            choice.logprobs.tokens,
            choice.logprobs.token_logprobs,
            strict=True,
        )
    )


BAD_CHAT = [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
]
BAD_COMPLETION = [
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"logprobs": 1.5}, "logprobs"),
]


def test_bad_logprobs_values_get_400(chat_setup, code_setup):
    with httpx.Client(timeout=30) as http:
        cases = [(chat_setup[2], "chat/completions", CHAT, b, p) for b, p in BAD_CHAT]
        cases += [(code_setup[2], "completions", CODE, b, p) for b, p in BAD_COMPLETION]
        for url, route, name, extra, param in cases:
            body = dict(model=name, max_tokens=2, **extra)
            body.update(messages=QUESTION) if route.startswith("chat") else body.update(prompt="x")
            r = http.post(f"{url}/v1/{route}", json=body)
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["param"] == param and err["type"] == "invalid_request_error", (extra, err)
    with pytest.raises(openai.BadRequestError) as e:
        chat_setup[3].chat.completions.create(
            model=CHAT, messages=QUESTION, max_tokens=2, top_logprobs=3
        )
    assert e.value.param == "top_logprobs"
