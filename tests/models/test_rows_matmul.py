"""The packed-panel few-row product (models/rows_matmul.cc) against a float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import rows_matmul

pytestmark = pytest.mark.skipif(
    not rows_matmul.available(), reason="rows_matmul kernel not built (no C++ compiler)"
)


def _case(M, K, N, wdtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = jnp.asarray(rng.standard_normal((K, N)).astype(np.float32)).astype(wdtype)
    ref = x.astype(np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    return jnp.asarray(x), w, ref


@pytest.mark.parametrize("M", [1, 2, 3, 7, 8, 9, 17, 64])
@pytest.mark.parametrize("K,N", [(1, 1), (5, 31), (40, 32), (64, 33), (257, 100), (80, 1000)])
@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16])
def test_matches_reference(M, K, N, wdtype):
    x, w, ref = _case(M, K, N, wdtype)
    f = jax.jit(rows_matmul.matmul, static_argnums=(2, 3))
    panels = rows_matmul.pack(w)
    y = f(x, panels, N, "f32")
    assert y.shape == (M, N) and y.dtype == jnp.float32
    # float32 accumulation over K terms of unit variance: errors ~ sqrt(K) * 2^-24 * |x||w|
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    if wdtype == jnp.bfloat16:
        # "f32" widens each weight: the float32 panels' sums of the same values, bit for bit
        w32 = rows_matmul.pack(w.astype(jnp.float32))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(f(x, w32, N, "f32")))
        # "bf16" (the default): x = hi + lo in bfloat16, |x - hi - lo| <= 2^-17 |x|
        bound = 2.0**-17 * np.abs(np.asarray(x, np.float64)) @ np.abs(_f64(w))
        err = np.abs(np.asarray(f(x, panels, N, None)) - ref)
        assert np.all(err <= bound + 1e-5 * np.abs(ref) + 1e-5 * np.sqrt(K))


def _f64(w):
    return np.asarray(w.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("M,K,N", [(1, 576, 200), (5, 81, 64), (8, 256, 1000), (17, 77, 130)])
def test_bf16_dot_products(M, K, N):
    """The bfloat16 pair dot products: exact products (float32 sums) for activations that are
    already bfloat16; two passes for float32 ones, which differ from the widened "f32" sums
    where the CPU runs vdpbf16ps (and equal them bit for bit where it falls back)."""
    x, w, _ = _case(M, K, N, jnp.bfloat16, seed=3)
    panels = rows_matmul.pack(w)
    f = jax.jit(rows_matmul.matmul, static_argnums=(2, 3))
    xb = x.astype(jnp.bfloat16).astype(jnp.float32)
    ref = np.asarray(xb, np.float64) @ _f64(w)
    scale = np.abs(np.asarray(xb, np.float64)) @ np.abs(_f64(w))
    err = np.abs(np.asarray(f(xb, panels, N, "bf16")) - ref)
    assert np.all(err <= 2.0**-20 * scale)  # float32 sums over exact products
    dot, exact = np.asarray(f(x, panels, N, "bf16")), np.asarray(f(x, panels, N, "f32"))
    if rows_matmul.bf16_dot_available():
        assert not np.array_equal(dot, exact)
    else:
        np.testing.assert_array_equal(dot, exact)
    # Each row's sums do not depend on the rows beside it (the kernels group rows per M).
    for xs in (x, xb):
        rows = [np.asarray(f(xs[m : m + 1], panels, N, "bf16")) for m in range(M)]
        np.testing.assert_array_equal(np.asarray(f(xs, panels, N, "bf16")), np.concatenate(rows))


_TILE_SCRIPT = """
import sys, numpy as np, jax, jax.numpy as jnp
from models import rows_matmul
x, w = np.load(sys.argv[1]), np.load(sys.argv[2])
panels = rows_matmul.pack(jnp.asarray(w).astype(jnp.bfloat16))
y = jax.jit(rows_matmul.matmul, static_argnums=(2, 3))(jnp.asarray(x), panels, w.shape[1], "bf16")
np.save(sys.argv[3], np.asarray(y))
"""


@pytest.mark.skipif(not rows_matmul.amx_available(), reason="no AMX-BF16 on this CPU")
def test_tile_products_against_dot_products(tmp_path):
    """On an AMX CPU the "bf16" products run on the tile unit (all row counts, full 16-pair steps
    and a last partial one, odd K): the same error bounds as vdpbf16ps's (PALLAS_ATTN_AMX=0, in a
    child process: the choice is made once per process), and not its bits, so the tiles ran."""
    import os
    import subprocess
    import sys

    M, K, N = 37, 2 * 16 * 3 + 2 * 5 + 1, 130  # three full steps, then 5 pairs and an odd row
    x, w, _ = _case(M, K, N, jnp.bfloat16, seed=4)
    xb = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))
    wf = np.asarray(w.astype(jnp.float32))
    out = {}
    for env in ("1", "0"):
        for name, xs in (("exact", xb), ("split", np.asarray(x))):
            paths = [tmp_path / f"{n}.npy" for n in ("x", "w", f"y{env}{name}")]
            np.save(paths[0], xs)
            np.save(paths[1], wf)
            env_vars = {**os.environ, "PALLAS_ATTN_AMX": env}
            subprocess.run(
                [sys.executable, "-c", _TILE_SCRIPT, *map(str, paths)],
                check=True,
                env=env_vars,
                timeout=300,
            )
            out[env, name] = np.load(paths[2])
    for name, xs in (("exact", xb), ("split", np.asarray(x))):
        ref = np.asarray(xs, np.float64) @ _f64(w)
        scale = np.abs(np.asarray(xs, np.float64)) @ np.abs(_f64(w))
        bound = (2.0**-20 if name == "exact" else 2.0**-17 + 2.0**-20) * scale
        for env in ("1", "0"):
            assert np.all(np.abs(out[env, name] - ref) <= bound), (env, name)
        assert not np.array_equal(out["1", name], out["0", name])


@pytest.mark.parametrize("K,N", [(77, 70), (576, 200)])
@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16])
def test_rows_independent_of_blocking(K, N, wdtype):
    """Each output is one column's sum over k = 0, 1, .. in order, whatever rows share its call
    (the kernels block rows and columns differently for each M): the rows of an M-row call equal
    M one-row calls bit for bit, and the float64 product within float32 rounding."""
    rows = rows_matmul.MAX_ROWS
    x, w, ref = _case(rows, K, N, wdtype, seed=2)
    f = jax.jit(rows_matmul.matmul, static_argnums=(2, 3))
    panels = rows_matmul.pack(w)
    single = np.concatenate([np.asarray(f(x[m : m + 1], panels, N, "f32")) for m in range(rows)])
    np.testing.assert_allclose(single, ref, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    for M in [*range(1, 10), 13, 17, 33, rows]:
        np.testing.assert_array_equal(np.asarray(f(x[:M], panels, N, "f32")), single[:M])


@pytest.mark.parametrize("M", [1, 4, 8, 13])
@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16])
def test_threaded_panels(M, wdtype):
    """Weights over the kernel's one-thread limit (1 MiB): the panels are shared out between the
    calling thread and XLA's pool; every column lands exactly once."""
    K, N = 512, 1000 if wdtype == jnp.float32 else 2000
    x, w, ref = _case(M, K, N, wdtype, seed=1)
    f = jax.jit(rows_matmul.matmul, static_argnums=2)
    panels = rows_matmul.pack(w)
    for _ in range(3):
        np.testing.assert_allclose(np.asarray(f(x, panels, N)), ref, rtol=1e-5, atol=3e-4)


def test_leading_axes_and_inside_loops():
    """[B, T, K] inputs, and the product inside lax.while_loop (as in decoding)."""
    x, w, ref = _case(6, 96, 70, jnp.float32)
    panels = rows_matmul.pack(w)
    y = rows_matmul.matmul(x.reshape(2, 3, 96), panels, 70)
    np.testing.assert_allclose(np.asarray(y).reshape(6, 70), ref, rtol=1e-5, atol=1e-4)

    def body(c):
        i, acc = c
        return i + 1, acc + rows_matmul.matmul(x, panels, 70)

    _, acc = jax.jit(
        lambda: jax.lax.while_loop(lambda c: c[0] < 3, body, (0, jnp.zeros((6, 70))))
    )()
    np.testing.assert_allclose(np.asarray(acc), 3 * ref, rtol=1e-5, atol=3e-4)


def test_pack_layout():
    w = jnp.arange(3 * 40, dtype=jnp.float32).reshape(3, 40)
    p = rows_matmul.pack(w)
    assert p.shape == (2, 3, 32)
    np.testing.assert_array_equal(p[0], w[:, :32])
    np.testing.assert_array_equal(p[1, :, :8], w[:, 32:])
    assert not np.any(p[1, :, 8:])
    assert rows_matmul.pack(w.astype(jnp.float16)).dtype == jnp.float32
    # bfloat16: rows in pairs [32 columns, 2], an odd K padded with a zero row
    b = rows_matmul.pack(w.astype(jnp.bfloat16))
    assert b.shape == (2, 4, 32) and b.dtype == jnp.bfloat16
    pairs = np.asarray(b.astype(jnp.float32)).reshape(2, 2, 32, 2)
    np.testing.assert_array_equal(pairs[0, 0], np.asarray(w[0:2, :32]).T)
    np.testing.assert_array_equal(pairs[0, 1, :, 0], np.asarray(w[2, :32]))
    np.testing.assert_array_equal(pairs[1, 0, :8], np.asarray(w[0:2, 32:]).T)
    assert not np.any(pairs[:, 1, :, 1]) and not np.any(pairs[1, :, 8:])


def test_bad_arguments():
    x, w, _ = _case(2, 8, 40, jnp.float32)
    panels = rows_matmul.pack(w)
    with pytest.raises(ValueError, match="panels"):
        rows_matmul.matmul(x, panels, 70)  # n needs 3 panels
    with pytest.raises(ValueError, match="panels"):
        rows_matmul.matmul(x[:, :7], panels, 40)
    with pytest.raises(ValueError, match="at most 64"):
        rows_matmul.matmul(jnp.zeros((65, 8)), panels, 40)
    with pytest.raises(ValueError, match="activations"):
        rows_matmul.matmul(x, panels, 40, activations="bf16")  # float32 weights
    with pytest.raises(ValueError, match="activations"):
        rows_matmul.matmul(x, rows_matmul.pack(w.astype(jnp.bfloat16)), 40, activations="q8")


def test_kernel_format():
    """The kernel numbers the fused layer passes: distinct per (format, activations), the
    defaults where activations is None, ValueErrors naming a bad argument."""
    codes = {
        (f, a): rows_matmul.kernel_format(f, a)
        for f, acts in [("float32", ["f32"]), ("bfloat16", ["f32", "bf16"])]
        + [(q, list(rows_matmul.ACTIVATIONS)) for q in rows_matmul.FORMATS]
        for a in acts
    }
    assert len(set(codes.values())) == len(codes)
    assert rows_matmul.kernel_format("bfloat16") == codes["bfloat16", "bf16"]
    assert rows_matmul.kernel_format("q4_0") == codes["q4_0", rows_matmul.DEFAULT_ACTIVATIONS]
    with pytest.raises(ValueError, match="fmt"):
        rows_matmul.kernel_format("float16")
    with pytest.raises(ValueError, match="activations"):
        rows_matmul.kernel_format("q8_0", "bf16")


def test_unavailable_without_compiler(monkeypatch, tmp_path):
    """No compiler: build() says why, available() warns and callers keep XLA's product."""
    from pallas_attn import native

    monkeypatch.setenv("PALLAS_ATTN_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(RuntimeError, match="failed"):
        native.build()
    with pytest.warns(UserWarning, match="unavailable"):
        assert native.available.__wrapped__() is False
    monkeypatch.setenv("PALLAS_ATTN_NATIVE", "0")
    assert native.available.__wrapped__() is False


def test_packed_once_per_array():
    """``packed`` packs a concrete array once while it lives; a new array is packed anew, and a
    dead one's entry goes with it."""
    import gc

    w = jnp.arange(8 * 40, dtype=jnp.float32).reshape(8, 40)
    a = rows_matmul.packed(w)
    assert rows_matmul.packed(w) is a
    np.testing.assert_array_equal(a, rows_matmul.pack(w))
    np.testing.assert_array_equal(rows_matmul.packed(w, transpose=True), rows_matmul.pack(w.T))
    w2 = w + 1
    np.testing.assert_array_equal(rows_matmul.packed(w2), rows_matmul.pack(w2))
    key = (id(w2), False)
    del w2
    gc.collect()
    assert key not in rows_matmul._PACKED


def test_decode_loop_lowers_for_cuda_without_the_native_kernels():
    """A decode step with packed weights and the native attention, lowered for CUDA from this
    CPU (deviceless GPU compiles): the CPU-only FFI targets are left out of that program."""
    from flax import nnx

    from models import KVCache, Transformer, TransformerConfig
    from models.transformer import attach_decode_weights, pack_decode_weights

    config = TransformerConfig.preset("tiny", attn_impl="auto", dim=256, mlp_dim=512)
    model = Transformer(config, rngs=nnx.Rngs(0))
    model.fused_decode = False  # the per-product targets (test_fused_decode: the fused layer's)
    kernels = pack_decode_weights(model)
    assert kernels  # the qkv, gate_up and down kernels are packed
    graphdef, params = nnx.split(model)
    cache = KVCache.contiguous(config, 2, 16)

    def step(params, kernels, tokens, cache):
        return attach_decode_weights(nnx.merge(graphdef, params), kernels)(tokens, cache=cache)[0]

    traced = jax.jit(step).trace(params, kernels, jnp.zeros((2, 1), jnp.int32), cache)
    cpu_text = traced.lower().as_text()
    assert "pallas_attn_rows_matmul" in cpu_text and "pallas_attn_kv_attention" in cpu_text
    cuda_text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "pallas_attn_" not in cuda_text


def test_quantized_decode_loop_lowers_for_cuda_without_the_native_kernels():
    """The same for a block-quantized model: the CPU program runs the quantized kernel, the CUDA
    one dequantizes in the program (convert + multiply + dot) with no CPU-only target."""
    from flax import nnx

    import models
    from models import KVCache, Transformer, TransformerConfig
    from models.transformer import attach_decode_weights, pack_decode_weights

    config = TransformerConfig.preset("tiny", attn_impl="auto", dim=256, mlp_dim=512)
    model = models.quantize(Transformer(config, rngs=nnx.Rngs(0)), "q4_1")
    model.fused_decode = False  # the per-product targets (test_fused_decode: the fused layer's)
    kernels = pack_decode_weights(model)
    graphdef, params = nnx.split(model)
    cache = KVCache.contiguous(config, 2, 16)

    def step(params, kernels, tokens, cache):
        return attach_decode_weights(nnx.merge(graphdef, params), kernels)(tokens, cache=cache)[0]

    traced = jax.jit(step).trace(params, kernels, jnp.zeros((2, 1), jnp.int32), cache)
    assert "pallas_attn_rows_matmul_q" in traced.lower().as_text()
    cuda_text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "pallas_attn_" not in cuda_text and "stablehlo.dot_general" in cuda_text


def test_huge_pages_keep_the_contents(monkeypatch):
    """``huge_pages`` (MADV_COLLAPSE over the buffer, rounded out to 2 MiB) is best effort: a
    bool, the array's bytes unchanged, and off under PALLAS_ATTN_HUGE_PAGES=0."""
    w = jnp.asarray(np.random.default_rng(0).standard_normal((576, 2048)), jnp.float32)
    panels = rows_matmul.pack(w).block_until_ready()
    before = np.asarray(panels).copy()
    assert isinstance(rows_matmul.huge_pages(panels), bool)
    np.testing.assert_array_equal(np.asarray(panels), before)
    assert not rows_matmul.huge_pages(jnp.zeros(8))  # under one huge page: nothing asked
    rows_matmul._madvise.cache_clear()
    monkeypatch.setenv("PALLAS_ATTN_HUGE_PAGES", "0")
    try:
        assert not rows_matmul.huge_pages(panels)
    finally:
        rows_matmul._madvise.cache_clear()
