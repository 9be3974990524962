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

import jax
import jax.numpy as jnp

from pallas_attn import validation
from pallas_attn.heuristics import BlockSizes
from pallas_attn.kernels import flash_bwd, flash_fwd
from pallas_attn.kernels import flash_common as fc


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _tile(block: int, n: int, name: str) -> int:
    """A tile no larger than needed for length ``n`` (at least 16, Triton's dot minimum)."""
    if block < 16 or block & (block - 1):
        raise ValueError(f"BlockSizes.{name} must be a power of two >= 16, got {block}")
    return min(block, max(16, _next_pow2(n)))


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
    Tp = _round_up(T, max(cfg.block_q, cfg.block_q_bwd))
    Sp = _round_up(S, max(cfg.block_k, cfg.block_k_bwd))
    Dp = max(16, _next_pow2(D))

    def per_batch(x, default):
        return jnp.broadcast_to(jnp.asarray(default if x is None else x, jnp.int32), (B,))

    meta = jnp.stack(
        [
            per_batch(q_offset, S - T),
            per_batch(kv_start, 0),
            jnp.minimum(per_batch(kv_len, S), S),
            jnp.zeros((B,), jnp.int32),
        ],
        axis=1,
    )
    aux = {"meta": meta}
    if cfg.segments:
        aux["q_seg"] = jnp.pad(q_segment_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)))
        aux["kv_seg"] = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, Sp - S)))

    def pad(x, n):
        return jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, Dp - D)))

    out, lse = _attend(cfg, pad(q, Tp), pad(k, Sp), pad(v, Sp), aux)
    return out[:, :T, :, :D], lse[:, :, :T]


def _forward(cfg: fc.Config, q, k, v, aux):
    return flash_fwd.forward(cfg, q, k, v, aux["meta"], aux.get("q_seg"), aux.get("kv_seg"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(cfg: fc.Config, q, k, v, aux):
    return _forward(cfg, q, k, v, aux)


def _attend_fwd(cfg: fc.Config, q, k, v, aux):
    out, lse = _attend(cfg, q, k, v, aux)  # not _forward: a second derivative meets the guard
    return (out, lse), (q, k, v, aux, out, lse)


def _attend_bwd(cfg: fc.Config, res, cotangents):
    q, k, v, aux, out, lse = res
    impl = "interpret" if cfg.interpret else "pallas"
    guarded = validation.first_order_only(impl, (q, k, v, out, lse, *cotangents))
    q, k, v, out, lse, d_out, d_lse = guarded
    # Preprocess: delta = rowsum(dO * O) - dlse, [B, Hq, Tp] float32.
    delta = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - d_lse
    lse2 = jnp.where(jnp.isfinite(lse), lse * fc.LOG2E, 0.0)
    dq, dk, dv = flash_bwd.backward(
        cfg, q, k, v, d_out.astype(q.dtype), lse2, delta, aux["meta"], aux.get("q_seg"),
        aux.get("kv_seg"),
    )  # fmt: skip
    return dq, dk, dv, None


_attend.defvjp(_attend_fwd, _attend_bwd)
