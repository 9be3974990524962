"""The Mosaic GPU flash kernels under JAX's GPU interpreter (``impl="mosaic_interpret"``).

FlashAttention-style tolerances against the float32 reference, as for the Triton kernels
(:func:`attn_utils.check_against_reference`: 2x the same-precision reference's error on out and
lse, 3x on dq/dk/dv, random cotangents on both). The interpreter runs every TMA copy, barrier and
wgmma as a host callback, so shapes stay small: one or two 64-row tiles; the wider cross is slow.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_utils import BF16, F16, case_id, check_against_reference, grad_fn, random_qkv

from pallas_attn import BlockSizes, flash_attention, validation

# (case, dtype): GQA ratios 1, 2 and 4; causal, window, softcap, segment ids; D 64 and 128 (and
# 40, padded); T = S, T != S and ragged T, S (padded to the tiles); one 128-key forward tile.
CASES = [
    (dict(T=128, S=128, Hq=2, Hkv=1, D=64, causal=True), BF16),
    (dict(T=64, S=64, Hq=4, Hkv=1, D=128), F16),
    (dict(T=72, S=100, Hq=2, Hkv=2, D=64, window=(16, 8)), BF16),
    (dict(T=64, S=64, Hq=2, Hkv=1, D=64, causal=True, segments=True), BF16),
    (
        dict(T=64, S=128, Hq=1, Hkv=1, D=64, causal=True, softcap=5.0, blocks=(128, 128, 64, 64)),
        F16,
    ),
]
SLOW_CASES = [
    (dict(T=128, S=128, Hq=4, Hkv=1, D=128, causal=True, window=(40, 0), softcap=3.0), BF16),
    (dict(T=100, S=200, Hq=2, Hkv=1, D=40, causal=True), F16),
    (dict(T=192, S=64, Hq=2, Hkv=2, D=64, causal=True), BF16),
    (dict(T=100, S=150, Hq=4, Hkv=2, D=128, segments=True, window=(30, 30)), F16),
]


def _check(case, dtype):
    case = {"blocks": None, **case}
    check_against_reference(case, dtype, "mosaic_interpret")


@pytest.mark.parametrize(("case", "dtype"), CASES, ids=[case_id(c) for c, _ in CASES])
def test_mosaic_matches_reference(case, dtype):
    _check(case, dtype)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "dtype"), SLOW_CASES, ids=[case_id(c) for c, _ in SLOW_CASES])
def test_mosaic_matches_reference_slow(case, dtype):
    _check(case, dtype)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "dtype"), CASES, ids=[case_id(c) for c, _ in CASES])
def test_mosaic_matches_reference_other_dtype(case, dtype):
    _check(case, F16 if dtype == BF16 else BF16)


def test_mosaic_fully_masked_rows():
    """T > S, causal: the first T - S queries sit before key 0 and see nothing: out 0, lse -inf,
    finite gradients, zero for those rows' queries."""
    T, S = 100, 36
    q, k, v = random_qkv(3, 1, T, S, 2, 1, 64, dtype=BF16)

    def f(q, k, v):
        out, lse = flash_attention(q, k, v, causal=True, return_lse=True, impl="mosaic_interpret")
        return jnp.sum(out.astype(jnp.float32) ** 2), (out, lse)

    grads, (out, lse) = grad_fn(f, q, k, v)(q, k, v)
    hidden = np.arange(T) < T - S
    assert np.all(np.asarray(out, np.float32)[:, hidden] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, hidden]))
    assert np.all(np.isfinite(np.asarray(lse)[:, :, ~hidden]))
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
    assert np.all(np.asarray(grads[0], np.float32)[:, hidden] == 0)


def test_mosaic_is_deterministic():
    """Same output and gradient bits twice (dK/dV sum the GQA heads in registers, no atomics)."""
    q, k, v = random_qkv(4, 1, 64, 64, 2, 1, 64, dtype=BF16)
    d_out = jax.random.normal(jax.random.key(5), q.shape, BF16)

    def f(q, k, v):
        out = flash_attention(q, k, v, causal=True, impl="mosaic_interpret")
        return jnp.sum(out * d_out), out

    a, b = (grad_fn(f, q, k, v)(q, k, v) for _ in range(2))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(dtype=jnp.float32), TypeError, "bfloat16 or float16"),
        (dict(block_sizes=BlockSizes(block_q=64)), ValueError, "block_q"),
        (dict(block_sizes=BlockSizes(block_q=128, block_k=32)), ValueError, "block_k"),
    ],
)
def test_mosaic_rejects_what_it_cannot_run(kwargs, error, match):
    q, k, v = random_qkv(0, 1, 8, 8, 2, 1, 64, dtype=kwargs.get("dtype", BF16))
    opts = dict(impl="mosaic_interpret", block_sizes=kwargs.get("block_sizes"))
    with pytest.raises(error, match=match):
        flash_attention(q, k, v, **opts)


@pytest.mark.parametrize(
    ("backend", "cc", "dtype", "want"),
    [
        ("gpu", 9, BF16, "mosaic"),
        ("gpu", 10, F16, "mosaic"),
        ("gpu", 9, jnp.float32, "pallas"),
        ("gpu", 8, BF16, "pallas"),
        ("cpu", 0, BF16, "xla"),
    ],
)
def test_auto_picks_mosaic_on_hopper(monkeypatch, backend, cc, dtype, want):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr(validation, "_compute_capability", lambda: cc)
    assert validation.resolve_impl("auto", mosaic_dtype=dtype) == want
    assert validation.resolve_impl("auto") == ("xla" if backend == "cpu" else "pallas")


def test_mosaic_kernels_have_no_races(monkeypatch):
    """JAX's GPU interpreter with its happens-before race detector (``detect_races=True``) finds
    no race in the forward (three warpgroups: TMA producer, two consumers) nor in the backward's
    last kernel (the detector keeps the state of the latest kernel only)."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    from pallas_attn.kernels.mosaic import common as mc

    racy = mc.InterpretGPUParams(detect_races=True)
    monkeypatch.setattr(mc, "interpret_params", lambda cfg: racy if cfg.interpret else None)
    jax.clear_caches()
    q, k, v = random_qkv(6, 1, 128, 192, 2, 1, 64, dtype=BF16)

    def loss(q, k, v):
        out = flash_attention(q, k, v, causal=True, impl="mosaic_interpret")
        return jnp.sum(out.astype(jnp.float32))

    jax.block_until_ready(flash_attention(q, k, v, causal=True, impl="mosaic_interpret"))
    assert not gpu_callbacks.get_races().races_found
    jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    assert not gpu_callbacks.get_races().races_found


def test_mosaic_rejects_varlen():
    from pallas_attn import flash_attention_varlen

    cu = jnp.array([0, 3, 8], jnp.int32)
    q, k, v = (x[0] for x in random_qkv(7, 1, 8, 8, 2, 1, 64, dtype=BF16))
    with pytest.raises(ValueError, match="varlen"):
        flash_attention_varlen(q, k, v, cu, cu, max_seqlen_q=5, max_seqlen_k=5, impl="mosaic")
