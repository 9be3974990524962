"""KV-cache attention in plain ``jnp``: rotary, FP8 quantisation, the cache write, page gathering.

The reference composes four steps, each a small function reused by the ``"xla"`` path:

1. :func:`prepare`: rotate ``q`` and the new keys (:mod:`pallas_attn.rotary`), quantise new
   ``k``/``v`` for an FP8 cache, write them at positions ``cache_seqlens[b] + t`` of their cache row
   (through the block table when paged). A scatter with ``mode="drop"``: under buffer donation XLA
   updates the cache in place.
2. :func:`cache_rows`: each batch row's keys ``[B, S, Hkv, D]`` (a gather of its pages when paged;
   block-table entries are clamped first, and keys they stand for lie past the row's length).
3. :func:`mask_args`: ``q_offset``, ``kv_start``, ``kv_len`` in the sense of :mod:`pallas_attn.masks`.
4. :func:`pallas_attn.reference.attention` on those (never rewritten here).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_attn import reference, rotary

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class Static:
    """Hashable options of one call (jit static arguments)."""

    softmax_scale: float
    window: tuple[int, int]  # normalised: causal folded in
    softcap: float
    rotary_interleaved: bool


class CacheArgs(NamedTuple):
    """Per-row arrays of one call, already validated and filled with defaults."""

    cache_seqlens: jax.Array  # [B] int32
    cache_leftpad: jax.Array  # [B] int32
    cache_batch_idx: jax.Array | None  # [B] int32, contiguous caches only
    block_table: jax.Array | None  # [B, max_blocks] int32, paged caches only
    rotary_cos: jax.Array | None  # [max_pos, R/2]
    rotary_sin: jax.Array | None
    k_descale: jax.Array | None  # [B, Hkv] float32, FP8 caches only
    v_descale: jax.Array | None
    tree_mask: jax.Array | None = None  # [B, Tq, Tq] bool among the last Tq keys


def is_fp8(cache) -> bool:
    return jnp.dtype(cache.dtype) == jnp.dtype(FP8_DTYPE)


def quantize(x, descale):
    """x: [B, T, Hkv, D] real values -> FP8 ``x / descale`` saturated to +-448."""
    scaled = x.astype(jnp.float32) / descale[:, None, :, None]
    return jnp.clip(scaled, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def dequantize(rows, descale):
    """rows: [B, S, Hkv, D] FP8 -> float32 ``rows * descale``."""
    return rows.astype(jnp.float32) * descale[:, None, :, None]


def rotary_positions(args: CacheArgs, T: int, *, per_token: bool):
    """[B, T] positions ``cache_seqlens - cache_leftpad (+ t if per_token)``."""
    base = args.cache_seqlens - args.cache_leftpad
    t = jnp.arange(T, dtype=jnp.int32) if per_token else jnp.zeros((T,), jnp.int32)
    return base[:, None] + t[None, :]


def slots(args: CacheArgs, Tn: int, cache_shape):
    """Where new token ``t`` of row ``b`` goes: ``(idx0, idx1)`` [B, Tn] into ``cache[idx0, idx1]``.

    Contiguous: ``(cache_batch_idx[b], cache_seqlens[b] + t)``; paged: ``(page, slot)`` through the
    block table. A token past the row's capacity gets ``idx0 = cache_shape[0]`` (out of bounds, so a
    ``mode="drop"`` scatter skips it).
    """
    B = args.cache_seqlens.shape[0]
    pos = args.cache_seqlens[:, None] + jnp.arange(Tn, dtype=jnp.int32)[None, :]
    if args.block_table is None:
        rows = (
            jnp.arange(B, dtype=jnp.int32) if args.cache_batch_idx is None else args.cache_batch_idx
        )
        idx0 = jnp.broadcast_to(rows[:, None], pos.shape)
        valid = (pos >= 0) & (pos < cache_shape[1])
        return jnp.where(valid, idx0, cache_shape[0]), pos
    P = cache_shape[1]
    max_blocks = args.block_table.shape[1]
    blk = pos // P
    in_table = (pos >= 0) & (blk < max_blocks)
    page = jnp.take_along_axis(args.block_table, jnp.clip(blk, 0, max_blocks - 1), axis=1)
    valid = in_table & (page >= 0) & (page < cache_shape[0])
    return jnp.where(valid, page, cache_shape[0]), pos % P


def rotate_queries(static: Static, args: CacheArgs, q):
    """Rotary on q (if asked): query ``i`` at ``cache_seqlens - cache_leftpad (+ i when causal or
    windowed)``."""
    if args.rotary_cos is None:
        return q
    windowed = static.window != (-1, -1)
    positions = rotary_positions(args, q.shape[1], per_token=windowed)
    return rotary.apply(
        q, args.rotary_cos, args.rotary_sin, positions, interleaved=static.rotary_interleaved
    )


def prepare(static: Static, args: CacheArgs, q, k_cache, v_cache, k=None, v=None):
    """Rotary on q and new k, FP8 quantisation, cache write. Returns ``(q, k_cache, v_cache)``."""
    q = rotate_queries(static, args, q)
    if args.rotary_cos is not None and k is not None:
        k_pos = rotary_positions(args, k.shape[1], per_token=True)
        k = rotary.apply(
            k, args.rotary_cos, args.rotary_sin, k_pos, interleaved=static.rotary_interleaved
        )
    if k is not None:
        if is_fp8(k_cache):
            k, v = quantize(k, args.k_descale), quantize(v, args.v_descale)
        idx0, idx1 = slots(args, k.shape[1], k_cache.shape)
        k_cache = k_cache.at[idx0, idx1].set(k.astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[idx0, idx1].set(v.astype(v_cache.dtype), mode="drop")
    return q, k_cache, v_cache


def cache_rows(args: CacheArgs, cache):
    """[B, S, Hkv, D] keys (or values) of each batch row, in the cache's dtype.

    Paged: ``S = max_blocks * P``, the row's pages in block-table order.
    """
    if args.block_table is not None:
        table = jnp.clip(args.block_table, 0, cache.shape[0] - 1)
        B, max_blocks = table.shape
        rows = cache[table].reshape(B, max_blocks * cache.shape[1], *cache.shape[2:])
    elif args.cache_batch_idx is not None:
        rows = cache[args.cache_batch_idx]
    else:
        rows = cache
    return rows


def mask_args(args: CacheArgs, Tq: int, Tn: int) -> dict:
    """Keys ``[cache_leftpad, cache_seqlens + Tn)``; query ``i`` at ``cache_seqlens + Tn - Tq + i``."""
    kv_len = args.cache_seqlens + Tn
    return dict(q_offset=kv_len - Tq, kv_start=args.cache_leftpad, kv_len=kv_len)


def attend_kwargs(static: Static, args: CacheArgs, Tq: int, Tn: int) -> dict:
    """Keyword arguments of :func:`pallas_attn.reference.attention` (and ``xla.attention``)."""
    return dict(
        softmax_scale=static.softmax_scale,
        window=static.window,
        softcap=static.softcap,
        tree_mask=args.tree_mask,
        **mask_args(args, Tq, Tn),
    )


def attention_inputs(args: CacheArgs, k_cache, v_cache):
    """Per-row keys and values to attend over, dequantised when the cache is FP8."""
    k_rows, v_rows = cache_rows(args, k_cache), cache_rows(args, v_cache)
    if is_fp8(k_cache):
        k_rows, v_rows = dequantize(k_rows, args.k_descale), dequantize(v_rows, args.v_descale)
    return k_rows, v_rows


def attention(static: Static, args: CacheArgs, q, k_cache, v_cache, k=None, v=None):
    """Reference KV-cache attention. Returns ``(out, lse, k_cache, v_cache)``.

    out [B, Tq, Hq, D] in q's dtype, lse [B, Hq, Tq] float32, caches with the new tokens written.
    """
    Tn = 0 if k is None else k.shape[1]
    q, k_cache, v_cache = prepare(static, args, q, k_cache, v_cache, k, v)
    k_rows, v_rows = attention_inputs(args, k_cache, v_cache)
    out, lse = reference.attention(q, k_rows, v_rows, **attend_kwargs(static, args, q.shape[1], Tn))
    return out, lse, k_cache, v_cache
