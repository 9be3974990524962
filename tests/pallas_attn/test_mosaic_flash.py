"""The Mosaic GPU flash kernels under JAX's GPU interpreter (``impl="mosaic_interpret"``).

FlashAttention-style tolerances against the float32 reference, as for the Triton kernels
(:func:`attn_utils.check_against_reference`: 2x the same-precision reference's error on out and
lse, 3x on dq/dk/dv, random cotangents on both). The interpreter runs every TMA copy, barrier and
wgmma as a host callback, so shapes stay small: one or two 64-row tiles; the wider cross is slow.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_utils import (
    BF16,
    F16,
    FLOOR,
    case_id,
    check_against_reference,
    check_close,
    grad_fn,
    random_qkv,
)

from pallas_attn import (
    BlockSizes,
    flash_attention,
    flash_attention_varlen,
    masks,
    reference,
    validation,
)
from pallas_attn.api import resolve, run_impl

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


def test_auto_falls_back_to_triton_where_mosaic_does_not_apply(monkeypatch):
    """On sm_90 ``"auto"`` runs the Mosaic kernels only where they take the call (D <= 128, their
    tiles; varlen included) and Triton otherwise; a forced ``"mosaic"`` still raises."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(validation, "_compute_capability", lambda: 9)
    q128, q256 = jnp.zeros((1, 8, 2, 128), BF16), jnp.zeros((1, 8, 2, 256), BF16)
    assert resolve("auto", q128, block_sizes=None) == "mosaic"
    assert resolve("auto", q128, block_sizes=None, varlen=True) == "mosaic"
    assert resolve("auto", q256, block_sizes=None) == "pallas"
    assert resolve("auto", q128, block_sizes=BlockSizes(block_q=64, block_k=64)) == "pallas"
    assert resolve("mosaic", q256, block_sizes=None) == "mosaic"
    with pytest.raises(ValueError, match="head dims up to 128"):
        flash_attention(q256, q256, q256, impl="mosaic")
    with pytest.raises(ValueError, match="impl must be one of"):
        resolve("triton", q128, block_sizes=None)


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


@pytest.mark.slow
def test_mosaic_row_ranges_have_no_races(monkeypatch):
    """The race detector on the per-row-length kernels: each warpgroup's metadata row and each
    consumer's zeroed V copy in the forward, the in-place zeroing of K and V tiles in dQ."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    from pallas_attn.kernels.mosaic import common as mc

    racy = mc.InterpretGPUParams(detect_races=True)
    monkeypatch.setattr(mc, "interpret_params", lambda cfg: racy if cfg.interpret else None)
    jax.clear_caches()
    q, k, v = random_qkv(9, 2, 128, 192, 2, 1, 64, dtype=BF16)
    kw = dict(softmax_scale=0.125, window=(-1, 0), softcap=0.0, block_sizes=None)
    kw.update(
        q_offset=jnp.array([64, 10]), kv_start=jnp.array([5, 0]), kv_len=jnp.array([190, 100])
    )

    def loss(q, k, v):
        out, _ = run_impl("mosaic_interpret", q, k, v, **kw)
        return jnp.sum(out.astype(jnp.float32))

    jax.block_until_ready(run_impl("mosaic_interpret", q, k, v, **kw))
    assert not gpu_callbacks.get_races().races_found
    jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
    assert not gpu_callbacks.get_races().races_found


def _losses(d_out, d_lse):
    """A loss with random cotangents on out and on the finite lse."""

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(finite * d_lse), (out, lse)

    return loss


def _check_three(fns, q, k, v, d_out, d_lse):
    """Runs ``fns`` ("impl", "oracle": float32 inputs, "same": same-precision) with random
    cotangents; FlashAttention-style bounds (2x on out and lse, 3x on dq, dk, dv). Returns the
    impl's (out, lse, grads)."""
    loss = _losses(d_out, d_lse)
    r = {}
    for name, fn in fns.items():
        args = (q, k, v) if name != "oracle" else tuple(x.astype(jnp.float32) for x in (q, k, v))
        grads, (out, lse) = grad_fn(functools.partial(loss, fn), *args)(*args)
        r[name] = (out, lse, grads)
    floor = FLOOR[BF16 if q.dtype == jnp.bfloat16 else F16]
    (out, lse, grads), (o_ref, l_ref, g_ref), (o_same, l_same, g_same) = r.values()
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    check_close(out, o_ref, o_same, factor=2, floor=floor)
    check_close(lse, l_ref, l_same, factor=2, floor=1e-4)
    for g, gr, gs in zip(grads, g_ref, g_same, strict=True):
        assert g.dtype == q.dtype
        check_close(g, gr, gs, factor=3, floor=10 * floor)
    return out, lse, grads


def _per_sequence(cu_q, cu_k, upcast: bool, **opts):
    """Varlen attention as a loop over sequences of the reference (one bottom-right aligned
    ``reference.attention`` each; a sequence without keys gives 0 and -inf)."""

    def attend(q, k, v):
        outs, lses = [], []
        for n in range(len(cu_q) - 1):
            qs, ks = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
            T = cu_q[n + 1] - cu_q[n]
            if cu_k[n + 1] == cu_k[n]:
                outs.append(jnp.zeros_like(q[qs]))
                lses.append(jnp.full((q.shape[1], T), -jnp.inf))
                continue
            o, s = reference.attention(q[None, qs], k[None, ks], v[None, ks], **opts, upcast=upcast)
            outs.append(o[0])
            lses.append(s[0])
        return jnp.concatenate(outs), jnp.concatenate(lses, axis=1)

    return attend


# (sequence lengths q, k, Hq, Hkv, D, options): ragged lengths with T != S per sequence, a
# sequence with no keys (its rows: out 0, lse -inf), one with no queries (slow); GQA.
VARLEN_CASES = [
    (([50, 7], [64, 0]), 2, 1, 64, dict(causal=True)),
]
VARLEN_SLOW_CASES = [
    (([130, 3, 64, 9], [60, 100, 64, 0]), 4, 2, 64, dict(window_size=(20, 10), softcap=4.0)),
    (([7, 100, 0], [150, 1, 4]), 4, 1, 128, dict(causal=True)),
]


def _check_varlen(lens, Hq, Hkv, D, opts, dtype=BF16):
    lens_q, lens_k = lens
    cu_q, cu_k = np.cumsum([0, *lens_q]), np.cumsum([0, *lens_k])
    keys = jax.random.split(jax.random.key(sum(lens_q) + D), 5)
    q = jax.random.normal(keys[0], (cu_q[-1], Hq, D)).astype(dtype)
    k, v = (jax.random.normal(x, (cu_k[-1], Hkv, D)).astype(dtype) for x in keys[1:3])
    d_out = jax.random.normal(keys[3], q.shape)
    d_lse = jax.random.normal(keys[4], (Hq, cu_q[-1]))
    causal = opts.get("causal", False)
    window = masks.normalize_window(causal, opts.get("window_size", (-1, -1)))
    ref = dict(softmax_scale=D**-0.5, window=window, softcap=opts.get("softcap", 0.0))
    fns = {
        "impl": lambda q, k, v: flash_attention_varlen(
            q,
            k,
            v,
            jnp.asarray(cu_q, jnp.int32),
            jnp.asarray(cu_k, jnp.int32),
            max(lens_q),
            max(lens_k),
            **opts,
            return_lse=True,
            impl="mosaic_interpret",
        ),
        "oracle": _per_sequence(cu_q, cu_k, True, **ref),
        "same": _per_sequence(cu_q, cu_k, False, **ref),
    }
    out, lse, grads = _check_three(fns, q, k, v, d_out, d_lse)
    for n in np.flatnonzero(np.diff(cu_k) == 0):  # no keys: out 0, lse -inf, dq 0
        rows = slice(cu_q[n], cu_q[n + 1])
        assert np.all(np.asarray(out[rows], np.float32) == 0)
        assert np.all(np.isneginf(np.asarray(lse[:, rows])))
        assert np.all(np.asarray(grads[0][rows], np.float32) == 0)


@pytest.mark.parametrize("case", VARLEN_CASES, ids=repr)
def test_mosaic_varlen_matches_reference(case):
    _check_varlen(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", VARLEN_SLOW_CASES, ids=repr)
def test_mosaic_varlen_matches_reference_slow(case):
    _check_varlen(*case, dtype=F16)


@pytest.mark.slow
def test_mosaic_row_ranges_ignore_unowned_memory():
    """Per-row ``q_offset``, ``kv_start``, ``kv_len`` through ``run_impl`` (the prefill and varlen
    padding) with NaN in every key a row does not own: within tolerance of the reference (which
    zeroes them), finite, and zero gradients for those keys (softcap: its tanh of a NaN score
    would reach dS otherwise)."""
    B, T, S, Hq, Hkv, D = 2, 70, 130, 2, 1, 64
    q, k, v = random_qkv(11, B, T, S, Hq, Hkv, D, dtype=BF16)
    ranges = dict(
        q_offset=jnp.array([30, -5], jnp.int32),
        kv_start=jnp.array([3, 0], jnp.int32),
        kv_len=jnp.array([90, 60], jnp.int32),
    )
    pos = np.arange(S)[None, :]
    owned = (pos >= np.array([[3], [0]])) & (pos < np.array([[90], [60]]))
    k, v = (jnp.where(owned[..., None, None], x, jnp.nan).astype(BF16) for x in (k, v))
    kw = dict(softmax_scale=D**-0.5, window=(-1, 0), softcap=5.0, **ranges)
    fns = {
        "impl": lambda q, k, v: run_impl("mosaic_interpret", q, k, v, block_sizes=None, **kw),
        "oracle": lambda q, k, v: reference.attention(q, k, v, **kw),
        "same": lambda q, k, v: reference.attention(q, k, v, **kw, upcast=False),
    }
    d_out = jax.random.normal(jax.random.key(12), q.shape)
    d_lse = jax.random.normal(jax.random.key(13), (B, Hq, T))
    _, _, (dq, dk, dv) = _check_three(fns, q, k, v, d_out, d_lse)
    for g in (dk, dv):
        assert np.all(np.asarray(g, np.float32)[~owned] == 0)


def test_mosaic_varlen_rejects_a_narrow_dq_key_tile():
    cu = jnp.array([0, 3, 8], jnp.int32)
    q, kv = jnp.zeros((8, 2, 64), BF16), jnp.zeros((8, 1, 64), BF16)
    bs = BlockSizes(block_q=128, block_k=64, block_q_bwd=32, block_k_bwd=32)
    attend = functools.partial(flash_attention_varlen, impl="mosaic", block_sizes=bs)
    with pytest.raises(ValueError, match="varlen"):  # raised while tracing: nothing runs
        jax.jit(lambda q, k, v: attend(q, k, v, cu, cu, 5, 5)).trace(q, kv, kv)


def test_mosaic_varlen_lowers_for_sm90():
    """The compiled path (the interpreter skips layout casts and wgmma layouts) lowers for CUDA on
    a CPU-only machine: forward and both backward kernels with per-row lengths."""
    q = jax.ShapeDtypeStruct((256, 2, 64), BF16)
    k = jax.ShapeDtypeStruct((256, 1, 64), BF16)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)

    def loss(q, k, v, cu):
        out = flash_attention_varlen(q, k, v, cu, cu, 128, 128, causal=True, impl="mosaic")
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = grad.trace(q, k, k, cu).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
