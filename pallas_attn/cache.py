"""What every KV-cache path shares: options, per-row arguments, FP8, cache addressing, the jnp write.

Addressing (:func:`locate`) is the one rule from a row's logical key position ``pos`` to a slot:
``cache[row, pos]`` for a contiguous cache ``[Bc, S, Hkv, D]`` (``row = cache_batch_idx[b]`` or
``b``), ``cache[block_table[b, pos // P], pos % P]`` for a paged one ``[num_pages, P, Hkv, D]``.
The reference, the "xla" path and both Pallas kernels (append, decode) call it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_attn import native, rotary

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0


@dataclasses.dataclass(frozen=True)
class Static:
    """Hashable options of one call (jit static arguments)."""

    softmax_scale: float
    window: tuple[int, int]  # normalised: causal folded in
    softcap: float
    rotary_interleaved: bool
    capacity: int  # keys a row can hold: S, or max_blocks * P when paged


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


class KeyRange(NamedTuple):
    """Keys ``[kv_start, kv_len)`` of each row; query ``i`` sits at key position ``q_offset + i``."""

    q_offset: jax.Array  # [B] int32
    kv_start: jax.Array  # [B] int32
    kv_len: jax.Array  # [B] int32


def capacity(cache_shape, block_table) -> int:
    """Keys one row can hold: ``S`` contiguous, ``max_blocks * P`` paged."""
    return cache_shape[1] * (1 if block_table is None else block_table.shape[1])


def is_fp8(cache) -> bool:
    return jnp.dtype(cache.dtype) == jnp.dtype(FP8_DTYPE)


def is_narrow(q, cache) -> bool:
    """A 16-bit float cache under float32 queries (half the bytes a decode step reads)."""
    return jnp.dtype(q.dtype) == jnp.float32 and jnp.dtype(cache.dtype) in (
        jnp.dtype(jnp.bfloat16),
        jnp.dtype(jnp.float16),
    )


def quantize(x, descale):
    """x: real values -> FP8 ``x / descale`` saturated to +-448 (descale broadcast against x)."""
    return jnp.clip(x.astype(jnp.float32) / descale, -FP8_MAX, FP8_MAX)


def row_index(args: CacheArgs, B: int):
    """What :func:`locate` indexes with: the [B, max_blocks] block table (paged), else the [B]
    cache row of each batch row."""
    if args.block_table is not None:
        return args.block_table
    return jnp.arange(B, dtype=jnp.int32) if args.cache_batch_idx is None else args.cache_batch_idx


def locate(pos, cache_shape, *, row=None, page_of=None, max_blocks: int = 0):
    """Logical key positions -> ``(idx0, idx1, ok)``: slot ``cache[idx0, idx1]`` of each position.

    Contiguous (``row``: the cache row, broadcastable against ``pos``): ``(row, pos)``. Paged
    (``page_of(block)`` reads the block table at in-range block numbers; ``max_blocks`` its width):
    ``(page, pos % P)``. The indices are always in bounds (safe to load or gather); ``ok`` is False
    where the slot does not exist (``pos`` past the capacity or negative, a block-table entry
    outside ``[0, num_pages)``).
    """
    if page_of is None:
        S = cache_shape[1]
        ok = (pos >= 0) & (pos < S)
        return jnp.broadcast_to(row, jnp.shape(pos)), jnp.clip(pos, 0, S - 1), ok
    num_pages, P = cache_shape[0], cache_shape[1]
    blk = pos // P
    page = page_of(jnp.clip(blk, 0, max_blocks - 1))
    ok = (pos >= 0) & (blk < max_blocks) & (page >= 0) & (page < num_pages)
    return jnp.clip(page, 0, num_pages - 1), pos % P, ok


def key_range(args: CacheArgs, Tq: int, Tn: int) -> KeyRange:
    """Keys ``[cache_leftpad, cache_seqlens + Tn)``; query ``i`` at ``cache_seqlens + Tn - Tq + i``."""
    kv_len = args.cache_seqlens + Tn
    return KeyRange(kv_len - Tq, args.cache_leftpad, kv_len)


def rotary_positions(args: CacheArgs, T: int, *, per_token: bool):
    """[B, T] positions ``cache_seqlens - cache_leftpad (+ t if per_token)``."""
    base = args.cache_seqlens - args.cache_leftpad
    t = jnp.arange(T, dtype=jnp.int32) if per_token else jnp.zeros((T,), jnp.int32)
    return base[:, None] + t[None, :]


def rotate(static: Static, args: CacheArgs, x, *, per_token: bool):
    """Rotary on q (``per_token`` when causal or windowed) or on the new keys (always per token)."""
    if args.rotary_cos is None:
        return x
    positions = rotary_positions(args, x.shape[1], per_token=per_token)
    return rotary.apply(
        x, args.rotary_cos, args.rotary_sin, positions, interleaved=static.rotary_interleaved
    )


def rotate_queries(static: Static, args: CacheArgs, q):
    """Query ``i`` at ``cache_seqlens - cache_leftpad (+ i when causal or windowed)``."""
    return rotate(static, args, q, per_token=static.window != (-1, -1))


def set_rows(x, i0, i1, values):
    """``x.at[i0, i1].set(values, mode="drop")`` (values cast to ``x``'s dtype; i0, i1 int
    arrays of one shape S, values [*S, *x.shape[2:]]). On CPU a 16-bit float ``x`` (bfloat16,
    float16) is written by a native kernel, in place (``pallas_attn/native/cache_write.cc``):
    XLA:CPU computes such a scatter in float32, widening and narrowing the whole of ``x`` (for a
    KV pool, every page of the layer per prefill chunk)."""
    values = jnp.asarray(values).astype(x.dtype)

    def plain(x, i0, i1, values):
        return x.at[i0, i1].set(values, mode="drop")

    if not (native.widened_on_cpu(x.dtype) and native.available()):
        return plain(x, i0, i1, values)
    n = math.prod(jnp.shape(i0))

    def flat(i, dim):  # negative indices count from the end, as jnp's indexing
        i = jnp.broadcast_to(jnp.asarray(i, jnp.int32), jnp.shape(i0)).reshape(n)
        return jnp.where(i < 0, i + dim, i)

    def fast(x, i0, i1, values):
        return jax.ffi.ffi_call(
            native.CACHE_WRITE, jax.ShapeDtypeStruct(x.shape, x.dtype), input_output_aliases={0: 0}
        )(x, flat(i0, x.shape[0]), flat(i1, x.shape[1]), values.reshape(n, *x.shape[2:]))

    return native.on_cpu(fast, plain, x, i0, i1, values)


def write(static: Static, args: CacheArgs, k_cache, v_cache, k, v):
    """The jnp cache write (reference and "xla"): rotary on the new keys, FP8 quantisation, and a
    ``mode="drop"`` scatter to positions ``cache_seqlens + t`` (in place under donation)."""
    k = rotate(static, args, k, per_token=True)
    if is_fp8(k_cache):
        k = quantize(k, args.k_descale[:, None, :, None])
        v = quantize(v, args.v_descale[:, None, :, None])
    B, Tn = k.shape[:2]
    pos = args.cache_seqlens[:, None] + jnp.arange(Tn, dtype=jnp.int32)[None, :]  # [B, Tn]
    index = row_index(args, B)
    if args.block_table is None:
        idx0, idx1, ok = locate(pos, k_cache.shape, row=index[:, None])
    else:
        page_of = lambda blk: jnp.take_along_axis(index, blk, axis=1)  # noqa: E731
        idx0, idx1, ok = locate(pos, k_cache.shape, page_of=page_of, max_blocks=index.shape[1])
    idx0 = jnp.where(ok, idx0, k_cache.shape[0])  # out of bounds: the scatter drops it
    k_cache = set_rows(k_cache, idx0, idx1, k)
    v_cache = set_rows(v_cache, idx0, idx1, v)
    return k_cache, v_cache


def rows(args: CacheArgs, cache):
    """[B, S, Hkv, D] keys (or values) of each batch row, in the cache's dtype (a gather).

    Paged: ``S = max_blocks * P``, the row's pages in block-table order (entries clamped: pages
    past a row's length are gathered but lie outside its key range).
    """
    if args.block_table is not None:
        table = jnp.clip(args.block_table, 0, cache.shape[0] - 1)
        B, max_blocks = table.shape
        return cache[table].reshape(B, max_blocks * cache.shape[1], *cache.shape[2:])
    if args.cache_batch_idx is not None:
        return cache[args.cache_batch_idx]
    return cache


def attention_inputs(args: CacheArgs, k_cache, v_cache):
    """Per-row keys and values to attend over, dequantised (``stored * descale``) when FP8."""
    k_rows, v_rows = rows(args, k_cache), rows(args, v_cache)
    if is_fp8(k_cache):
        k_rows = k_rows.astype(jnp.float32) * args.k_descale[:, None, :, None]
        v_rows = v_rows.astype(jnp.float32) * args.v_descale[:, None, :, None]
    return k_rows, v_rows
