"""Chat templates: a model's Jinja template rendered over a conversation, as transformers renders it.

The environment is what transformers' ``apply_chat_template`` gives a template: a sandboxed,
immutable Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, loop controls, the
``{% generation %}`` tag (rendered as its body), ``raise_exception(message)``,
``strftime_now(format)``, and a ``tojson`` filter that keeps non-ASCII text and does not escape
HTML. The template sees ``messages``, ``add_generation_prompt``, ``tools``, ``documents``, the
special token strings (``bos_token``, ``eos_token``, ...) and any extra keyword arguments.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's tokens for training masks;
    rendering only needs its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message):
    raise ValueError(f"chat template: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """The compiled template (cached by its text); ``ValueError`` when it is not valid Jinja."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template is not valid Jinja: {e}") from e


def check_messages(messages) -> None:
    """``ValueError`` unless ``messages`` is a list of ``{"role": str, "content": str, ...}``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise ValueError(
                    f"messages[{i}][{key!r}] must be a str, got {message.get(key)!r} "
                    f"(each message is {{'role': str, 'content': str}})"
                )


def render_chat_template(
    template: str,
    messages,
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str | None] | None = None,
    **kwargs,
) -> str:
    """The text of ``messages`` rendered by ``template``; ``special_tokens`` maps names such as
    ``"bos_token"`` to their strings. ``ValueError`` for malformed messages, a template that is not
    valid Jinja, or a template that rejects the conversation (``raise_exception``)."""
    check_messages(messages)
    context = {"tools": None, "documents": None, **(special_tokens or {}), **kwargs}
    return compile_chat_template(template).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt, **context
    )
