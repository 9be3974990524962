"""``impl="native"``: the attention step of :func:`pallas_attn.attention_with_kvcache` on the
CPU backend as one C++ kernel, ``pallas_attn/native/kv_attention.cc`` (what ``"auto"`` runs
there where it applies).

The blockwise jnp path gathers each row's pages into a contiguous copy, transposes it for the
products and runs an online softmax as a loop of small XLA ops: on a decode step of the
development VM that is 40-150 us per layer for what is a few microseconds of arithmetic. The
kernel reads each key and value row once, in place through the block table (or the contiguous
row), for all ``Tq x G`` queries of a KV head, in any cache dtype (FP8 descaled on the fly),
with every mask of the API (window, causal, leftpad, tree). Used when the kernels are built
(:func:`pallas_attn.native.available`) and ``Tq x G <= MAX_ROWS``; the cache write stays the
jnp scatter. ``ENABLED = False`` (or ``PALLAS_ATTN_NATIVE=0``) makes ``"auto"`` take the
blockwise ``"xla"`` path instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn import cache, native

ENABLED = True
MAX_ROWS = 128  # queries per (batch row, KV head): Tq * Hq / Hkv


def eligible(q, k_cache) -> bool:
    """Whether a call with these q [B, Tq, Hq, D] and caches takes the native kernel."""
    Tq, Hq = q.shape[1], q.shape[2]
    return (
        ENABLED
        and jax.default_backend() == "cpu"
        and Tq * (Hq // k_cache.shape[2]) <= MAX_ROWS
        and native.available()
    )


def attention(static: cache.Static, args: cache.CacheArgs, q, k_cache, v_cache, *, Tn: int):
    """``(out [B, Tq, Hq, D] in q's dtype, lse [B, Hq, Tq] float32)`` over the caches as written
    (new keys included: ``Tn`` of them), with :func:`cache.key_range`'s positions."""
    B, Tq = q.shape[:2]
    ranges = cache.key_range(args, Tq, Tn)
    table = cache.row_index(args, B)
    if table.ndim == 1:  # contiguous: each row is one page of the whole capacity
        table = table[:, None]
    ones = jnp.ones((B, k_cache.shape[2]), jnp.float32)
    descale = jnp.stack(
        [
            ones if args.k_descale is None else args.k_descale.astype(jnp.float32),
            ones if args.v_descale is None else args.v_descale.astype(jnp.float32),
        ]
    )
    tree = jnp.zeros((0,), jnp.int32) if args.tree_mask is None else args.tree_mask
    left, right = static.window
    i32 = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.int32), (B,))  # noqa: E731
    out, lse = jax.ffi.ffi_call(
        native.KV_ATTENTION,
        (
            jax.ShapeDtypeStruct(q.shape, jnp.float32),
            jax.ShapeDtypeStruct((B, q.shape[2], Tq), jnp.float32),
        ),
        vmap_method="sequential",
    )(
        q.astype(jnp.float32),
        k_cache,
        v_cache,
        table.astype(jnp.int32),
        i32(ranges.q_offset),
        i32(ranges.kv_start),
        i32(ranges.kv_len),
        descale,
        tree.astype(jnp.int32),
        scale=np.float32(static.softmax_scale),
        softcap=np.float32(static.softcap),
        left=np.int64(left),
        right=np.int64(right),
    )
    return out.astype(q.dtype), lse
