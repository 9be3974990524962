"""``impl="pallas"`` lowers for CUDA (Triton) from a CPU-only machine, forward and ``jax.grad``.

Lowering runs the whole Pallas -> Triton IR path (block shapes, dots, masks, loops), so a kernel
that Triton would reject at this level fails here without a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_attn import BlockSizes, flash_attention, flash_attention_varlen

TRITON_CALL = "xla.gpu.triton"

# (D, dtype, Hq, Hkv, options): D in {64, 128, 256}, MHA/GQA/MQA, causal, window, softcap, segments.
CASES = [
    (64, jnp.bfloat16, 8, 2, dict(causal=True)),
    (64, jnp.float16, 4, 4, dict(window_size=(32, 16), softcap=30.0)),
    (128, jnp.bfloat16, 8, 1, dict(causal=True, softcap=50.0)),
    (128, jnp.float32, 8, 2, dict(segments=True)),
    (256, jnp.bfloat16, 4, 2, dict(causal=True, window_size=(64, 0))),
    (256, jnp.bfloat16, 4, 4, dict(segments=True, causal=True)),
    (40, jnp.bfloat16, 4, 2, dict(causal=True)),  # D padded to 64
]


def _lower(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _case_id(case):
    D, dtype, Hq, Hkv, opts = case
    return f"D{D}-{jnp.dtype(dtype).name}-{Hq}/{Hkv}-" + "-".join(opts)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_and_grad_lower_for_cuda(case):
    D, dtype, Hq, Hkv, opts = case
    B, T, S = 2, 200, 256
    opts = dict(opts)
    if opts.pop("segments", False):
        opts["q_segment_ids"] = jnp.zeros((B, T), jnp.int32)
        opts["kv_segment_ids"] = jnp.zeros((B, S), jnp.int32)
    q = jax.ShapeDtypeStruct((B, T, Hq, D), dtype)
    kv = jax.ShapeDtypeStruct((B, S, Hkv, D), dtype)
    f = functools.partial(flash_attention, **opts, impl="pallas")

    assert _lower(f, q, kv, kv).count(TRITON_CALL) == 1

    def loss(q, k, v):
        return jnp.sum(f(q, k, v).astype(jnp.float32))

    # The forward kernel, then the dK/dV and dQ kernels.
    assert _lower(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv).count(TRITON_CALL) == 3


def test_default_block_sizes_lower_for_long_sequences():
    q = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    f = functools.partial(flash_attention, causal=True, impl="pallas")
    grad = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))
    assert _lower(grad, q, q, q).count(TRITON_CALL) == 3


def test_varlen_lowers_for_cuda():
    q = jax.ShapeDtypeStruct((300, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((300, 2, 64), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((5,), jnp.int32)
    f = functools.partial(
        flash_attention_varlen,
        max_seqlen_q=128,
        max_seqlen_k=128,
        causal=True,
        impl="pallas",
        block_sizes=BlockSizes(block_q=64, block_k=32),
    )
    assert _lower(lambda q, k, v, cu: f(q, k, v, cu, cu), q, kv, kv, cu).count(TRITON_CALL) == 1
