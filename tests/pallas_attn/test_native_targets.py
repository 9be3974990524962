"""The native kernels built for an older instruction set than this CPU's: ``PALLAS_ATTN_MARCH``.

``-march=native`` on an AVX-512 host compiles only its AVX-512 (and AMX) paths, so the AVX2 + FMA
kernels that an AVX2-only CPU runs (AMD EPYC before Zen 4, most laptops) would never be compiled
or checked here. This builds them (``-march=haswell``) in a cache of their own and runs the
native kernels' tests against them in a child process: every product (float32, bfloat16, the
block formats with float and 8-bit activations), the attention kernel, the fused decode layer and
the cache write, against the same references and tolerances.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pallas_attn import native

ROOT = Path(__file__).resolve().parents[2]
TESTS = [
    "tests/models/test_rows_matmul.py",
    "tests/models/test_quant.py",
    "tests/models/test_quant_q8act.py",
    "tests/models/test_fused_decode.py",
    "tests/pallas_attn/test_cache_write.py",
    "tests/pallas_attn/test_kvcache.py",
]
# The kernels' own tests: those of whole models (generation, speculation, the real model; 5-90 s
# each) add no kernel path the products' and layers' tests miss, and the lowering tests, the
# interpreter and the rest of test_kvcache do not run the kernels.
DESELECT = (
    "not real_model and not smollm2 and not generate and not speculative and not verification"
    " and not casts and not bad_ and not falls_back and not lowers_for_cuda and not interpret"
    " and (not test_kvcache or reference_and_xla or paged_equals or native)"
)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((s for s in text.splitlines() if s.startswith("flags")), "")
    return set(line.partition(":")[2].split())


@pytest.mark.skipif(
    not ({"avx512f", "avx2", "fma", "f16c"} <= _cpu_flags() and native.available()),
    reason="needs an AVX-512 host (elsewhere -march=native already builds the AVX2 paths)",
)
def test_avx2_kernels(tmp_path):
    env = {
        **os.environ,
        "PALLAS_ATTN_MARCH": "haswell",
        "PALLAS_ATTN_CACHE": str(tmp_path / "cache"),
    }
    probe = "from pallas_attn import native; print(' '.join(sorted(native.features())))"
    got = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert got.returncode == 0, got.stderr[-3000:]
    assert set(got.stdout.split()) == {"avx2", "fma", "f16c"}  # built without AVX-512 or AMX
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow"]
        + ["-k", DESELECT, *TESTS],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
