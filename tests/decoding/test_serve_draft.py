"""The server over an engine that speculates (``--draft prompt-lookup``, ``medusa``, ``eagle``
or ``--draft-model``): the official client's
completions, streamed and not, equal plain ``generate`` at temperature 0; the command line's
draft options and their usage errors."""

from __future__ import annotations

import openai
import pytest

import models
from decoding import Engine, Medusa, PromptLookup, generate
from decoding.chat import encode_prompt
from decoding.serve.__main__ import build_parser, main
from decoding.serve.local import running_server
from models.pretrained import medusa_heads_for

CODE = "code-target"
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fib",
    "import os\nimport",
]


@pytest.fixture(scope="module", params=["prompt-lookup", "medusa", "code-draft"])
def drafted(request):
    model, tok = models.pretrained(CODE)
    draft = PromptLookup()
    if request.param == "medusa":  # the shipped heads trained on code-target
        draft = Medusa(models.pretrained(medusa_heads_for(CODE))[0])
    if request.param == "code-draft":  # the shipped draft model for code-target
        draft = models.pretrained("code-draft")[0]
    engine = Engine(
        model,
        max_batch=4,
        num_pages=64,
        page_size=16,
        max_seq_len=256,
        draft=draft,
        num_draft_tokens=3,
    )
    with running_server(engine, tok, model_name=CODE, max_queue=16) as (url, _):
        yield (
            model,
            tok,
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=60, max_retries=0),
        )


def test_completions_equal_generate(drafted):
    model, tok, client = drafted
    for prompt in PROMPTS:
        ids, eos = encode_prompt(prompt, tok, model.config)
        want = tok.decode(generate(model, [ids], max_new_tokens=24, eos_id=eos).tokens[0])
        kw = dict(model=CODE, prompt=prompt, max_tokens=24, temperature=0)
        got = client.completions.create(**kw)
        assert got.choices[0].text == want
        streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
        assert streamed == want


def test_command_line_draft_options(capsys):
    args = build_parser().parse_args(["--draft", "prompt-lookup", "--num-draft-tokens", "4"])
    assert (args.draft, args.num_draft_tokens) == ("prompt-lookup", 4)
    for name in ("medusa+lookup", "eagle", "eagle+lookup"):
        assert build_parser().parse_args(["--draft", name]).draft == name
    args = build_parser().parse_args(["--draft-model", "code-draft", "--num-draft-tokens", "2"])
    assert (args.draft_model, args.num_draft_tokens) == ("code-draft", 2)
    for argv in (
        ["--draft", "prompt-lookup", "--draft-model", "code-draft"],
        ["--draft-model", "/nonexistent/draft.gguf"],
        ["--draft", "medusa-x"],
        ["--draft", "medusa", "--model", "code-draft"],  # no heads ship for it
        ["--draft", "eagle+lookup", "--model", "code-target"],  # no EAGLE head ships for it
        ["--num-draft-tokens", "2"],
        ["--draft", "prompt-lookup", "--num-draft-tokens", "99"],
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert "usage" in capsys.readouterr().err


def test_generation_config_defaults(tmp_path):
    """Fields a request leaves out come from the checkpoint's generation config, else OpenAI's."""
    import json
    from types import SimpleNamespace

    from decoding.serve.app import Server
    from decoding.serve.defaults import OPENAI, generation_defaults
    from models.pretrained import model_path

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9}))
    found = generation_defaults(tmp_path)
    assert found == {**OPENAI, "temperature": 0.6, "top_p": 0.9}
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "top_k": 50}))
    assert generation_defaults(tmp_path) == {**OPENAI, "temperature": 0.0, "top_k": 50}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(ValueError, match="temperature must be a number"):
        generation_defaults(tmp_path)
    assert generation_defaults(model_path("smollm2-135m-instruct")) == OPENAI  # its GGUF has none

    def request(**kw):
        fields = dict(temperature=None, top_p=None, top_k=None, min_p=None)
        return SimpleNamespace(**{**fields, **kw})

    server = SimpleNamespace(defaults={**OPENAI, "temperature": 0.6, "top_p": 0.9})
    got = Server.sampling(server, request())
    assert (got.temperature, got.top_p, got.top_k) == (0.6, 0.9, 0)
    got = Server.sampling(server, request(temperature=0.0, top_k=-1))
    assert (got.temperature, got.top_p, got.top_k) == (0.0, 0.9, 0)
