"""The Pallas flash kernels (``impl="interpret"``) against the float32 reference.

FlashAttention-style tolerances: the kernel's error against the float32 oracle must be at most 2x
(3x for gradients) the error of the reference computed in the input dtype, plus a small floor.
Interpret mode compiles slowly on CPU, so the default run takes one dtype per shape; the full
shape x dtype grid is marked slow.
"""

import functools

import jax
import jax.numpy as jnp
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
    grad_fn,
    max_err,
    random_qkv,
)

from pallas_attn import BlockSizes, flash, flash_attention, flash_attention_varlen, reference

SMALL = BlockSizes(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
# Static kernel options for tests that only build a config.
_STATIC = dict(softmax_scale=1.0, window=(-1, -1), softcap=0.0, segments=False, interpret=True)


def _check(case, dtype):
    check_against_reference(case, dtype, "interpret")


@pytest.mark.parametrize(("case", "dtype"), CASES, ids=[case_id(c) for c, _ in CASES])
def test_interpret_matches_reference(case, dtype):
    _check(case, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", [c for c, _ in CASES], ids=[case_id(c) for c, _ in CASES])
def test_interpret_matches_reference_all_dtypes(case, dtype):
    _check(case, dtype)


def test_fully_masked_rows_give_zero_and_no_nan():
    check_fully_masked_rows("interpret", SMALL)


def test_interpret_is_deterministic():
    q, k, v = random_qkv(4, 1, 65, 65, 4, 2, 32, dtype=BF16)
    d_out = jax.random.normal(jax.random.key(5), q.shape, BF16)

    def f(q, k, v):
        out = flash_attention(q, k, v, causal=True, impl="interpret", block_sizes=SMALL)
        return jnp.sum(out.astype(jnp.float32) * d_out), out

    g = grad_fn(f, q, k, v)
    (a, a_out), (b, b_out) = g(q, k, v), g(q, k, v)
    for x, y in zip((*a, a_out), (*b, b_out), strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_per_batch_offsets_and_lengths_match_reference():
    """``q_offset``/``kv_start``/``kv_len`` as [B] arrays (the KV-cache prefill case)."""
    q, k, v = random_qkv(6, 3, 9, 40, 4, 2, 32)
    extra = dict(
        q_offset=jnp.array([0, 20, 31], jnp.int32),
        kv_start=jnp.array([0, 3, 0], jnp.int32),
        kv_len=jnp.array([9, 29, 40], jnp.int32),
    )
    kw = dict(softmax_scale=0.2, window=(12, 0), softcap=0.0, **extra)
    d_out = jax.random.normal(jax.random.key(7), q.shape)

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out * d_out), (out, lse)

    kernel = functools.partial(flash.attention, **kw, block_sizes=SMALL, interpret=True)
    oracle = functools.partial(reference.attention, **kw)
    results = [grad_fn(functools.partial(loss, fn), q, k, v)(q, k, v) for fn in (kernel, oracle)]
    (grads, (out, lse)), (ref_grads, (ref_out, ref_lse)) = results
    assert max_err(out, ref_out) <= 1e-5
    assert max_err(lse, ref_lse) <= 1e-5
    for g, g_ref in zip(grads, ref_grads, strict=True):
        assert max_err(g, g_ref) <= 1e-4


def test_varlen_matches_per_sequence_attention():
    lens_q, lens_k = [5, 17, 1], [9, 17, 30]
    cu_q = jnp.array(np.cumsum([0, *lens_q]), jnp.int32)
    cu_k = jnp.array(np.cumsum([0, *lens_k]), jnp.int32)
    kq, kk, kv, kd = jax.random.split(jax.random.key(8), 4)
    q = jax.random.normal(kq, (sum(lens_q), 4, 24))
    k = jax.random.normal(kk, (sum(lens_k), 2, 24))
    v = jax.random.normal(kv, (sum(lens_k), 2, 24))
    d_out = jax.random.normal(kd, q.shape)
    opts = dict(causal=True, window_size=(6, -1), return_lse=True)

    def packed(q, k, v):
        out, lse = flash_attention_varlen(
            q,
            k,
            v,
            cu_q,
            cu_k,
            max(lens_q),
            max(lens_k),
            **opts,
            impl="interpret",
            block_sizes=SMALL,
        )
        return jnp.sum(out * d_out), (out, lse)

    def separate(q, k, v):
        outs, lses = [], []
        starts_q, starts_k = np.cumsum([0, *lens_q]), np.cumsum([0, *lens_k])
        for n in range(len(lens_q)):
            qs = slice(starts_q[n], starts_q[n + 1])
            ks = slice(starts_k[n], starts_k[n + 1])
            o, s = flash_attention(q[None, qs], k[None, ks], v[None, ks], **opts, impl="reference")
            outs.append(o[0])
            lses.append(s[0])
        out, lse = jnp.concatenate(outs), jnp.concatenate(lses, axis=1)
        return jnp.sum(out * d_out), (out, lse)

    grads, (out, lse) = grad_fn(packed, q, k, v)(q, k, v)
    ref_grads, (ref_out, ref_lse) = grad_fn(separate, q, k, v)(q, k, v)
    assert out.shape == q.shape and lse.shape == (4, sum(lens_q))
    assert max_err(out, ref_out) <= 1e-5
    assert max_err(lse, ref_lse) <= 1e-5
    for g, g_ref in zip(grads, ref_grads, strict=True):
        assert max_err(g, g_ref) <= 1e-4


def test_varlen_rejects_bad_arguments():
    q = jnp.zeros((6, 2, 16))
    cu = jnp.array([0, 2, 6], jnp.int32)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        flash_attention_varlen(q, q, q, cu, cu, 0, 4)
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        flash_attention_varlen(q, q, q, cu, cu[:2], 4, 4)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        flash_attention_varlen(q, q, q, cu.astype(jnp.float32), cu, 4, 4)


def test_block_sizes_must_be_powers_of_two():
    q, k, v = random_qkv(9, 1, 8, 8, 1, 1, 16)
    with pytest.raises(ValueError, match="block_k"):
        flash_attention(q, k, v, impl="interpret", block_sizes=BlockSizes(block_k=24))


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
def test_default_block_sizes_are_valid_tiles(dtype):
    for D in range(8, 257, 8):
        bs = BlockSizes.get_default(D, dtype)
        cfg = flash.make_config(bs, 4096, 4096, **_STATIC)
        tiles = (cfg.block_q, cfg.block_k, cfg.block_q_bwd, cfg.block_k_bwd)
        assert tiles == (bs.block_q, bs.block_k, bs.block_q_bwd, bs.block_k_bwd), D
        assert cfg.num_warps in (4, 8) and cfg.num_stages >= 1


def test_tiles_shrink_to_short_sequences():
    cfg = flash.make_config(BlockSizes(block_q=128, block_k=64), 7, 40, **_STATIC)
    assert (cfg.block_q, cfg.block_k, cfg.block_q_bwd, cfg.block_k_bwd) == (16, 64, 16, 64)
