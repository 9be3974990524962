"""Shared helpers for attention tests: random inputs, an independent NumPy oracle, tolerances."""

from __future__ import annotations

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
