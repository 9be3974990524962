"""Flash-attention backward kernels: FlashAttention-2, Alg. 2 (Dao, 2023), in Pallas (Triton).

Both kernels recompute the probabilities tile by tile from the forward's lse,
``p = exp2(s2 - lse2)`` (base-2 scores and lse, see :mod:`pallas_attn.softmax`), and use the
preprocessed ``delta = rowsum(dO * O) - dlse`` (computed by :mod:`pallas_attn.flash`):

* ``dp = dO V^T`` and ``ds = p * (dp - delta)``, times ``1 - tanh^2`` under a softcap
  (:func:`pallas_attn.softmax.score_grad`), then the softmax scale; this covers both the output
  cotangent and the lse cotangent.
* dK/dV kernel: one program per (key block, batch, KV head). It loops over the ``G`` query heads
  of its group and over the query blocks that can see its keys, accumulating
  ``dV += p^T dO`` and ``dK += ds^T Q`` in float32 registers; GQA heads are summed inside the
  program, so no atomics and a deterministic result.
* dQ kernel: one program per (query block, batch, query head), looping over the visible key
  blocks as the forward does, accumulating ``dQ += ds K``.

Tiles that every row fully sees skip the mask arithmetic (:func:`flash_common.split_loop`).
Nothing of size T x S is materialised. Inputs are padded as for :mod:`flash_fwd`, with Tp a
multiple of ``block_q_bwd`` and Sp a multiple of ``block_k_bwd``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_attn import softmax
from pallas_attn.kernels import flash_common as fc


def _dkdv_kernel(
    meta_ref,  # [META_WIDTH] int32: q_offset, kv_start, kv_len of this batch row
    q_ref,  # [Tp, G, D]: the G query heads of this KV head
    k_ref,  # [block_k, D]
    v_ref,  # [block_k, D]
    do_ref,  # [Tp, G, D]
    lse_ref,  # [G, Tp] float32, base-2 lse
    delta_ref,  # [G, Tp] float32
    *refs,  # segments only: q_seg_ref [Tp], kv_seg_ref [block_k]; then dk_ref, dv_ref [block_k, D]
    cfg,
    G,
    nq,
):
    if cfg.segments:
        q_seg_ref, kv_seg_ref, dk_ref, dv_ref = refs
    else:
        dk_ref, dv_ref = refs
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    q_offset, kv_start, kv_len = (meta_ref[i] for i in (fc.Q_OFFSET, fc.KV_START, fc.KV_LEN))
    k_first = pl.program_id(0) * bk
    k_pos = fc.positions(k_first, bk)[:, None]  # [bk, 1]
    k, v = fc.zero_unowned_rows(k_first, kv_start, kv_len, k_ref[...], v_ref[...])  # [bk, D]
    kv_seg = kv_seg_ref[...][:, None] if cfg.segments else None
    k_last = k_first + bk - 1
    lo, hi = fc.query_block_range(cfg, k_first, k_last, q_offset, kv_start, kv_len, bq, nq)
    full = fc.full_query_blocks(cfg, k_first, k_last, q_offset, kv_start, kv_len, bq, nq)

    def q_block(i, carry, masked, g):
        dk, dv = carry
        start = pl.multiple_of(i * bq, bq)
        q = q_ref[pl.ds(start, bq), g, :]  # [bq, D]
        do = do_ref[pl.ds(start, bq), g, :]
        lse = lse_ref[g, pl.ds(start, bq)][None, :]  # [1, bq]
        delta = delta_ref[g, pl.ds(start, bq)][None, :]
        s, t = fc.scores(cfg, k, q)  # transposed tile [bk, bq]
        p = jnp.exp2(s - lse)
        if masked:
            q_pos = fc.positions(q_offset + start, bq)[None, :]
            q_seg = q_seg_ref[pl.ds(start, bq)][None, :] if cfg.segments else None
            mask = fc.tile_visible(cfg, q_pos, k_pos, kv_start, kv_len, q_seg, kv_seg)
            p = jnp.where(mask, p, 0.0)
        dv = dv + fc.dot_nn(p.astype(do.dtype), do)
        ds = softmax.score_grad(p, fc.dot_nt(v, do), delta, t)
        dk = dk + fc.dot_nn(ds.astype(q.dtype), q)
        return dk, dv

    def head(g, carry):
        return fc.split_loop(cfg, lo, hi, full, functools.partial(q_block, g=g), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, G, head, (zeros, zeros))
    dk_ref[...] = (dk * cfg.softmax_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
    meta_ref,  # [META_WIDTH] int32
    q_ref,  # [block_q, D]
    k_ref,  # [Sp, D]
    v_ref,  # [Sp, D]
    do_ref,  # [block_q, D]
    lse_ref,  # [block_q] float32, base-2 lse
    delta_ref,  # [block_q] float32
    *refs,  # segments only: q_seg_ref [block_q], kv_seg_ref [Sp]; then dq_ref [block_q, D]
    cfg,
    nk,
):
    if cfg.segments:
        q_seg_ref, kv_seg_ref, dq_ref = refs
    else:
        (dq_ref,) = refs
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    q_offset, kv_start, kv_len = (meta_ref[i] for i in (fc.Q_OFFSET, fc.KV_START, fc.KV_LEN))
    q_first = q_offset + pl.program_id(0) * bq
    q_pos = fc.positions(q_first, bq)[:, None]  # [bq, 1]
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...][:, None]
    delta = delta_ref[...][:, None]
    q_seg = q_seg_ref[...][:, None] if cfg.segments else None

    def body(j, dq, masked):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]  # [bk, D]
        v = v_ref[pl.ds(start, bk), :]
        if masked:
            k_pos = fc.positions(start, bk)[None, :]
            k, v = fc.zero_unowned_rows(start, kv_start, kv_len, k, v)
        s, t = fc.scores(cfg, q, k)  # [bq, bk]
        p = jnp.exp2(s - lse)
        if masked:
            kv_seg = kv_seg_ref[pl.ds(start, bk)][None, :] if cfg.segments else None
            mask = fc.tile_visible(cfg, q_pos, k_pos, kv_start, kv_len, q_seg, kv_seg)
            p = jnp.where(mask, p, 0.0)
        ds = softmax.score_grad(p, fc.dot_nt(do, v), delta, t)
        return dq + fc.dot_nn(ds.astype(k.dtype), k)

    q_last = q_first + bq - 1
    lo, hi = fc.key_block_range(cfg, q_first, q_last, kv_start, kv_len, bk, nk)
    full = fc.full_key_blocks(cfg, q_first, q_last, kv_start, kv_len, bk)
    dq = fc.split_loop(cfg, lo, hi, full, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.softmax_scale).astype(dq_ref.dtype)


def backward(cfg: fc.Config, q, k, v, d_out, lse2, delta, meta, q_seg=None, kv_seg=None):
    """Padded backward.

    Args:
      q, d_out: [B, Tp, Hq, Dp]; k, v: [B, Sp, Hkv, Dp].
      lse2: [B, Hq, Tp] float32, ``log2(e) * lse`` with 0 on rows that saw no key.
      delta: [B, Hq, Tp] float32, ``rowsum(dO * O) - dlse``.
      meta, q_seg, kv_seg: as for :func:`flash_fwd.forward`.

    Returns:
      dq [B, Tp, Hq, Dp], dk and dv [B, Sp, Hkv, Dp], in the input dtypes.
    """
    args = (meta, q, k, v, d_out, lse2, delta, *([q_seg, kv_seg] if cfg.segments else []))
    dk, dv = _dkdv_call(cfg, *args)
    return _dq_call(cfg, *args), dk, dv


def _dkdv_call(cfg: fc.Config, meta, q, k, v, d_out, lse2, delta, *seg_args):
    """dK, dV: grid over (key block j, batch b, KV head h); the whole group of G query heads."""
    B, Tp, Hq, Dp = q.shape
    Sp, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    group = pl.BlockSpec((None, Tp, G, Dp), lambda j, b, h: (b, 0, h, 0))
    kv_tile = pl.BlockSpec((None, bk, None, Dp), lambda j, b, h: (b, j, h, 0))
    group_rows = pl.BlockSpec((None, G, Tp), lambda j, b, h: (b, h, 0))
    seg_specs = [
        pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0)),
        pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),
    ]
    meta_spec = pl.BlockSpec((None, fc.META_WIDTH), lambda j, b, h: (b, 0))
    return pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg, G=G, nq=Tp // bq),
        grid=(Sp // bk, B, Hkv),
        in_specs=[meta_spec, group, kv_tile, kv_tile, group, group_rows, group_rows]
        + (seg_specs if cfg.segments else []),
        out_specs=[kv_tile, kv_tile],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        name="flash_bwd_dkdv",
        compiler_params=fc.compiler_params(cfg),
        interpret=cfg.interpret,
    )(meta, q, k, v, d_out, lse2, delta, *seg_args)


def _dq_call(cfg: fc.Config, meta, q, k, v, d_out, lse2, delta, *seg_args):
    """dQ: grid over (query block i, batch b, query head h), like the forward."""
    B, Tp, Hq, Dp = q.shape
    Sp, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk = cfg.block_q_bwd, cfg.block_k_bwd
    q_tile = pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0))
    kv_full = pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, h // G, 0))
    rows = pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))
    seg_specs = [
        pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
        pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0)),
    ]
    meta_spec = pl.BlockSpec((None, fc.META_WIDTH), lambda i, b, h: (b, 0))
    return pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, nk=Sp // bk),
        grid=(Tp // bq, B, Hq),
        in_specs=[meta_spec, q_tile, kv_full, kv_full, q_tile, rows, rows]
        + (seg_specs if cfg.segments else []),
        out_specs=q_tile,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="flash_bwd_dq",
        compiler_params=fc.compiler_params(cfg),
        interpret=cfg.interpret,
    )(meta, q, k, v, d_out, lse2, delta, *seg_args)
