"""What the flash forward and backward kernels share: the static config, scores, masks, block ranges.

Scores live in the base-2 domain inside the kernels (:mod:`pallas_attn.softmax`):
``s2 = log2(e) * scale * Q K^T`` (after the softcap), so every exponential is an ``exp2``; the lse
handed between kernels is ``log2(e) * lse``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu

from pallas_attn import masks, softmax

# Row layout of the per-batch int32 metadata array [B, META_WIDTH] passed to every kernel.
Q_OFFSET, KV_START, KV_LEN = 0, 1, 2
META_WIDTH = 4


@dataclasses.dataclass(frozen=True)
class Config:
    """Static (hashable) kernel parameters; jit caches by it.

    ``segments`` says whether segment-id refs are passed to the kernels.
    """

    softmax_scale: float
    window: tuple[int, int]
    softcap: float
    segments: bool
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    num_warps: int
    num_stages: int
    interpret: bool


def compiler_params(cfg: Config) -> plgpu.CompilerParams:
    """Triton compiler params; passed explicitly, as the default GPU backend is Mosaic GPU."""
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def dot_nt(a, b):
    """``a @ b.T`` with float32 accumulation: [M, K] x [N, K] -> [M, N]."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def dot_nn(a, b):
    """``a @ b`` with float32 accumulation: [M, K] x [K, N] -> [M, N]."""
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def scores(cfg: Config, a, b):
    """Base-2 scores ``log2(e) * cap(scale * a b^T)`` [M, N] float32, and ``tanh`` (softcap only)."""
    return softmax.scale_scores(dot_nt(a, b), cfg.softmax_scale, cfg.softcap)


def pv(p, v):
    """``p @ v`` for :func:`pallas_attn.softmax.step`: probabilities in v's dtype, float32 sum."""
    return dot_nn(p.astype(v.dtype), v)


def tile_visible(cfg: Config, q_pos, k_pos, kv_start, kv_len, q_seg=None, kv_seg=None):
    """Boolean tile mask, the :func:`pallas_attn.masks.visible` rule (broadcasting positions)."""
    return masks.visible(
        q_pos,
        k_pos,
        window=cfg.window,
        kv_start=kv_start,
        kv_len=kv_len,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
    )


def zero_unowned_rows(start, kv_start, kv_len, *tiles):
    """Zeroes the rows of ``[bk, D]`` key/value tiles (keys ``start + [0, bk)``) that lie outside
    ``[kv_start, kv_len)``: memory the row does not own may hold NaN (:func:`masks.key_owned`)."""
    k_pos = positions(start, tiles[0].shape[0])[:, None]  # [bk, 1]
    return masks.zero_unowned(masks.key_owned(k_pos, kv_start, kv_len), *tiles)


def key_block_range(cfg: Config, q_first, q_last, kv_start, kv_len, block_k: int, num_blocks: int):
    """Key blocks ``[lo, hi)`` that queries at positions ``q_first..q_last`` may see."""
    lo, hi = masks.key_range(q_first, q_last, window=cfg.window, kv_start=kv_start, kv_len=kv_len)
    lo = jnp.clip(lo, 0, num_blocks * block_k)
    hi = jnp.clip(hi, lo, num_blocks * block_k)
    return lax.div(lo, block_k), lax.div(hi + block_k - 1, block_k)


def query_block_range(
    cfg: Config, k_first, k_last, q_offset, kv_start, kv_len, block_q, num_blocks
):
    """Query blocks ``[lo, hi)`` whose rows may see a key in ``k_first..k_last``.

    Inverts the window: key ``j`` is visible from positions ``j - right .. j + left``; a row ``i``
    sits at position ``q_offset + i``. Keys outside ``[kv_start, kv_len)`` are seen by no row.
    """
    left, right = cfg.window
    k_first = jnp.maximum(k_first, kv_start)
    k_last = jnp.minimum(k_last, kv_len - 1)
    rows = num_blocks * block_q
    lo = jnp.int32(0) if right < 0 else jnp.clip(k_first - right - q_offset, 0, rows)
    hi = jnp.int32(rows) if left < 0 else jnp.clip(k_last + left + 1 - q_offset, 0, rows)
    hi = jnp.maximum(jnp.minimum(hi, jnp.maximum(k_last - k_first + 1, 0) * rows), lo)
    return lax.div(lo, block_q), lax.div(hi + block_q - 1, block_q)


def full_key_blocks(cfg: Config, q_first, q_last, kv_start, kv_len, block_k: int):
    """Key blocks ``[lo, hi)`` that every query at positions ``q_first..q_last`` fully sees.

    Those tiles need no mask. The keys every query sees are ``key_range`` with the roles of the
    first and last query swapped. With segment ids no tile is known to be fully visible.
    """
    if cfg.segments:
        return jnp.int32(0), jnp.int32(0)
    lo, hi = masks.key_range(q_last, q_first, window=cfg.window, kv_start=kv_start, kv_len=kv_len)
    lo, hi = jnp.maximum(lo, 0), jnp.maximum(hi, 0)
    return lax.div(lo + block_k - 1, block_k), lax.div(hi, block_k)


def full_query_blocks(
    cfg: Config, k_first, k_last, q_offset, kv_start, kv_len, block_q, num_blocks
):
    """Query blocks ``[lo, hi)`` whose rows all see every key in ``k_first..k_last`` (no mask)."""
    if cfg.segments:
        return jnp.int32(0), jnp.int32(0)
    left, right = cfg.window
    rows = num_blocks * block_q
    lo = jnp.int32(0) if right < 0 else jnp.clip(k_last - right - q_offset, 0, rows)
    hi = jnp.int32(rows) if left < 0 else jnp.clip(k_first + left + 1 - q_offset, 0, rows)
    # No row sees all these keys unless kv_start <= k_first and k_last < kv_len.
    inside = jnp.minimum(k_first - kv_start, kv_len - 1 - k_last) + 1
    hi = jnp.minimum(hi, jnp.maximum(inside, 0) * rows)
    return lax.div(lo + block_q - 1, block_q), lax.div(hi, block_q)


def split_loop(cfg: Config, lo, hi, full, body, carry):
    """``fori_loop`` of ``body(j, carry, masked)`` over blocks ``[lo, hi)``.

    Blocks inside ``full = (full_lo, full_hi)`` run with ``masked=False`` (no mask arithmetic);
    the ones before and after it with ``masked=True``.
    """
    if cfg.segments:
        return lax.fori_loop(lo, hi, lambda j, c: body(j, c, True), carry)
    a = jnp.clip(full[0], lo, hi)
    b = jnp.clip(full[1], a, hi)
    carry = lax.fori_loop(lo, a, lambda j, c: body(j, c, True), carry)
    carry = lax.fori_loop(a, b, lambda j, c: body(j, c, False), carry)
    return lax.fori_loop(b, hi, lambda j, c: body(j, c, True), carry)


def positions(start, n: int):
    """``start + [0, n)`` as int32."""
    return start + jnp.arange(n, dtype=jnp.int32)
