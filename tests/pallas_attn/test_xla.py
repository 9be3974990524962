"""The blockwise XLA path against the float32 reference: forward, lse and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_utils import (
    BF16,
    CASES,
    F32,
    case_id,
    check_against_reference,
    check_fully_masked_rows,
    random_qkv,
)

from pallas_attn import BlockSizes, flash_attention


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", [c for c, _ in CASES], ids=[case_id(c) for c, _ in CASES])
def test_xla_matches_reference(case, dtype):
    check_against_reference(case, dtype, "xla")


def test_fully_masked_rows_give_zero_and_no_nan():
    check_fully_masked_rows("xla", BlockSizes(block_q=8, block_k=8))


def test_xla_is_deterministic():
    q, k, v = random_qkv(4, 1, 65, 65, 4, 2, 32)
    f = jax.jit(
        jax.grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, impl="xla")))
    )
    a, b = f(q, k, v), f(q, k, v)
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_xla_memory_is_linear_in_sequence_length():
    """T = 16384, H = 8, D = 64 float32: the T^2 score matrix alone would be 8 GiB."""
    T, H, D = 16384, 8, 64
    spec = jax.ShapeDtypeStruct((1, T, H, D), jnp.float32)

    def fwd_bwd(q, k, v):
        return jax.grad(
            lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, impl="xla")),
            argnums=(0, 1, 2),
        )(q, k, v)

    compiled = jax.jit(fwd_bwd).trace(spec, spec, spec).lower().compile()
    mem = compiled.memory_analysis()
    temp = mem.temp_size_in_bytes
    scores = H * T * T * 4
    assert temp < scores / 20, f"temp {temp / 2**20:.0f} MiB vs scores {scores / 2**20:.0f} MiB"
