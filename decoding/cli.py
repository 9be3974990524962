"""What the command lines (``python -m decoding``, ``python -m decoding.serve``) share: argument
types that turn bad values into usage errors, and the on-disk compilation cache."""

from __future__ import annotations

import argparse
import os

import jax

from decoding.sampling import check_seed
from pallas_attn import native


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def seed(text: str) -> int:
    try:
        return check_seed(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 2**32), got {text!r}") from None


def number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def persistent_compilation_cache() -> None:
    """Keeps compiled programs on disk between runs (the engine's two steps take seconds to
    compile on a CPU), unless the user configured JAX's cache already."""
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", str(native.cache_dir() / "xla"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
