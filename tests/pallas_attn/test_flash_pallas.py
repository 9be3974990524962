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
from attn_utils import check_close, max_err, random_qkv

from pallas_attn import BlockSizes, flash, flash_attention, flash_attention_varlen, reference

SMALL = BlockSizes(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16

# Awkward shapes (T in 1, 7, 33, 129, 200; T != S; D in 16, 40, 64, 80, 128; G in 1, 4, 8), each
# with a different option mix, and the dtype the default run uses for it. ``blocks`` overrides
# the 16-row tiles (block_q, block_k, block_q_bwd, block_k_bwd).
CASES = [
    (dict(T=1, S=1, Hq=1, Hkv=1, D=16), F32),
    (dict(T=1, S=129, Hq=8, Hkv=1, D=64, causal=True), BF16),
    (dict(T=7, S=7, Hq=4, Hkv=1, D=40, causal=True), F16),
    (dict(T=33, S=33, Hq=4, Hkv=4, D=80, window=(8, 0)), F32),
    (dict(T=33, S=129, Hq=8, Hkv=2, D=128, causal=True, softcap=5.0), BF16),
    (dict(T=129, S=33, Hq=4, Hkv=1, D=64, causal=True, blocks=(32, 16, 16, 32)), F32),
    (
        dict(T=200, S=200, Hq=8, Hkv=1, D=16, window=(17, 5), softcap=2.0, blocks=(16, 32, 32, 16)),
        BF16,
    ),
    (dict(T=200, S=129, Hq=2, Hkv=2, D=40, segments=True), F32),
    (dict(T=129, S=129, Hq=4, Hkv=1, D=64, causal=True, segments=True), BF16),
]
FLOOR = {F32: 1e-5, BF16: 1e-3, F16: 2e-4}
# Interpret-mode kernels become large XLA programs; compiling them without backend optimisation
# roughly halves this file's run time.
FAST_COMPILE = {"xla_backend_optimization_level": 0}
# Static kernel options for tests that only build a config.
_STATIC = dict(softmax_scale=1.0, window=(-1, -1), softcap=0.0, segments=False, interpret=True)


def _grad_fn(fn, *args):
    """Compiled ``grad(fn, argnums=(0, 1, 2), has_aux=True)`` for ``args``."""
    grad = jax.jit(jax.grad(fn, argnums=(0, 1, 2), has_aux=True))
    return grad.trace(*args).lower().compile(compiler_options=FAST_COMPILE)


def _case_id(case):
    return "-".join(f"{k}{v}" for k, v in case.items())


def _segments(B, T, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32)


def _run(case, dtype, seed=0):
    """(out, lse, grads) for interpret, the f32 oracle and the same-precision reference."""
    case = dict(case)
    opts = dict(
        causal=case.pop("causal", False),
        window_size=case.pop("window", (-1, -1)),
        softcap=case.pop("softcap", 0.0),
    )
    segments = case.pop("segments", False)
    blocks = BlockSizes(*case.pop("blocks", (16, 16, 16, 16)))
    B = 2
    q, k, v = random_qkv(seed, B, **case, dtype=dtype)
    if segments:
        opts["q_segment_ids"] = _segments(B, case["T"], seed)
        opts["kv_segment_ids"] = _segments(B, case["S"], seed + (case["T"] != case["S"]))
    kd, kl = jax.random.split(jax.random.key(seed + 100))
    d_out = jax.random.normal(kd, q.shape, jnp.float32).astype(dtype)
    d_lse = jax.random.normal(kl, (B, case["Hq"], case["T"]), jnp.float32)

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(lse * d_lse), (out, lse)

    window = (opts["window_size"][0], 0 if opts["causal"] else opts["window_size"][1])
    ref_kw = dict(
        softmax_scale=case["D"] ** -0.5,
        window=window,
        softcap=opts["softcap"],
        q_segment_ids=opts.get("q_segment_ids"),
        kv_segment_ids=opts.get("kv_segment_ids"),
    )
    fns = {
        "kernel": functools.partial(
            flash_attention, **opts, return_lse=True, impl="interpret", block_sizes=blocks
        ),
        "oracle": lambda q, k, v: reference.attention(
            *(x.astype(jnp.float32) for x in (q, k, v)), **ref_kw
        ),
        "same": lambda q, k, v: reference.attention(q, k, v, **ref_kw, upcast=False),
    }
    results = {}
    for name, fn in fns.items():
        grads, (out, lse) = _grad_fn(functools.partial(loss, fn), q, k, v)(q, k, v)
        results[name] = (out, lse, grads)
    return results


def _check(case, dtype):
    r = _run(case, dtype)
    out, lse, grads = r["kernel"]
    ref_out, ref_lse, ref_grads = r["oracle"]
    same_out, same_lse, same_grads = r["same"]
    floor = FLOOR[dtype]
    assert out.dtype == dtype and lse.dtype == jnp.float32
    check_close(out, ref_out, same_out, factor=2, floor=floor)
    check_close(lse, ref_lse, same_lse, factor=2, floor=1e-4)
    for name, g, g_ref, g_same in zip("qkv", grads, ref_grads, same_grads, strict=True):
        assert g.dtype == dtype, name
        check_close(g, g_ref, g_same, factor=3, floor=10 * floor)


@pytest.mark.parametrize(("case", "dtype"), CASES, ids=[_case_id(c) for c, _ in CASES])
def test_interpret_matches_reference(case, dtype):
    _check(case, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", [c for c, _ in CASES], ids=[_case_id(c) for c, _ in CASES])
def test_interpret_matches_reference_all_dtypes(case, dtype):
    _check(case, dtype)


def test_fully_masked_rows_give_zero_and_no_nan():
    # T > S with causal: the first T - S queries sit before key 0 and see nothing; the last three
    # rows have a segment with no keys.
    q, k, v = random_qkv(3, 2, 20, 8, 4, 2, 16)
    seg_q = jnp.zeros((2, 20), jnp.int32).at[:, -3:].set(7)
    seg_k = jnp.zeros((2, 8), jnp.int32)

    def f(q, k, v):
        out, lse = flash_attention(
            q, k, v, causal=True, q_segment_ids=seg_q, kv_segment_ids=seg_k, return_lse=True,
            impl="interpret", block_sizes=SMALL,
        )  # fmt: skip
        return jnp.sum(out**2), (out, lse)

    grads, (out, lse) = _grad_fn(f, q, k, v)(q, k, v)
    hidden = np.zeros((20,), bool)
    hidden[:12] = True
    hidden[-3:] = True
    assert np.all(np.asarray(out)[:, hidden] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, hidden]))
    assert np.all(np.isfinite(np.asarray(lse)[:, :, ~hidden]))
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(grads[0])[:, hidden] == 0)
    assert np.any(np.asarray(grads[0])[:, ~hidden] != 0)


def test_interpret_is_deterministic():
    q, k, v = random_qkv(4, 1, 65, 65, 4, 2, 32, dtype=BF16)
    d_out = jax.random.normal(jax.random.key(5), q.shape, BF16)

    def f(q, k, v):
        out = flash_attention(q, k, v, causal=True, impl="interpret", block_sizes=SMALL)
        return jnp.sum(out.astype(jnp.float32) * d_out), out

    g = _grad_fn(f, q, k, v)
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
    results = [_grad_fn(functools.partial(loss, fn), q, k, v)(q, k, v) for fn in (kernel, oracle)]
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
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **opts, impl="interpret",
            block_sizes=SMALL,
        )  # fmt: skip
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

    grads, (out, lse) = _grad_fn(packed, q, k, v)(q, k, v)
    ref_grads, (ref_out, ref_lse) = _grad_fn(separate, q, k, v)(q, k, v)
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
