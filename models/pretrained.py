"""The shipped byte-level code models (``models/shipped/<name>/``, Hugging Face Llama format)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import jax.numpy as jnp

from models.hf import config_from_hf, load_hf_checkpoint
from models.medusa import load_medusa
from models.tokenizer import ByteTokenizer
from models.transformer import Transformer

SHIPPED_DIR = pathlib.Path(__file__).parent / "shipped"
SHIPPED = ("code-target", "code-draft")
# Shipped Medusa heads (``models.medusa``) -> the shipped model they were trained on.
SHIPPED_MEDUSA = {"code-target-medusa": "code-target"}


def shipped_path(name: str) -> pathlib.Path:
    """Directory of a shipped model or heads; ValueError naming the choices for an unknown name."""
    if name not in SHIPPED and name not in SHIPPED_MEDUSA:
        choices = SHIPPED + tuple(SHIPPED_MEDUSA)
        raise ValueError(f"unknown shipped model {name!r}; choose from {choices}")
    return SHIPPED_DIR / name


def checkpoint_dir(name: str) -> pathlib.Path:
    """A shipped model's directory for its name, else ``name`` itself when it is a directory;
    ValueError naming the choices when it is neither."""
    if name in SHIPPED:
        return SHIPPED_DIR / name
    if os.path.isdir(name):
        return pathlib.Path(name)
    raise ValueError(
        f"expected one of {', '.join(SHIPPED)} or a checkpoint directory, got {name!r}"
    )


def checkpoint_arg(text: str) -> str:
    """An ``argparse`` type: ``text`` when :func:`checkpoint_dir` accepts it (a usage error
    otherwise). Shared by the command lines that take a model."""
    try:
        checkpoint_dir(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def load_model(name: str, *, dtype=jnp.float32, attn_impl: str = "auto") -> Transformer:
    """A shipped model by name or a Hugging Face checkpoint directory (see
    :func:`models.load_hf_checkpoint` for the errors)."""
    return load_hf_checkpoint(str(checkpoint_dir(name)), dtype=dtype, attn_impl=attn_impl)


def pretrained(
    name: str, *, dtype=jnp.float32, attn_impl: str = "auto"
) -> tuple[Transformer, ByteTokenizer]:
    """``(model, tokenizer)`` for a shipped model: "code-target" (~5M parameters) or
    "code-draft" (~0.7M), both trained on the Python standard library (see ``models.train``).

    For "code-target-medusa", ``(models.MedusaHeads, tokenizer)``: 4 Medusa heads trained on the
    frozen code-target (``models.medusa_train``), in ``dtype``.
    """
    if name in SHIPPED_MEDUSA:
        hf = json.loads((shipped_path(SHIPPED_MEDUSA[name]) / "config.json").read_text())
        config = config_from_hf(hf, dtype=dtype).replace(attn_impl=attn_impl)
        return load_medusa(str(shipped_path(name)), config), ByteTokenizer()
    model = load_hf_checkpoint(str(shipped_path(name)), dtype=dtype, attn_impl=attn_impl)
    return model, ByteTokenizer()
