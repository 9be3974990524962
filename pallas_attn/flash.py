"""Glue for the Pallas flash-attention kernels: padding, per-batch metadata and the custom VJP.

``attention`` pads T, S and D so the kernels only see full tiles (T to the query tile, S to the
key tile, D to a power of two >= 16, as Triton's ``dot`` needs), runs
:mod:`pallas_attn.kernels.flash_fwd`, and differentiates through
:mod:`pallas_attn.kernels.flash_bwd` with a ``jax.custom_vjp``. The backward preprocess
``delta = rowsum(dO * O) - dlse`` is one fused XLA reduction (O(T) memory), so the lse is
differentiable too.

Padding is harmless: padded keys lie past ``kv_len`` and are masked; padded query rows and head
dims are sliced off, and their zero cotangents contribute nothing to dK/dV.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_attn import shapes, softmax, validation
from pallas_attn.heuristics import BlockSizes
from pallas_attn.kernels import flash_bwd, flash_fwd
from pallas_attn.kernels import flash_common as fc


def _tile(block: int, n: int, name: str) -> int:
    """A tile no larger than needed for length ``n`` (at least 16, Triton's dot minimum)."""
    if block < 16 or block & (block - 1):
        raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {block}")
    return min(block, shapes.next_pow2(n, floor=16))


def make_config(block_sizes: BlockSizes, T: int, S: int, **static) -> fc.Config:
    """Clamps the tiles to the problem (a 7-row query needs no 128-row tile)."""
    bs = block_sizes
    return fc.Config(
        **static,
        block_q=_tile(bs.block_q, T, "block_q"),
        block_k=_tile(bs.block_k, S, "block_k"),
        block_q_bwd=_tile(bs.block_q_bwd, T, "block_q_bwd"),
        block_k_bwd=_tile(bs.block_k_bwd, S, "block_k_bwd"),
        num_warps=bs.num_warps,
        num_stages=bs.num_stages,
    )


def attention(
    q,
    k,
    v,
    *,
    softmax_scale: float,
    window: tuple[int, int],
    softcap: float,
    q_segment_ids=None,
    kv_segment_ids=None,
    block_sizes: BlockSizes,
    interpret: bool,
    q_offset=None,
    kv_start=None,
    kv_len=None,
):
    """Flash attention with the Pallas kernels; arguments as :func:`pallas_attn.reference.attention`.

    Args:
      q: [B, T, Hq, D]; k, v: [B, S, Hkv, D].
      q_offset, kv_start, kv_len: ints or [B] int arrays (traced is fine); defaults ``S - T``,
        ``0``, ``S``. Key positions outside ``[kv_start, kv_len)`` are hidden.
      block_sizes: tiles (powers of two >= 16) and Triton ``num_warps``/``num_stages``.
      interpret: run the kernels with the Pallas interpreter (any backend).

    Returns:
      out [B, T, Hq, D] in q's dtype; lse [B, Hq, T] float32. Differentiable in q, k, v and lse.
    """
    B, T, Hq, D = q.shape
    S = k.shape[1]
    cfg = make_config(
        block_sizes,
        T,
        S,
        softmax_scale=float(softmax_scale),
        window=tuple(int(w) for w in window),
        softcap=float(softcap),
        segments=q_segment_ids is not None,
        interpret=bool(interpret),
    )
    Tp = shapes.round_up(T, max(cfg.block_q, cfg.block_q_bwd))
    Sp = shapes.round_up(S, max(cfg.block_k, cfg.block_k_bwd))
    Dp = shapes.next_pow2(D, floor=16)
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
    meta = ranges.meta(fc.META_WIDTH)  # one small load per program
    aux = _Aux(meta, ranges.q_seg, ranges.kv_seg)

    def pad(x, n):
        return shapes.pad_axis(shapes.pad_axis(x, 1, n), 3, Dp)

    out, lse = _attend(cfg, pad(q, Tp), pad(k, Sp), pad(v, Sp), aux)
    return out[:, :T, :, :D], lse[:, :, :T]


class _Aux(NamedTuple):
    """Non-differentiable inputs of the kernels."""

    meta: jax.Array  # [B, META_WIDTH] int32
    q_seg: jax.Array | None  # [B, Tp] int32
    kv_seg: jax.Array | None  # [B, Sp] int32


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(cfg: fc.Config, q, k, v, aux: _Aux):
    return flash_fwd.forward(cfg, q, k, v, *aux)


def _attend_fwd(cfg: fc.Config, q, k, v, aux: _Aux):
    # _attend, not the kernel itself: differentiating this again meets the backward's guard.
    out, lse = _attend(cfg, q, k, v, aux)
    return (out, lse), (q, k, v, aux, out, lse)


def _attend_bwd(cfg: fc.Config, res, cotangents):
    q, k, v, aux, out, lse = res
    impl = "interpret" if cfg.interpret else "pallas"
    guarded = validation.first_order_only(impl, (q, k, v, out, lse, *cotangents))
    q, k, v, out, lse, d_out, d_lse = guarded
    # Preprocess: delta = rowsum(dO * O) - dlse, [B, Hq, Tp] float32.
    delta = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - d_lse
    lse2 = jnp.where(jnp.isfinite(lse), lse * softmax.LOG2E, 0.0)
    dq, dk, dv = flash_bwd.backward(cfg, q, k, v, d_out.astype(q.dtype), lse2, delta, *aux)
    return dq, dk, dv, None


_attend.defvjp(_attend_fwd, _attend_bwd)
