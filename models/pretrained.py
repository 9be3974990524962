"""The shipped byte-level code models (``models/shipped/<name>/``, Hugging Face Llama format)."""

from __future__ import annotations

import pathlib

import jax.numpy as jnp

from models.hf import load_hf_checkpoint
from models.tokenizer import ByteTokenizer
from models.transformer import Transformer

SHIPPED_DIR = pathlib.Path(__file__).parent / "shipped"
SHIPPED = ("code-target", "code-draft")


def shipped_path(name: str) -> pathlib.Path:
    """Directory of a shipped model; ValueError naming the choices for an unknown name."""
    if name not in SHIPPED:
        raise ValueError(f"unknown shipped model {name!r}; choose from {SHIPPED}")
    return SHIPPED_DIR / name


def pretrained(
    name: str, *, dtype=jnp.float32, attn_impl: str = "auto"
) -> tuple[Transformer, ByteTokenizer]:
    """``(model, tokenizer)`` for a shipped model: "code-target" (~5M parameters) or
    "code-draft" (~0.7M), both trained on the Python standard library (see ``models.train``)."""
    model = load_hf_checkpoint(str(shipped_path(name)), dtype=dtype, attn_impl=attn_impl)
    return model, ByteTokenizer()
