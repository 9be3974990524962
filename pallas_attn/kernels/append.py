"""Cache append with fused rotary and FP8 quantisation, in place through ``input_output_aliases``.

One program per ``(batch row b, KV head h, block of new tokens)`` loads up to ``block_t`` new keys
and values ``[block_t, D]``, rotates the first ``R`` dims of the keys (:mod:`pallas_attn.rotary`, gathering
``cos``/``sin`` at positions ``cache_seqlens[b] - cache_leftpad[b] + t`` and each dim's pair
partner), quantises both to FP8 (``x / descale`` saturated to +-448) when the cache is FP8, and
scatters them to ``cache[idx0, idx1, h, :]`` (:func:`pallas_attn.cache.locate`):
``(cache_batch_idx[b], cache_seqlens[b] + t)`` when contiguous, ``(block_table[b, pos // P], pos % P)``
when paged. Tokens past a row's capacity, or
whose block-table entry is negative or out of range, are not written. The caches are aliased to the
outputs, so only the new slots are touched; under donation no second cache buffer exists.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn import cache, rotary, shapes


def _kernel(
    k_new_ref,  # [B, Tn, Hkv, D]
    v_new_ref,  # [B, Tn, Hkv, D]
    seqlens_ref,  # [B]
    leftpad_ref,  # [B]
    index_ref,  # contiguous: [B] cache row; paged: [B, max_blocks]
    cos_ref,  # [max_pos, R/2] or None
    sin_ref,  # [max_pos, R/2] or None
    descale_ref,  # [2, B, Hkv] float32 or None
    k_in_ref,  # aliased to k_out_ref
    v_in_ref,  # aliased to v_out_ref
    k_out_ref,  # [Bc, S, Hkv, D] or [num_pages, P, Hkv, D]: the whole cache
    v_out_ref,  # same as k_out_ref
    *,
    Tn: int,
    block_t: int,
    D: int,
    interleaved: bool,
    paged: bool,
):
    del k_in_ref, v_in_ref  # the same buffers as the outputs
    b, h, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    # Lanes past Tn or D (padding to powers of two) repeat the last token / dim exactly, so their
    # stores duplicate a real lane's store (same address, same value) instead of needing a mask.
    t = i * block_t + jnp.arange(block_t, dtype=jnp.int32)
    t = jnp.minimum(t, Tn - 1)[:, None]
    d = jnp.arange(shapes.next_pow2(D), dtype=jnp.int32)[None, :]
    if shapes.next_pow2(D) != D:
        d = jnp.minimum(d, D - 1)
    k = k_new_ref[b, t, h, d].astype(jnp.float32)
    v = v_new_ref[b, t, h, d].astype(jnp.float32)
    seqlen = seqlens_ref[b]

    if cos_ref is not None:
        pos = seqlen - leftpad_ref[b] + t  # [block_t, 1] rotary positions
        partner = lambda p: k_new_ref[b, t, h, p].astype(jnp.float32)  # noqa: E731
        k = _rotate(k, partner, cos_ref, sin_ref, pos, d, interleaved)
        k = k.astype(k_new_ref.dtype).astype(jnp.float32)  # rotated keys are in k's dtype

    if descale_ref is not None:
        k = cache.quantize(k, descale_ref[0, b, h])
        v = cache.quantize(v, descale_ref[1, b, h])

    cache_pos = seqlen + t  # [block_t, 1]
    if paged:
        page_of = lambda blk: index_ref[b, blk]  # noqa: E731
        max_blocks = index_ref.shape[1]
        idx0, idx1, store_ok = cache.locate(
            cache_pos, k_out_ref.shape, page_of=page_of, max_blocks=max_blocks
        )
    else:
        idx0, idx1, store_ok = cache.locate(cache_pos, k_out_ref.shape, row=index_ref[b])
    at = (idx0, idx1, h, d)
    store_ok = jnp.broadcast_to(store_ok, k.shape)
    plgpu.store(k_out_ref.at[at], k.astype(k_out_ref.dtype), mask=store_ok)
    plgpu.store(v_out_ref.at[at], v.astype(v_out_ref.dtype), mask=store_ok)


def _rotate(k, partner, cos_ref, sin_ref, pos, d, interleaved: bool):
    """:mod:`pallas_attn.rotary` on a [block_t, Dp] tile ``k``: dims ``d < R`` rotated with
    ``cos``/``sin`` gathered at ``pos`` (clamped to the table, which the API checked when it could);
    ``partner(dims)`` loads the pair partners."""
    R = 2 * cos_ref.shape[1]
    rot = jnp.broadcast_to(d < R, k.shape)
    d_r = jnp.minimum(d, R - 1)
    pos = jnp.clip(pos, 0, cos_ref.shape[0] - 1)
    f = rotary.frequency_index(d_r, R, interleaved)
    c = plgpu.load(cos_ref.at[pos, f], mask=rot, other=1).astype(jnp.float32)
    s = plgpu.load(sin_ref.at[pos, f], mask=rot, other=0).astype(jnp.float32)
    kp = partner(rotary.partner_index(d_r, R, interleaved))
    return k * c + rotary.sign(d_r, R, interleaved) * kp * s


@functools.partial(jax.jit, static_argnames=("interleaved", "interpret"))
def append(
    k_cache,
    v_cache,
    k,
    v,
    seqlens,
    leftpad,
    index,
    cos,
    sin,
    descale,
    *,
    interleaved: bool,
    interpret: bool,
):
    """Writes new tokens into the caches. Returns ``(k_cache, v_cache)`` (aliased, in place).

    Args:
      k_cache, v_cache: contiguous [Bc, S, Hkv, D] (``index`` [B] rows) or paged
        [num_blocks, P, Hkv, D] (``index`` [B, max_blocks] block table), q's dtype or FP8.
      k, v: [B, Tn, Hkv, D] new tokens (real values).
      seqlens, leftpad: [B] int32; new token ``t`` goes to position ``seqlens + t`` with rotary
        position ``seqlens - leftpad + t``.
      cos, sin: [max_pos, R/2] or None (no rotary).
      descale: [2, B, Hkv] float32 (k, v) for FP8 caches, else None.
    """
    B, Tn, Hkv, D = k.shape
    whole = lambda x: None if x is None else pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    block_t = min(shapes.next_pow2(Tn), 16)
    kernel = functools.partial(
        _kernel, Tn=Tn, block_t=block_t, D=D, interleaved=interleaved, paged=index.ndim == 2
    )
    operands = (k, v, seqlens, leftpad, index, cos, sin, descale, k_cache, v_cache)
    n_in = sum(x is not None for x in operands)  # None operands are not pallas_call inputs
    return pl.pallas_call(
        kernel,
        grid=(B, Hkv, pl.cdiv(Tn, block_t)),
        in_specs=[whole(x) for x in operands],
        out_specs=[whole(k_cache), whole(v_cache)],
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in (k_cache, v_cache)],
        input_output_aliases={n_in - 2: 0, n_in - 1: 1},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="kvcache_append",
    )(*operands)
