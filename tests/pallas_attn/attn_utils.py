"""Shared helpers for attention tests: random inputs, an independent NumPy oracle, tolerances."""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np


def random_qkv(seed, B, T, S, Hq, Hkv, D, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, Hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, Hkv, D), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, Hkv, D), jnp.float32).astype(dtype)
    return q, k, v


def numpy_attention(
    q,
    k,
    v,
    *,
    scale,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    q_seg=None,
    kv_seg=None,
    q_offset=None,
    kv_start=None,
    kv_len=None,
):
    """Row-by-row float64 attention with explicit loops over batch, head and query."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    out = np.zeros((B, T, Hq, D))
    lse = np.full((B, Hq, T), -np.inf)
    for b in range(B):
        off = S - T if q_offset is None else int(np.broadcast_to(q_offset, (B,))[b])
        lo = 0 if kv_start is None else int(np.broadcast_to(kv_start, (B,))[b])
        hi = S if kv_len is None else int(np.broadcast_to(kv_len, (B,))[b])
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            for i in range(T):
                pos = off + i
                keys = [
                    j
                    for j in range(lo, min(hi, S))
                    if (left < 0 or j >= pos - left)
                    and (right < 0 or j <= pos + right)
                    and (q_seg is None or q_seg[b, i] == kv_seg[b, j])
                ]
                if not keys:
                    continue
                s = np.array([q[b, i, h] @ k[b, j, kh] for j in keys]) * scale
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                m = s.max()
                p = np.exp(s - m)
                out[b, i, h] = (p[:, None] * v[b, keys, kh]).sum(0) / p.sum()
                lse[b, h, i] = m + np.log(p.sum())
    return out, lse


def max_err(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32))
    b = np.asarray(jnp.asarray(b, jnp.float32))
    finite = np.isfinite(b)
    assert np.array_equal(np.isfinite(a), finite), "non-finite entries differ"
    diff = np.where(finite, a, 0.0) - np.where(finite, b, 0.0)
    return float(np.max(np.abs(diff), initial=0.0))


def check_close(got, oracle, same_precision, *, factor, floor):
    """FlashAttention-style check: the error of ``got`` against the float32 oracle must be at most
    ``factor`` times the error of a same-precision reference, plus a small absolute floor."""
    err = max_err(got, oracle)
    base = max_err(same_precision, oracle)
    assert err <= factor * base + floor, f"error {err:.3g} > {factor} x {base:.3g} + {floor:g}"


F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
FLOOR = {F32: 1e-5, BF16: 1e-3, F16: 2e-4}

# Awkward shapes (T in 1, 7, 33, 129, 200; T != S; D in 16, 40, 64, 80, 128; G in 1, 4, 8), each
# with a different option mix, and the dtype a quick run uses for it. ``blocks`` overrides the
# 16-row tiles (block_q, block_k, block_q_bwd, block_k_bwd), so several key/query blocks, partial
# last blocks and skipped blocks are all exercised.
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
# Interpret-mode kernels become large XLA programs; compiling test programs without backend
# optimisation roughly halves the run time.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def case_id(case):
    return "-".join(f"{k}{v}" for k, v in case.items())


def grad_fn(fn, *args):
    """Compiled ``grad(fn, argnums=(0, 1, 2), has_aux=True)`` for ``args``."""
    grad = jax.jit(jax.grad(fn, argnums=(0, 1, 2), has_aux=True))
    return grad.trace(*args).lower().compile(compiler_options=FAST_COMPILE)


def random_segments(B, T, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32)


def check_against_reference(case, dtype, impl, seed=0, floor=None):
    """Runs ``flash_attention(impl=...)``, the float32 oracle and the same-precision reference on
    one case, with random cotangents on out and lse, and checks out, lse and dq/dk/dv.
    ``floor``: the absolute floor on out and lse (10x on gradients); default ``FLOOR[dtype]`` on
    out and 1e-4 on lse."""
    from pallas_attn import BlockSizes, flash_attention, reference

    case = dict(case)
    opts = dict(
        causal=case.pop("causal", False),
        window_size=case.pop("window", (-1, -1)),
        softcap=case.pop("softcap", 0.0),
    )
    segments = case.pop("segments", False)
    blocks = case.pop("blocks", (16, 16, 16, 16))  # None: the default tiles
    blocks = None if blocks is None else BlockSizes(*blocks)
    B = 2
    q, k, v = random_qkv(seed, B, **case, dtype=dtype)
    if segments:
        # Same segment layout for q and k when T == S, else ids drawn independently.
        opts["q_segment_ids"] = random_segments(B, case["T"], seed)
        opts["kv_segment_ids"] = random_segments(B, case["S"], seed + (case["T"] != case["S"]))
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
        "impl": functools.partial(
            flash_attention, **opts, return_lse=True, impl=impl, block_sizes=blocks
        ),
        "oracle": lambda q, k, v: reference.attention(
            *(x.astype(jnp.float32) for x in (q, k, v)), **ref_kw
        ),
        "same": lambda q, k, v: reference.attention(q, k, v, **ref_kw, upcast=False),
    }
    r = {}
    for name, fn in fns.items():
        # A float32 dot on a GPU defaults to TF32: the oracle asks for full precision.
        full = name == "oracle"
        with jax.default_matmul_precision("highest") if full else contextlib.nullcontext():
            grads, (out, lse) = grad_fn(functools.partial(loss, fn), q, k, v)(q, k, v)
        r[name] = (out, lse, grads)

    (out, lse, grads), (ref_out, ref_lse, ref_grads) = r["impl"], r["oracle"]
    same_out, same_lse, same_grads = r["same"]
    lse_floor = 1e-4 if floor is None else max(1e-4, floor)
    floor = FLOOR[dtype] if floor is None else floor
    assert out.dtype == dtype and lse.dtype == jnp.float32
    check_close(out, ref_out, same_out, factor=2, floor=floor)
    check_close(lse, ref_lse, same_lse, factor=2, floor=lse_floor)
    for name, g, g_ref, g_same in zip("qkv", grads, ref_grads, same_grads, strict=True):
        assert g.dtype == dtype, name
        check_close(g, g_ref, g_same, factor=3, floor=10 * floor)


def check_fully_masked_rows(impl, block_sizes):
    """Rows that see no key: out 0, lse -inf, finite gradients (zero for those rows' queries)."""
    from pallas_attn import flash_attention

    # T > S with causal: the first T - S queries sit before key 0 and see nothing; the last three
    # rows have a segment with no keys.
    q, k, v = random_qkv(3, 2, 20, 8, 4, 2, 16)
    seg_q = jnp.zeros((2, 20), jnp.int32).at[:, -3:].set(7)
    seg_k = jnp.zeros((2, 8), jnp.int32)

    def f(q, k, v):
        out, lse = flash_attention(
            q,
            k,
            v,
            causal=True,
            q_segment_ids=seg_q,
            kv_segment_ids=seg_k,
            return_lse=True,
            impl=impl,
            block_sizes=block_sizes,
        )
        return jnp.sum(out**2), (out, lse)

    grads, (out, lse) = grad_fn(f, q, k, v)(q, k, v)
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
