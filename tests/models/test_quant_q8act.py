"""The quantized few-row kernel with 8-bit activations (``activations="q8"`` of
models.rows_matmul.matmul_quantized): against a NumPy reference that quantizes the activations the
same way and sums the blocks' integer products, and against the float-activation product within
the bound the activations' rounding allows."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from models import quant, rows_matmul

native = pytest.mark.skipif(not rows_matmul.available(), reason="native kernels not built")
K, N = 288, 100  # 9 blocks (K not a multiple of 256), N not a multiple of the panel (32)


def _case(fmt, M, seed, k=K, n=N):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((k, n)) * rng.uniform(0.01, 2, (1, n))).astype(np.float32)
    x = (rng.standard_normal((M, k)) * rng.uniform(0.1, 10, (M, 1))).astype(np.float32)
    x[0, 32:64] = 0  # an all-zero activation block (d = 0)
    x[-1, :32] *= 1e3  # a block far larger than the rest of its row
    a = quant.quantize_array(w, fmt)
    panels = rows_matmul.pack_quantized(fmt, **{k: jnp.asarray(v) for k, v in a.items()})
    return x, a, panels


def _quantize_rows(x):
    """x [M, K] -> (q int [M, K / 32, 32], d float32 [M, K / 32]): d = max |x| / 127 and
    q = round-half-even(x * (1 / d)), in float32 as the kernel does; zero blocks give 0."""
    b = x.reshape(x.shape[0], -1, 32)
    d = np.abs(b).max(-1) / np.float32(127)
    inv = np.where(d == 0, np.float32(0), np.float32(1) / np.where(d == 0, 1, d)).astype(np.float32)
    q = np.rint(b * inv[..., None])
    assert np.abs(q).max() <= 127
    return q.astype(np.int64), d.astype(np.float32)


def _reference(fmt, x, a):
    """(the q8 product in exact arithmetic over the kernel's integer sums, the sum of the
    absolute values of its terms): y = sum_b d_x d_w (sum q_w q_x [- 8 s]) [+ m d_x s]."""
    qx, dx = _quantize_rows(x)  # [M, nb, 32], [M, nb]
    q = quant._unpack(np, fmt, a["quants"]).astype(np.int64)  # [nb, 32, N]
    if fmt == "q4_0":
        q = q - 8
    dot = np.einsum("mbk,bkn->mbn", qx, q)  # exact integer sums per (row, block, column)
    dw = a["scales"].astype(np.float64)[None]  # [1, nb, N]
    terms = [dx.astype(np.float64)[..., None] * dw * dot]
    if fmt == "q4_1":
        s = qx.sum(-1).astype(np.float64)  # [M, nb]
        terms.append(a["mins"].astype(np.float64)[None] * (dx * s)[..., None])
    y = sum(t.sum(1) for t in terms)
    return y, sum(np.abs(t).sum(1) for t in terms)


@native
@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("M", [*range(1, 9), 12, 17])
def test_q8_activations_equal_the_integer_reference(fmt, M):
    """Equal to the exact sum over the blocks' integer products up to float32 rounding: one
    rounding of d_w * d_x and one per accumulated block (and the minimum's term for q4_1).
    M = 12, 17: more rows than one register block (8 at a time, then the rest)."""
    x, a, panels = _case(fmt, M, seed=M)
    y = np.asarray(rows_matmul.matmul_quantized(jnp.asarray(x), panels, N, fmt, "q8"))
    ref, mag = _reference(fmt, x, a)
    nb = K // 32
    err = np.abs(y - ref)
    assert (err <= (2 * nb + 4) * 2.0**-24 * mag + 1e-30).all(), err.max()
    # the activations were quantized: far from the float32-activation product
    yf = np.asarray(rows_matmul.matmul_quantized(jnp.asarray(x), panels, N, fmt, "f32"))
    assert np.abs(yf - y).max() > 100 * err.max()


@native
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_q8_rows_independent_of_blocking(fmt):
    """The rows of an M-row call equal M one-row calls bit for bit (one row and several take
    different kernels, with the same integer sums and float steps per block): a request's
    tokens do not depend on what shares its batch."""
    x, _, panels = _case(fmt, 17, seed=30)
    x = jnp.asarray(x)
    single = np.concatenate(
        [np.asarray(rows_matmul.matmul_quantized(x[m : m + 1], panels, N, fmt)) for m in range(17)]
    )
    for M in [2, 3, 5, 8, 9, 12, 17]:
        y = np.asarray(rows_matmul.matmul_quantized(x[:M], panels, N, fmt))
        np.testing.assert_array_equal(y, single[:M], err_msg=f"M={M}")


def _rounding_bound(x, w):
    """Per output: sum over blocks of (d_x / 2) * sum |w| of the block: each activation moves
    by at most half its block's step when quantized."""
    _, dx = _quantize_rows(x)
    wsum = np.abs(w).reshape(-1, 32, w.shape[1]).sum(1)  # [nb, N]
    return (dx.astype(np.float64) / 2) @ wsum


@native
@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("M", [1, 4, 8])
def test_q8_activations_within_the_rounding_bound_of_f32(fmt, M):
    x, a, panels = _case(fmt, M, seed=10 + M)
    wq = quant.dequantize_array(fmt, **a)
    y8 = np.asarray(rows_matmul.matmul_quantized(jnp.asarray(x), panels, N, fmt, "q8"))
    yf = np.asarray(rows_matmul.matmul_quantized(jnp.asarray(x), panels, N, fmt, "f32"))
    bound = _rounding_bound(x, wq)
    slack = 1e-5 * (np.abs(x) @ np.abs(wq))  # both products' float32 sums
    assert (np.abs(y8 - yf) <= bound * (1 + 1e-5) + slack).all()
    assert (np.abs(y8 - yf) / bound).max() > 0.02  # the bound is not vacuous


@native
@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_q8_activations_threaded_panels(fmt):
    """Over the one-thread limit: panels shared with XLA's pool, the activations quantized once
    by the calling thread and read by all."""
    k, n = 1024, 1000
    x, a, panels = _case(fmt, 5, seed=20, k=k, n=n)
    y = np.asarray(rows_matmul.matmul_quantized(jnp.asarray(x), panels, n, fmt, "q8"))
    ref, mag = _reference(fmt, x, a)
    assert (np.abs(y - ref) <= (2 * k // 32 + 4) * 2.0**-24 * mag + 1e-30).all()


def test_bad_activations_are_value_errors():
    panels = jnp.zeros((1, 2, rows_matmul.block_bytes("q8_0")), jnp.uint8)
    with pytest.raises(ValueError, match="activations.*int8"):
        rows_matmul.matmul_quantized(jnp.ones((1, 64)), panels, 8, "q8_0", "int8")
    with pytest.raises(ValueError, match="activations.*bf16"):
        quant.set_activations(_layer(), "bf16")
    layer = quant.set_activations(_layer(), "f32")
    assert layer.activations == "f32" and quant.set_activations(layer, None).activations is None


def _layer():
    return quant.QuantLinear("q4_1", quant.quantize_array(np.ones((32, 8), np.float32), "q4_1"))
