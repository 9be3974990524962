"""The compiled Pallas kernels (``impl="pallas"``, Triton) on a real GPU; skipped elsewhere.

The same checks the interpreted kernels get on CPU, with the float32 oracle computed at
``highest`` matmul precision: on a GPU a float32 dot defaults to TF32 in XLA and in Triton alike,
so the same-precision reference (default precision) sets the tolerance and the oracle does not.
``python -m pytest tests/pallas_attn/test_gpu_compiled.py`` on a GPU machine.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from attn_utils import (
    BF16,
    CASES,
    F16,
    F32,
    case_id,
    check_against_reference,
    check_fully_masked_rows,
    max_err,
)
from test_kvcache import HAND, INTERPRET, Case, as_bits, call, make_inputs, sampled_cases, tolerance

from pallas_attn import BlockSizes

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")

DTYPES = [F32, BF16, F16]
TF32_FLOOR = 2e-3  # ~4 units of roundoff at |out| ~ 1


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", [c for c, _ in CASES], ids=[case_id(c) for c, _ in CASES])
def test_flash_matches_reference(case, dtype):
    # float32 dots run as TF32 (10 mantissa bits, unit roundoff 2^-11) in the kernel, as in XLA;
    # where XLA skips TF32 (a 1-key row: no product to round), the floor covers the rounding of v.
    check_against_reference(case, dtype, "pallas", floor=TF32_FLOOR if dtype == F32 else None)


@pytest.mark.parametrize("case", [c for c, _ in CASES], ids=[case_id(c) for c, _ in CASES])
def test_flash_float32_at_highest_precision(case):
    """Under ``jax.default_matmul_precision("highest")`` the kernels' dots are IEEE float32, so
    the CPU tests' float32 floor holds."""
    with jax.default_matmul_precision("highest"):
        check_against_reference(case, F32, "pallas")


@pytest.mark.parametrize("case", [c for c, _ in CASES], ids=[case_id(c) for c, _ in CASES])
def test_flash_default_tiles_match_reference(case, dtype=BF16):
    """The kernels at the tiles users get (``block_sizes=None``), not the tests' 16-row ones."""
    check_against_reference({**case, "blocks": None}, dtype, "pallas")


def test_flash_fully_masked_rows():
    check_fully_masked_rows("pallas", BlockSizes(16, 16, 16, 16))


def check_kvcache(case: Case, seed: int, **extra):
    """Out and lse within 2x the same-precision reference's error (against the ``highest``
    oracle) plus ``tolerance``; the caches within one unit in the last place of the reference's (Triton
    and XLA contract the rotary ``x * cos + x' * sin`` into different FMAs, so a value on a
    rounding boundary of the cache dtype can land one step apart)."""
    inp = make_inputs(case, seed=seed)
    got = call(inp, "pallas", **extra)
    same = call(inp, "reference")
    with jax.default_matmul_precision("highest"):
        oracle = call(inp, "reference")
    for name in ("out", "lse"):
        err = max_err(getattr(got, name), getattr(oracle, name))
        base = max_err(getattr(same, name), getattr(oracle, name))
        assert err <= 2 * base + tolerance(case), (
            f"{name}: {err:.3g} > 2 x {base:.3g} + {tolerance(case)}"
        )
    for a, b in ((got.k_cache, same.k_cache), (got.v_cache, same.v_cache)):
        steps = ulp_steps(a, b)
        assert steps.max() <= 1 and np.mean(steps > 0) < 0.02, (steps.max(), np.mean(steps > 0))


def ulp_steps(a, b):
    """Per element, how many representable values of the dtype lie between a and b."""

    def ordered(x):  # sign-magnitude bits -> integers ordered like the values
        bits = as_bits(x).astype(np.int64)
        sign = 1 << (8 * np.asarray(x).dtype.itemsize - 1)
        return np.where(bits & sign, sign - bits, bits)

    return np.abs(ordered(a) - ordered(b))


@pytest.mark.parametrize("case", HAND + INTERPRET + sampled_cases(8, seed=11), ids=repr)
def test_kvcache_matches_reference(case):
    check_kvcache(case, seed=12)


@pytest.mark.parametrize("num_splits", [0, 1, 3, 8])
def test_kvcache_num_splits(num_splits):
    case = Case(Tq=5, Tn=1, Hq=4, Hkv=2, S=600, leftpad=True, causal=True, window=(450, 0))
    check_kvcache(case, seed=13, num_splits=num_splits)


def test_kvcache_paged_equals_contiguous():
    case = Case(Tq=5, Tn=5, Hq=4, Hkv=2, S=96, page=16, leftpad=True, causal=True)
    paged = make_inputs(case, seed=14)
    contiguous = dataclasses.replace(
        paged,
        k_cache=paged.k_log,
        v_cache=paged.v_log,
        kwargs={k: w for k, w in paged.kwargs.items() if k != "block_table"},
    )
    a, b = call(paged, "pallas"), call(contiguous, "pallas")
    assert max_err(a.out, b.out) <= tolerance(case) and max_err(a.lse, b.lse) <= tolerance(case)


def test_kvcache_deterministic():
    inp = make_inputs(Case(Tq=5, Tn=5, S=400, page=16, causal=True), seed=15)
    a, b = call(inp, "pallas", num_splits=3), call(inp, "pallas", num_splits=3)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(as_bits(x), as_bits(y))
