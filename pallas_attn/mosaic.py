"""Glue for the Mosaic GPU flash-attention kernels: checks, padding and the custom VJP.

``attention`` pads T to the query tile, S to the key tile and D to a multiple of 64 (one 128-byte
swizzled SMEM row of 16-bit values, what TMA and wgmma take), runs
:mod:`pallas_attn.kernels.mosaic.flash_fwd`, and differentiates through
:mod:`pallas_attn.kernels.mosaic.flash_bwd` with a ``jax.custom_vjp``; the backward preprocess
``delta = rowsum(dO * O) - dlse`` is one XLA reduction, as for the Triton kernels
(:mod:`pallas_attn.flash`). Padded keys lie at positions ``>= S`` and are masked; padded query
rows and head dims are sliced off, and their zero cotangents contribute nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_attn import shapes, softmax, validation
from pallas_attn.heuristics import BlockSizes
from pallas_attn.kernels.mosaic import common as mc
from pallas_attn.kernels.mosaic import flash_bwd, flash_fwd

FORWARD_ROWS = flash_fwd.CONSUMERS * mc.WGMMA_ROWS  # query rows per forward CTA


def check_supported(q, *, block_sizes: BlockSizes | None, varlen: bool = False):
    """What the Mosaic kernels take, checked before any tracing: 16-bit inputs (wgmma's operand
    types), D <= 128, the tiles of :func:`default_blocks` (key tiles 64 or 128 in the forward, 32
    or 64 in the backward; 64 in the dQ kernel with per-row lengths, whose edge tiles are zeroed
    in registers of the 64-row wgmma layout)."""
    if not any(jnp.dtype(q.dtype) == jnp.dtype(d) for d in mc.DTYPES):
        raise TypeError(
            f'impl="mosaic" takes bfloat16 or float16 inputs (wgmma operands), got '
            f'{jnp.dtype(q.dtype).name}; use impl="pallas" for float32'
        )
    if q.shape[-1] > mc.MAX_HEAD_DIM:
        raise ValueError(
            f'impl="mosaic" takes head dims up to {mc.MAX_HEAD_DIM} (the float32 accumulators of '
            f'D = 256 spill on sm_90a), got D={q.shape[-1]}; use impl="pallas"'
        )
    if block_sizes is not None:
        bs = block_sizes
        if bs.block_q != FORWARD_ROWS:
            raise ValueError(
                f'impl="mosaic" needs block_q = {FORWARD_ROWS} (two consumer warpgroups of '
                f"{mc.WGMMA_ROWS} rows), got {bs.block_q}"
            )
        if (
            bs.block_k not in (64, 128)
            or bs.block_q_bwd not in (32, 64)
            or bs.block_k_bwd not in (32, 64)
        ):
            raise ValueError(
                f'impl="mosaic" needs block_k in (64, 128), block_q_bwd and block_k_bwd in '
                f"(32, 64), got {bs.block_k}, {bs.block_q_bwd}, {bs.block_k_bwd}"
            )
        if varlen and bs.block_k_bwd != mc.WGMMA_ROWS:
            raise ValueError(
                f'impl="mosaic" with per-row lengths (varlen) needs block_k_bwd = '
                f"{mc.WGMMA_ROWS}, got {bs.block_k_bwd}"
            )


def default_blocks(head_dim: int) -> BlockSizes:
    """Mosaic tiles: forward 128 query rows (two consumer warpgroups) by 64 keys; backward 64-row
    blocks (one warpgroup) against 32 queries (dK/dV) or 64 keys (dQ)."""
    del head_dim  # one tile for every D <= 128 (benchmarks/results/gpu_compile_h200.json)
    return BlockSizes(block_q=FORWARD_ROWS, block_k=64, block_q_bwd=32, block_k_bwd=64)


def attention(
    q,
    k,
    v,
    *,
    softmax_scale: float,
    window,
    softcap: float,
    q_segment_ids=None,
    kv_segment_ids=None,
    block_sizes: BlockSizes | None,
    interpret: bool,
    q_offset=None,
    kv_start=None,
    kv_len=None,
):
    """Flash attention with the Mosaic GPU kernels.

    Args:
      q: [B, T, Hq, D]; k, v: [B, S, Hkv, D], bfloat16 or float16 (checked by
        :func:`check_supported`).
      window: ``(left, right)`` after :func:`pallas_attn.masks.normalize_window`.
      q_segment_ids, kv_segment_ids: [B, T] and [B, S] ints, or None (packed sequences).
      q_offset, kv_start, kv_len: ints or [B] int arrays (traced is fine), or None (defaults
        ``S - T``, ``0``, ``S``): query row ``i`` sits at key position ``q_offset + i``, keys
        outside ``[kv_start, kv_len)`` are hidden (varlen). Given, the kernels read them per row.
      interpret: run under JAX's GPU interpreter (any backend) instead of compiling for sm_90a.

    Returns:
      out [B, T, Hq, D] in q's dtype; lse [B, Hq, T] float32. Differentiable in q, k, v and lse.
    """
    B, T, Hq, D = q.shape
    S = k.shape[1]
    bs = block_sizes or default_blocks(D)
    cfg = mc.Config(
        softmax_scale=float(softmax_scale),
        window=tuple(int(w) for w in window),
        softcap=float(softcap),
        T=T,
        S=S,
        block_q=bs.block_q,
        block_k=bs.block_k,
        block_q_bwd=bs.block_q_bwd,
        block_k_bwd=bs.block_k_bwd,
        interpret=bool(interpret),
        segments=q_segment_ids is not None,
        varlen=any(x is not None for x in (q_offset, kv_start, kv_len)),
    )
    # Row blocks of every kernel are 64 (one warpgroup); the other tiles divide 64 or are 128.
    Tp = shapes.round_up(T, max(mc.WGMMA_ROWS, cfg.block_q, cfg.block_q_bwd))
    Sp = shapes.round_up(S, max(mc.WGMMA_ROWS, cfg.block_k, cfg.block_k_bwd))
    Dp = shapes.round_up(D, mc.HEAD_DIM_MULTIPLE)

    def pad(x, n):
        return shapes.pad_axis(shapes.pad_axis(x, 1, n), 3, Dp)

    # Padded queries and keys get segment 0 (padded keys lie past kv_len and are masked anyway).
    ranges = shapes.row_ranges(
        q.shape,
        S,
        Tp,
        Sp,
        q_offset=q_offset,
        kv_start=kv_start,
        kv_len=kv_len,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    meta = ranges.meta(mc.META_WIDTH) if cfg.varlen else None
    aux = (ranges.q_seg, ranges.kv_seg, meta)
    out, lse = _attend(cfg, pad(q, Tp), pad(k, Sp), pad(v, Sp), aux)
    return out[:, :T, :, :D], lse[:, :, :T]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(cfg: mc.Config, q, k, v, aux):
    """``aux``: the non-differentiable ``(q_seg, kv_seg, meta)``, each an array or None."""
    return flash_fwd.forward(cfg, q, k, v, *aux)


def _attend_fwd(cfg: mc.Config, q, k, v, aux):
    out, lse = _attend(cfg, q, k, v, aux)
    return (out, lse), (q, k, v, out, lse, aux)


def _attend_bwd(cfg: mc.Config, res, cotangents):
    impl = "mosaic_interpret" if cfg.interpret else "mosaic"
    *res, aux = res
    q, k, v, out, lse, d_out, d_lse = validation.first_order_only(impl, (*res, *cotangents))
    delta = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - d_lse
    lse2 = jnp.where(jnp.isfinite(lse), lse * softmax.LOG2E, 0.0)
    grads = flash_bwd.backward(cfg, q, k, v, d_out.astype(q.dtype), lse2, delta, *aux)
    return (*grads, None)


_attend.defvjp(_attend_fwd, _attend_bwd)
