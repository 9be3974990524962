"""The OpenAI-compatible server, through the official ``openai`` client and raw HTTP, on a free
loopback port: completions on the byte-level code model (fast), chat on SmolLM2 (the template)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

import models
from decoding import Engine, generate
from decoding.chat import encode_prompt
from decoding.sampling import SamplingConfig
from decoding.serve.local import running_server
from decoding.serve.text import ChoiceText

CODE = "code-target"
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(10):"]
WAIT_S = 30.0  # bound on every poll loop


@pytest.fixture(scope="module")
def code_model():
    return models.pretrained(CODE)


@pytest.fixture(scope="module")
def code_server(code_model):
    model, tok = code_model
    engine = Engine(model, max_batch=8, num_pages=160, page_size=16, max_seq_len=256)
    with running_server(engine, tok, model_name=CODE, max_queue=64) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(code_server):
    return openai.OpenAI(base_url=f"{code_server[0]}/v1", api_key="none", timeout=60, max_retries=0)


def _ids(code_model, prompt: str) -> tuple[list[int], int]:
    model, tok = code_model
    return encode_prompt(prompt, tok, model.config)


def _generated(code_model, prompt: str, n: int) -> list[int]:
    model, _ = code_model
    ids, eos = _ids(code_model, prompt)
    return generate(model, [ids], max_new_tokens=n, eos_id=eos).tokens[0]


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"decoding_serve_{name} ") or line.startswith(
            f"decoding_serve_{name}{{"
        ):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _wait_idle(url: str) -> None:
    """Polls /metrics (bounded) until no request runs or waits and no page is held."""
    deadline = time.monotonic() + WAIT_S
    names = ("requests_running", "requests_waiting", "kv_pages_used")
    while any(_metric(url, n) for n in names):
        assert time.monotonic() < deadline, {n: _metric(url, n) for n in names}
        time.sleep(0.05)


# --------------------------------------------------------------------------------- stop strings


def test_choice_text_cuts_stop_strings_across_tokens():
    tok = models.ByteTokenizer()
    text = ChoiceText(tok, ["END", "xyz"])
    pieces = [text.push(tok.encode(c)) for c in "abcEN"]
    assert "".join(pieces) == "abc"  # "EN" is held back: it may begin "END"
    assert text.push(tok.encode("D and more")) == "" and text.stopped
    assert text.text == "abc" and text.flush() == ""
    text = ChoiceText(tok, ["END"])
    assert "".join(text.push(tok.encode(c)) for c in "xENx") + text.flush() == "xENx"
    # A multi-byte character split over tokens is emitted whole; the earliest stop wins.
    text = ChoiceText(tok, ["zz", "é!"])
    b = "aé!zz".encode()
    assert "".join(text.push([i]) for i in b) == "a" and text.text == "a"


# --------------------------------------------------------------------------------- completions


def test_completion_streamed_equals_unstreamed_equals_generate(client, code_model):
    _, tok = code_model
    prompt, n = PROMPTS[0], 24
    want = tok.decode(_generated(code_model, prompt, n))
    out = client.completions.create(model=CODE, prompt=prompt, max_tokens=n, temperature=0)
    assert out.choices[0].text == want and out.choices[0].finish_reason == "length"
    ids, _ = _ids(code_model, prompt)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == n
    assert out.usage.total_tokens == len(ids) + n
    chunks = list(
        client.completions.create(
            model=CODE,
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert len(chunks) > 5  # streamed in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    # Token ids as the prompt: the same continuation.
    out = client.completions.create(model=CODE, prompt=ids, max_tokens=n, temperature=0)
    assert out.choices[0].text == want


def test_completion_stop_strings(client, code_model):
    _, tok = code_model
    full = tok.decode(_generated(code_model, PROMPTS[0], 40))
    stop = full[8:11]  # three tokens of the byte-level model: matched across boundaries
    want = full[: full.index(stop)]
    for stream in (False, True):
        kw = dict(model=CODE, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop, "@@"])
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            out = client.completions.create(**kw).choices[0]
            text, reason = out.text, out.finish_reason
        assert text == want and reason == "stop"


def test_n_choices_and_seed_reproducibility(client, code_server, code_model):
    _, tok = code_model
    kw = dict(model=CODE, prompt=PROMPTS[1], max_tokens=16, temperature=1.0, n=3)
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    c = client.completions.create(seed=8, **kw)
    assert [x.index for x in a.choices] == [0, 1, 2]
    texts = [x.text for x in a.choices]
    assert texts == [x.text for x in b.choices] != [x.text for x in c.choices]
    assert len(set(texts)) > 1  # each choice draws with its own key
    assert a.usage.completion_tokens == 3 * 16
    # Several prompts: len(prompts) * n choices, prompt i's at indices i * n ...
    prompts = [PROMPTS[0], PROMPTS[2]]
    out = client.completions.create(model=CODE, prompt=prompts, max_tokens=8, temperature=0, n=2)
    assert [x.index for x in out.choices] == [0, 1, 2, 3]
    want = [tok.decode(_generated(code_model, p, 8)) for p in prompts for _ in range(2)]
    assert [x.text for x in out.choices] == want
    _wait_idle(code_server[0])


def test_32_concurrent_streaming_clients(code_server, code_model):
    url, _ = code_server
    model, tok = code_model
    prompts = [f"{PROMPTS[i % 4]} # {i}" for i in range(32)]
    n = 12
    encoded = [_ids(code_model, p)[0] for p in prompts]
    want = [tok.decode(t) for t in generate(model, encoded, max_new_tokens=n).tokens]

    async def one(aclient, prompt):
        stream = await aclient.completions.create(
            model=CODE, prompt=prompt, max_tokens=n, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=120)
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(one(aclient, p) for p in prompts)), timeout=120
            )
        finally:
            await aclient.close()

    assert asyncio.run(main()) == want
    _wait_idle(url)


def test_disconnect_mid_stream_frees_pages(code_server):
    url, _ = code_server
    body = dict(model=CODE, prompt=PROMPTS[2], max_tokens=200, temperature=0, stream=True)
    before = _metric(url, "generation_tokens_total")
    aborted = _metric(url, "requests_aborted")
    with httpx.Client(timeout=30) as http:
        for _ in range(3):
            with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]
                assert any(line.startswith("data: {") for line in got)
        # A non-streaming client that gives up (its read times out) is noticed too.
        with pytest.raises(httpx.ReadTimeout):
            slow = {**body, "stream": False, "max_tokens": 230, "n": 4}  # >= 230 steps
            http.post(f"{url}/v1/completions", json=slow, timeout=0.2)
    _wait_idle(url)
    # Aborted long before their 200 tokens each.
    assert _metric(url, "generation_tokens_total") - before < 3 * 200 + 4 * 230
    assert _metric(url, "requests_aborted") - aborted >= 3


def test_models_health_and_metrics(client, code_server):
    url, _ = code_server
    models_ = client.models.list()
    assert [m.id for m in models_.data] == [CODE]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    client.completions.create(model=CODE, prompt="x = ", max_tokens=3, temperature=0)
    text = httpx.get(f"{url}/metrics").text
    for name in (
        "requests_running",
        "requests_waiting",
        "kv_pages_used",
        "kv_pages_free",
        "prefix_cache_hit_pages",
        "preemptions",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_count",
        "inter_token_latency_seconds_count",
    ):
        assert f"decoding_serve_{name}" in text, name
    assert _metric(url, "time_to_first_token_seconds_count") >= 1
    assert _metric(url, "inter_token_latency_seconds_count") >= 2


# --------------------------------------------------------------------------------- bad requests

BAD = [
    ('{"model": ', None),
    ("[1, 2]", None),
    ('{"prompt": "x"}', "model"),
    ('{"model": "code-target", "prompt": "x", "temperature": "hot"}', "temperature"),
    ('{"model": "code-target", "prompt": "x", "temperature": 2.5}', "temperature"),
    ('{"model": "code-target", "prompt": "x", "top_p": 0}', "top_p"),
    ('{"model": "code-target", "prompt": "x", "top_k": -2}', "top_k"),
    ('{"model": "code-target", "prompt": "x", "min_p": 1.5}', "min_p"),
    ('{"model": "code-target", "prompt": "x", "n": 0}', "n"),
    ('{"model": "code-target", "prompt": "x", "max_tokens": 0}', "max_tokens"),
    ('{"model": "code-target", "prompt": "x", "max_tokens": 1.5}', "max_tokens"),
    ('{"model": "code-target", "prompt": "x", "max_tokens": 100000}', "max_tokens"),
    ('{"model": "code-target", "prompt": "x", "stop": [""]}', "stop"),
    ('{"model": "code-target", "prompt": "x", "stop": 3}', "stop"),
    ('{"model": "code-target", "prompt": "x", "stream": "yes"}', "stream"),
    ('{"model": "code-target", "prompt": "x", "seed": "1"}', "seed"),
    ('{"model": "code-target", "prompt": "x", "logprobs": -1}', "logprobs"),
    ('{"model": "code-target", "prompt": "x", "presence_penalty": 1.0}', "presence_penalty"),
    ('{"model": "code-target", "prompt": ""}', "prompt"),
    ('{"model": "code-target", "prompt": [1, 99999]}', "prompt"),
    ('{"model": "code-target", "prompt": 5}', "prompt"),
    ('{"model": "code-target", "prompt": "' + "x" * 300 + '"}', "prompt"),
    ('{"model": "gpt-4o", "prompt": "x"}', "model"),
]


def test_bad_requests_get_400_naming_the_field(code_server):
    url, _ = code_server
    with httpx.Client(timeout=30) as http:
        for body, param in BAD:
            r = http.post(
                f"{url}/v1/completions", content=body, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, body
            assert err["param"] == param and err["type"] == "invalid_request_error", (body, err)
        # The code model has no chat template.
        r = http.post(
            f"{url}/v1/chat/completions",
            json={"model": CODE, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = http.post(f"{url}/v1/chat/completions", json={"model": CODE, "messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert http.get(f"{url}/v1/nothing").status_code == 404
        assert "error" in http.get(f"{url}/v1/nothing").json()


def test_openai_client_raises_for_bad_requests(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert e.value.param == "model" and e.value.code == "model_not_found"


def test_full_queue_429_leaves_other_requests_alone(client, code_server, code_model):
    _, tok = code_model
    url, _ = code_server
    want = tok.decode(_generated(code_model, PROMPTS[3], 30))

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            good = asyncio.ensure_future(
                http.post(
                    "/v1/completions",
                    json=dict(model=CODE, prompt=PROMPTS[3], max_tokens=30, temperature=0),
                )
            )
            # 5 prompts x 16 choices > the queue's 64: refused whole, before anything runs.
            big = dict(model=CODE, prompt=["a"] * 5, n=16, max_tokens=2)
            bad = await http.post("/v1/completions", json=big)
            return await asyncio.wait_for(good, 60), bad

    good, bad = asyncio.run(main())
    assert bad.status_code == 429 and bad.json()["error"]["code"] == "rate_limit_exceeded"
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == want
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=CODE, prompt=["a"] * 5, n=16, max_tokens=2)
    _wait_idle(url)


# --------------------------------------------------------------------------------- chat (SmolLM2)


CHAT = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return models.pretrained(CHAT)


@pytest.fixture(scope="module")
def chat_client(smollm2):
    model, tok = smollm2
    engine = Engine(model, max_batch=2, num_pages=24, page_size=16, max_seq_len=128)
    with running_server(engine, tok, model_name=CHAT) as (url, _):
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=120, max_retries=0)
        _wait_idle(url)


def test_chat_streamed_equals_unstreamed(chat_client, smollm2):
    _, tok = smollm2
    out = chat_client.chat.completions.create(
        model=CHAT, messages=QUESTION, max_completion_tokens=40, temperature=0
    )
    choice = out.choices[0]
    text = choice.message.content
    assert choice.message.role == "assistant" and "Paris" in text
    assert choice.finish_reason == "stop"  # at <|im_end|>, which is not in the text
    assert "<|im_end|>" not in text
    assert out.usage.prompt_tokens == len(tok.apply_chat_template(QUESTION))
    assert out.usage.completion_tokens == len(tok.encode(text)) + 1  # + <|im_end|>
    chunks = list(
        chat_client.chat.completions.create(
            model=CHAT,
            messages=QUESTION,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage == out.usage
    # Content as a list of text parts renders the same prompt.
    parts = [{"role": "user", "content": [{"type": "text", "text": QUESTION[0]["content"]}]}]
    out = chat_client.chat.completions.create(
        model=CHAT, messages=parts, max_tokens=40, temperature=0
    )
    assert out.choices[0].message.content == text
    # A stop string inside the reply.
    out = chat_client.chat.completions.create(
        model=CHAT, messages=QUESTION, max_tokens=40, temperature=0, stop="Paris"
    )
    assert out.choices[0].message.content == text[: text.index("Paris")]
    assert out.choices[0].finish_reason == "stop"
    # ignore_eos (vLLM's extra) runs past <|im_end|> to max_tokens.
    out = chat_client.chat.completions.create(
        model=CHAT,
        messages=QUESTION,
        max_tokens=out.usage.completion_tokens + 20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.content.startswith(text)


@pytest.mark.slow  # compiling generate for SmolLM2 takes ~30 s on a loaded 2-core machine
def test_chat_equals_generate(chat_client, smollm2):
    model, tok = smollm2
    want = generate(model, [tok.apply_chat_template(QUESTION)], max_new_tokens=40, eos_id=2)
    out = chat_client.chat.completions.create(
        model=CHAT, messages=QUESTION, max_tokens=40, temperature=0
    )
    assert out.choices[0].message.content == tok.decode(want.tokens[0])
    assert out.usage.completion_tokens == len(want.tokens[0])


def test_sampling_settings_reach_the_engine(code_server, code_model):
    # top_k = 1 is greedy whatever the temperature: the extras are honoured.
    url, _ = code_server
    _, tok = code_model
    want = tok.decode(_generated(code_model, PROMPTS[0], 10))
    body = dict(model=CODE, prompt=PROMPTS[0], max_tokens=10, temperature=1.5, top_k=1, seed=3)
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.json()["choices"][0]["text"] == want
    assert SamplingConfig(temperature=1.5, top_k=1).top_k == 1


def test_a_failing_request_fails_alone(code_server, code_model, monkeypatch):
    url, _ = code_server
    _, tok = code_model
    push = ChoiceText.push

    def failing_push(self, ids):  # a request with this stop string fails mid-generation
        if "__boom__" in self._stop and len(self.text) > 3:
            raise RuntimeError("boom")
        return push(self, ids)

    monkeypatch.setattr(ChoiceText, "push", failing_push)
    want = tok.decode(_generated(code_model, PROMPTS[1], 20))
    boom = dict(model=CODE, prompt=PROMPTS[0], max_tokens=100, temperature=0, stop="__boom__")
    good = dict(model=CODE, prompt=PROMPTS[1], max_tokens=20, temperature=0)

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return await asyncio.wait_for(
                asyncio.gather(
                    http.post("/v1/completions", json=boom),
                    http.post("/v1/completions", json={**boom, "stream": True}),
                    http.post("/v1/completions", json=good),
                ),
                60,
            )

    failed, streamed, ok = asyncio.run(main())
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    lines = [line for line in streamed.text.splitlines() if line]
    assert '"server_error"' in lines[-2] and lines[-1] == "data: [DONE]"
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == want
    _wait_idle(url)
