"""The benchmark harness every script in ``benchmarks/`` uses.

- :func:`measure` / :func:`time_fn`: warm-up calls, then the median of timed repeats (each call
  waited for with ``jax.block_until_ready``).
- :func:`peak_memory_bytes`: what XLA plans for a compiled function (``memory_analysis``).
- :func:`parser` + :func:`finish`: the shared flags (``--runs``, ``--warmup``, ``--quick``,
  ``--results-dir``) and the end of every script: a printed table and
  ``benchmarks/results/<name>[_quick].json`` with the machine, library versions, UTC date and load
  average (:func:`write_results`), so that a figure can always be traced to where it was measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Distributions whose versions go into every results file (absent ones are recorded as None).
VERSIONED = ("jax", "jaxlib", "numpy", "flax", "optax", "torch", "transformers")


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Wall seconds of each timed call (after the warm-up) and the last call's result."""

    times: tuple[float, ...]
    result: Any = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)


def measure(fn: Callable, *args, runs: int = 5, warmup: int = 1) -> Measurement:
    """Calls ``fn(*args)`` ``warmup`` times untimed, then ``runs`` times timed.

    Every call is waited for with ``jax.block_until_ready`` (a no-op on non-JAX results), so
    asynchronous dispatch does not hide device time; warm-up calls absorb compilation.
    """
    if not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs must be an int >= 1, got {runs!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times, result = [], None
    for _ in range(runs):
        start = time.perf_counter()
        result = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return Measurement(tuple(times), result)


def time_fn(fn: Callable, *args, runs: int = 5, warmup: int = 1) -> float:
    """Median wall time in seconds of ``fn(*args)`` over ``runs`` calls, after ``warmup`` calls."""
    return measure(fn, *args, runs=runs, warmup=warmup).median


def peak_memory_bytes(compiled) -> int | None:
    """Temporary + output bytes XLA plans for a compiled function (``memory_analysis``), if known."""
    mem = compiled.memory_analysis()
    if mem is None:
        return None
    return int(mem.temp_size_in_bytes + mem.output_size_in_bytes)


# The instruction sets the native CPU kernels choose between: two hosts that both call themselves
# "x86_64, 2 cores" differ by 2-5x in the quantized and bfloat16 products when these differ.
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8")


def cpu_model() -> tuple[str | None, list[str]]:
    """(the CPU's model name, which of :data:`CPU_FEATURES` it has), from ``/proc/cpuinfo``;
    (None, []) where that file does not exist."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None, []
    fields: dict[str, str] = {}
    for key, _, value in (line.partition(":") for line in text.splitlines()):
        fields.setdefault(key.strip(), value.strip())  # the first processor's
    flags = set(fields.get("flags", "").split())
    return fields.get("model name"), [f for f in CPU_FEATURES if f in flags]


def machine() -> dict:
    """What the numbers were measured on."""
    devices = jax.devices()
    model, features = cpu_model()
    return {
        "backend": jax.default_backend(),
        "device": devices[0].device_kind,
        "device_count": len(devices),
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": model,
        "cpu_features": features,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
    }


def versions() -> dict:
    """Python and the installed versions of :data:`VERSIONED` (None when not installed)."""
    out = {"python": platform.python_version()}
    for dist in VERSIONED:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (other work sharing the machine), where known."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def write_results(name: str, rows: list[dict], *, results_dir=None, **meta) -> Path:
    """Writes ``<results_dir>/<name>.json`` (default ``benchmarks/results``).

    The file holds ``name``, the UTC ``date``, ``machine``, ``versions``, ``load_average``
    (1/5/15 min, at write time), the keyword arguments ``meta`` and ``rows``.
    """
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"name must be a non-empty file stem, got {name!r}")
    directory = Path(results_dir) if results_dir is not None else RESULTS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    payload = {
        "name": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "load_average": load_average(),
        **meta,
        "rows": rows,
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    """A plain fixed-width table of ``columns`` from ``rows``."""
    cells = [[_fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for r in cells:
        print("  ".join(x.rjust(w) for x, w in zip(r, widths, strict=True)))


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return "-" if x is None else str(x)


def parser(doc: str, *, runs: int = 3, warmup: int = 1, quick: str = "fewer configs"):
    """An ``ArgumentParser`` with the flags every benchmark shares; ``doc`` is the module docstring.

    ``--quick`` (help text ``quick``) selects a small set that ``python -m benchmarks all --quick``
    runs; its results go to ``<name>_quick.json`` so they never overwrite a full run.
    """
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("--runs", type=positive, default=runs, help="timed runs per measurement")
    p.add_argument("--warmup", type=_non_negative, default=warmup, help="untimed calls first")
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON goes")
    return p


def finish(args: argparse.Namespace, name: str, rows: list[dict], columns: list[str], **meta):
    """Prints the table and writes the results JSON (see :func:`parser`); returns its path."""
    print_table(rows, columns)
    meta = dict(runs=args.runs, warmup=args.warmup, quick=args.quick, **meta)
    path = write_results(
        f"{name}_quick" if args.quick else name, rows, results_dir=args.results_dir, **meta
    )
    print(f"wrote {path}")
    return path


def positive(text: str) -> int:
    """An argparse ``type``: ``text`` as an int >= 1, else a usage error."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value
