"""The benchmark scripts that ``python -m benchmarks all`` runs, one line each.

An explicit list rather than discovery: a script is listed once it exists, adding one is one
line, the order (cheap first) and the ``--quick`` arguments are visible here, and listing needs no
import of the scripts (some import torch or GPU-only code). Each script runs in its own process
(``python -m benchmarks.<name> [quick args]``), so one failure or memory leak cannot spoil the
others, and any script with an ``if __name__ == "__main__"`` entry point can be listed.
``all`` names the ``benchmarks/*.py`` files that are not listed, so a forgotten line shows.

Plot recipes live beside the code that writes the JSON: a listed script's module-level
``PLOTS = {"<results name>": (Plot(...), ...)}`` (see :mod:`benchmarks.plot`).
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

BENCHMARKS_DIR = Path(__file__).resolve().parent
HARNESS_MODULES = frozenset({"__init__", "__main__", "common", "plot", "registry"})


@dataclasses.dataclass(frozen=True)
class Script:
    """``python -m benchmarks.<name>``; ``quick``: its arguments under ``all --quick``;
    ``backends``: the JAX backends it is run on by ``all``."""

    name: str
    quick: tuple[str, ...] = ("--quick",)
    backends: tuple[str, ...] = ("cpu", "gpu")


SCRIPTS = (
    Script("attention", quick=("--quick", "--runs", "1")),
    Script("decode", quick=("--quick", "--runs", "2")),
    Script("generate", quick=("--quick", "--runs", "1")),
    Script("engine"),
    Script("speculative", quick=("--quick", "--runs", "1", "--no-hf")),
    Script("bandwidth", backends=("cpu",)),
    Script("real_model", quick=("--quick", "--runs", "1", "--no-llama-cpp"), backends=("cpu",)),
    Script("fused_decode", quick=("--quick", "--runs", "1", "--warmup", "0"), backends=("cpu",)),
    Script("serve", backends=("cpu",)),
    Script("logprobs", quick=("--quick", "--runs", "1")),
    Script("medusa_real", quick=("--quick", "--runs", "1"), backends=("cpu",)),
)


def scripts(backend: str | None = None, only=None) -> list[Script]:
    """The listed scripts for ``backend`` (all when None), restricted to the names in ``only``."""
    names = {s.name for s in SCRIPTS}
    unknown = sorted(set(only or ()) - names)
    if unknown:
        raise ValueError(f"only: unknown scripts {unknown}; listed: {sorted(names)}")
    return [
        s
        for s in SCRIPTS
        if (backend is None or backend in s.backends) and (not only or s.name in only)
    ]


def unlisted() -> list[str]:
    """Script files in ``benchmarks/`` that are neither harness modules nor listed."""
    listed = {s.name for s in SCRIPTS} | HARNESS_MODULES
    return sorted(p.stem for p in BENCHMARKS_DIR.glob("*.py") if p.stem not in listed)


def plot_recipes() -> dict:
    """``{results name: (Plot, ...)}`` merged from the listed scripts' ``PLOTS``."""
    recipes = {}
    for s in SCRIPTS:
        recipes.update(getattr(importlib.import_module(f"benchmarks.{s.name}"), "PLOTS", {}))
    return recipes
