"""Chat templates rendered as transformers renders them: SmolLM2's own, and one that uses every
helper transformers gives a template."""

import jinja2
import pytest
from tokenizer_utils import hf_gguf_tokenizer

from models.chat_template import render_chat_template
from models.tokenizer import load_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Japan?"},
    ],
    [
        {"role": "user", "content": "Hi! 😀"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Write `x = 1` in <code>."},
    ],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "<|im_start|> and 3+3?"},
    ],
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return load_tokenizer(smollm2_gguf), hf_gguf_tokenizer(str(smollm2_gguf))


def _hf_ids(hf, messages, **kwargs):
    ids = hf.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_smollm2_chat_matches_transformers(smollm2, index, add_generation_prompt):
    tok, hf = smollm2
    messages = CONVERSATIONS[index]
    kwargs = dict(add_generation_prompt=add_generation_prompt)
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert tok.apply_chat_template(messages, **kwargs) == _hf_ids(hf, messages, **kwargs)
    assert tok.apply_chat_template(messages, **kwargs) == tok.encode(text)


def test_smollm2_default_system_prompt_and_generation_prompt(smollm2):
    tok, _ = smollm2
    text = tok.apply_chat_template(CONVERSATIONS[0], tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(CONVERSATIONS[0])
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> as its special id, no extra BOS


HELPERS = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "{% if loop.index > 3 %}{% break %}{% endif %}"
    "<{{ m['role'] }}>{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
    "{% endfor %}\n"
    "  {% if extra is defined %}{{ extra | tojson(indent=1) }}{% endif %}\n"
    "{% if add_generation_prompt %}<assistant>{{ strftime_now('%Y') | length }}{% endif %}"
    "{{ eos_token }}"
)


def test_template_helpers_match_transformers(smollm2):
    tok, hf = smollm2
    messages = [
        {"role": "user", "content": 'héllo <b>"q"</b> & 😀'},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "a"},
        {"role": "user", "content": "b"},
    ]
    extra = {"k": ["ü", 1]}
    ours = render_chat_template(
        HELPERS,
        messages,
        special_tokens={"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"},
        extra=extra,
    )
    theirs = hf.apply_chat_template(
        messages, chat_template=HELPERS, add_generation_prompt=True, tokenize=False, extra=extra
    )
    assert ours == theirs
    assert '"héllo <b>\\"q\\"</b> & 😀"' in ours  # tojson keeps non-ASCII and does not escape HTML
    with pytest.raises(ValueError, match="no tools here"):
        render_chat_template(HELPERS, [{"role": "tool", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "messages must be a list"),
        ({"role": "user", "content": "hi"}, "messages must be a list"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\]\['role'\] must be a str"),
        ([{"role": "user"}], r"messages\[0\]\['content'\] must be a str"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], r"messages\[1\]"),
    ],
)
def test_malformed_messages(smollm2, messages, match):
    tok, _ = smollm2
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_invalid_template_syntax():
    with pytest.raises(ValueError, match="not valid Jinja"):
        render_chat_template("{% for %}", [])


def test_template_is_sandboxed():
    with pytest.raises(jinja2.exceptions.SecurityError, match="unsafe"):
        render_chat_template(
            "{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", []
        )
