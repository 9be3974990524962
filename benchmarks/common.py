"""Benchmark helpers: timing (median of N runs), peak memory of a compiled function, JSON results."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def time_fn(fn, *args, runs: int = 5, warmup: int = 1) -> float:
    """Median wall time in seconds of ``fn(*args)`` over ``runs`` calls, after ``warmup`` calls.

    Every call is waited for with ``jax.block_until_ready``, so asynchronous dispatch does not
    hide device time.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def peak_memory_bytes(compiled) -> int | None:
    """Temporary + output bytes XLA plans for a compiled function (``memory_analysis``), if known."""
    mem = compiled.memory_analysis()
    if mem is None:
        return None
    return int(mem.temp_size_in_bytes + mem.output_size_in_bytes)


def machine() -> dict:
    """What the numbers were measured on."""
    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "device": devices[0].device_kind,
        "device_count": len(devices),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
    }


def write_results(name: str, rows: list[dict], **meta) -> Path:
    """Writes ``benchmarks/results/<name>.json`` with the machine, JAX version and UTC date."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    payload = {
        "name": name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
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
