"""Flash-attention backward on Mosaic GPU (Hopper): FlashAttention-2, Alg. 2, with TMA and wgmma.

Both kernels recompute the probabilities tile by tile from the forward's lse,
``p = exp2(s2 - lse2)`` (base-2 scores and lse, :mod:`pallas_attn.softmax`), and take the
preprocessed ``delta = rowsum(dO * O) - dlse`` (:mod:`pallas_attn.mosaic`), so the output and the
lse cotangents are both covered: ``ds = p * (dp - delta)`` (times ``1 - tanh^2`` under a
softcap, :func:`pallas_attn.softmax.score_grad`), then the softmax scale.

* dK/dV kernel: one CTA per (block of 64 keys, KV head, batch). K and V are TMA-loaded once; the kernel
  walks the ``G`` query heads of its group and, per head, the query blocks that can see its keys
  (:func:`flash_common.query_block_range`, ``block_q_bwd`` rows each: 32 keeps dK, dV and the
  transposed score tiles in registers at D = 128), double-buffering Q, dO, lse and delta (the next tile
  is in flight while one is computed). Transposed tiles: ``S^T = K Q^T``, ``P^T`` to SMEM,
  ``dV += P^T dO``, ``dP^T = V dO^T``, ``dS^T`` to SMEM, ``dK += dS^T Q``; dK and dV sum in
  float32 registers over the whole group: no atomics, a deterministic result.
* dQ kernel: one CTA per (block of 64 queries, query head, batch), walking the visible blocks of
  ``block_k_bwd`` keys as the forward does with K and V double-buffered: ``S = Q K^T``, ``dP = dO V^T``, ``dQ += dS K``.

Tiles every row fully sees skip the mask arithmetic (:func:`flash_common.split_loop`). Inputs are
padded as for :mod:`pallas_attn.kernels.mosaic.flash_fwd`. Varlen as there: both kernels read
their batch row's ``(q_offset, kv_start, kv_len)`` from SMEM for the loop bounds and masks, and
zero the K and V rows of keys the row does not own on edge tiles, in place (one warpgroup per
CTA), before any wgmma reads them (NaN there would reach dS, hence dQ and dK, through ``0 * NaN``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import masks, softmax
from pallas_attn.kernels import flash_common as fc
from pallas_attn.kernels.mosaic import common as mc


def _dkdv_kernel(
    q_ref,  # [B, Tp, Hq, Dp] GMEM
    k_ref,  # [B, Sp, Hkv, Dp] GMEM
    v_ref,  # [B, Sp, Hkv, Dp] GMEM
    do_ref,  # [B, Tp, Hq, Dp] GMEM
    lse_ref,  # [B, Hq, Tp] float32 GMEM, base-2 lse (0 on rows that saw no key)
    delta_ref,  # [B, Hq, Tp] float32 GMEM
    q_seg_ref,  # [B, Tp] int32 GMEM, segments only (else None)
    kv_seg_ref,  # [B, Sp] int32 GMEM, segments only
    meta_ref,  # [B, META_WIDTH] int32 GMEM: q_offset, kv_start, kv_len (varlen only)
    dk_ref,  # [B, Sp, Hkv, Dp] GMEM
    dv_ref,  # [B, Sp, Hkv, Dp] GMEM
    k_s,  # [64, Dp] SMEM, reused for the dK tile
    v_s,  # [64, Dp] SMEM, reused for the dV tile
    q_s,  # [2, block_q_bwd, Dp] SMEM, double-buffered
    do_s,  # [2, block_q_bwd, Dp] SMEM
    lse_s,  # [2, block_q_bwd] float32 SMEM
    delta_s,  # [2, block_q_bwd] float32 SMEM
    p_s,  # [64, block_q_bwd] SMEM: P^T, then dS^T, in the input dtype
    kv_seg_s,  # [64] int32 SMEM, segments only
    q_seg_s,  # [2, block_q_bwd] int32 SMEM, segments only
    meta_s,  # [META_WIDTH] int32 SMEM, varlen only
    kv_bar,  # [4] barriers: K, V, key segment ids, metadata (one per TMA copy in flight)
    q_bar,  # [4 or 5, 2] barriers: Q, dO, lse, delta (, query segment ids) per slot
    *,
    cfg: mc.Config,
    G: int,
):
    bq, bk = cfg.block_q_bwd, mc.WGMMA_ROWS
    kj, h, b = (lax.axis_index(n) for n in ("k", "h", "b"))
    num_q_blocks = q_ref.shape[1] // bq
    k_first = pl.multiple_of(kj * bk, bk)
    keys = (b, pl.ds(k_first, bk), h)
    plgpu.copy_gmem_to_smem(k_ref.at[keys], k_s, kv_bar.at[0])
    plgpu.copy_gmem_to_smem(v_ref.at[keys], v_s, kv_bar.at[1])
    if cfg.segments:
        plgpu.copy_gmem_to_smem(kv_seg_ref.at[b, pl.ds(k_first, bk)], kv_seg_s, kv_bar.at[2])
    if cfg.varlen:
        plgpu.copy_gmem_to_smem(meta_ref.at[b], meta_s, kv_bar.at[3])
        plgpu.barrier_wait(kv_bar.at[3])
    q_offset, kv_start, kv_len = mc.row_ranges(cfg, meta_s)
    start = mc.block_start(kv_start)
    k_last = k_first + bk - 1
    lo, hi = fc.query_block_range(cfg, k_first, k_last, q_offset, start, kv_len, bq, num_q_blocks)
    full = fc.full_query_blocks(cfg, k_first, k_last, q_offset, start, kv_len, bq, num_q_blocks)
    n_blocks = hi - lo

    def fetch(n):
        """Loads tile ``n`` of the flattened (head g, query block i) walk into slot ``n % 2``."""
        slot = lax.rem(n, 2)
        g, i = lax.div(n, n_blocks), lo + lax.rem(n, n_blocks)
        rows = (b, pl.ds(pl.multiple_of(i * bq, bq), bq), h * G + g)
        stats = (b, h * G + g, pl.ds(pl.multiple_of(i * bq, bq), bq))
        copies = (
            (q_ref, rows, q_s),
            (do_ref, rows, do_s),
            (lse_ref, stats, lse_s),
            (delta_ref, stats, delta_s),
        )
        if cfg.segments:
            copies += ((q_seg_ref, (b, rows[1]), q_seg_s),)
        for t, (src, at, dst) in enumerate(copies):
            plgpu.copy_gmem_to_smem(src.at[at], dst.at[slot], q_bar[t].at[slot])

    total = G * n_blocks
    pl.when(total > 0)(lambda: fetch(0))
    plgpu.barrier_wait(kv_bar.at[0])
    plgpu.barrier_wait(kv_bar.at[1])
    if cfg.varlen:  # the block's keys the row does not own may hold NaN: zero K and V rows

        @pl.when((k_first < kv_start) | (k_first + bk > kv_len))
        def _():
            for tile in (k_s, v_s):
                mc.zero_unowned(cfg, k_first, kv_start, kv_len, tile)

    kv_seg = None
    if cfg.segments:
        plgpu.barrier_wait(kv_bar.at[2])
        kv_seg = mc.bcast(mc.load_vector(cfg, kv_seg_s, 1), (bk, bq), 0)

    def q_block(i, carry, masked, g):
        dk, dv = carry
        n = g * n_blocks + i - lo
        slot = lax.rem(n, 2)
        pl.when(n + 1 < total)(lambda: fetch(n + 1))
        for bar in q_bar:
            plgpu.barrier_wait(bar.at[slot])
        q, do = q_s.at[slot], do_s.at[slot]
        shape = (bk, bq)
        s2, t = softmax.scale_scores(
            mc.matmul(cfg, k_s, q, transpose_b=True), cfg.softmax_scale, cfg.softcap
        )  # S^T [bk, bq]
        lse = mc.bcast(mc.load_vector(cfg, lse_s.at[slot], 0), shape, 1)
        p = jnp.exp2(s2 - lse)
        if masked:
            q_pos = q_offset + i * bq + mc.iota(cfg, shape, 1)
            k_pos = k_first + mc.iota(cfg, shape, 0)
            q_seg = None
            if cfg.segments:
                q_seg = mc.bcast(mc.load_vector(cfg, q_seg_s.at[slot], 0), shape, 1)
            mask = masks.visible(
                q_pos,
                k_pos,
                window=cfg.window,
                kv_start=kv_start,
                kv_len=kv_len,
                q_segment_ids=q_seg,
                kv_segment_ids=kv_seg,
            )
            p = jnp.where(mask, p, 0.0)
        mc.store_tile(p_s, p)
        dv = mc.matmul_acc(cfg, dv, p_s, do)
        dp = mc.matmul(cfg, v_s, do, transpose_b=True)
        delta = mc.bcast(mc.load_vector(cfg, delta_s.at[slot], 0), shape, 1)
        mc.store_tile(p_s, softmax.score_grad(p, dp, delta, t))
        dk = mc.matmul_acc(cfg, dk, p_s, q)
        return dk, dv

    def head(g, carry):
        return fc.split_loop(cfg, lo, hi, full, lambda i, c, m: q_block(i, c, m, g), carry)

    zeros = mc.tile(cfg, jnp.zeros(k_s.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, G, head, (zeros, zeros))
    mc.store_tile(k_s, dk * cfg.softmax_scale)
    mc.store_tile(v_s, dv)
    plgpu.copy_smem_to_gmem(k_s, dk_ref.at[keys])
    plgpu.copy_smem_to_gmem(v_s, dv_ref.at[keys])
    plgpu.wait_smem_to_gmem(0)


def _dq_kernel(
    q_ref,  # [B, Tp, Hq, Dp] GMEM
    k_ref,  # [B, Sp, Hkv, Dp] GMEM
    v_ref,  # [B, Sp, Hkv, Dp] GMEM
    do_ref,  # [B, Tp, Hq, Dp] GMEM
    lse_ref,  # [B, Hq, Tp] float32 GMEM, base-2 lse
    delta_ref,  # [B, Hq, Tp] float32 GMEM
    q_seg_ref,  # [B, Tp] int32 GMEM, segments only (else None)
    kv_seg_ref,  # [B, Sp] int32 GMEM, segments only
    meta_ref,  # [B, META_WIDTH] int32 GMEM: q_offset, kv_start, kv_len (varlen only)
    dq_ref,  # [B, Tp, Hq, Dp] GMEM
    q_s,  # [64, Dp] SMEM, reused for the dQ tile
    do_s,  # [64, Dp] SMEM
    lse_s,  # [64] float32 SMEM
    delta_s,  # [64] float32 SMEM
    k_s,  # [2, block_k_bwd, Dp] SMEM, double-buffered
    v_s,  # [2, block_k_bwd, Dp] SMEM
    ds_s,  # [64, block_k_bwd] SMEM, dS in the input dtype
    q_seg_s,  # [64] int32 SMEM, segments only
    kv_seg_s,  # [2, block_k_bwd] int32 SMEM, segments only
    meta_s,  # [META_WIDTH] int32 SMEM, varlen only
    q_bar,  # [6] barriers: Q, dO, lse, delta, query segment ids, metadata
    kv_bar,  # [2 or 3, 2] barriers: K, V (, key segment ids) per slot
    *,
    cfg: mc.Config,
    G: int,
):
    bq, bk = mc.WGMMA_ROWS, cfg.block_k_bwd
    qi, h, b = (lax.axis_index(n) for n in ("q", "h", "b"))
    kv_h = lax.div(h, G)
    num_k_blocks = k_ref.shape[1] // bk
    row0 = pl.multiple_of(qi * bq, bq)
    rows, stats = (b, pl.ds(row0, bq), h), (b, h, pl.ds(row0, bq))
    copies = (
        (q_ref.at[rows], q_s),
        (do_ref.at[rows], do_s),
        (lse_ref.at[stats], lse_s),
        (delta_ref.at[stats], delta_s),
    )
    if cfg.segments:
        copies += ((q_seg_ref.at[b, pl.ds(row0, bq)], q_seg_s),)
    for t, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, q_bar.at[t])
    if cfg.varlen:
        plgpu.copy_gmem_to_smem(meta_ref.at[b], meta_s, q_bar.at[5])
        plgpu.barrier_wait(q_bar.at[5])
    q_offset, kv_start, kv_len = mc.row_ranges(cfg, meta_s)
    q_first = q_offset + row0
    q_last = q_first + bq - 1
    lo, hi = fc.key_block_range(
        cfg, q_first, q_last, mc.block_start(kv_start), kv_len, bk, num_k_blocks
    )
    full = fc.full_key_blocks(cfg, q_first, q_last, mc.block_start(kv_start), kv_len, bk)

    def fetch(j):
        slot = lax.rem(j, 2)
        keys = (b, pl.ds(pl.multiple_of(j * bk, bk), bk), kv_h)
        plgpu.copy_gmem_to_smem(k_ref.at[keys], k_s.at[slot], kv_bar[0].at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_s.at[slot], kv_bar[1].at[slot])
        if cfg.segments:
            seg = kv_seg_ref.at[b, pl.ds(pl.multiple_of(j * bk, bk), bk)]
            plgpu.copy_gmem_to_smem(seg, kv_seg_s.at[slot], kv_bar[2].at[slot])

    pl.when(lo < hi)(lambda: fetch(lo))
    for t in range(len(copies)):
        plgpu.barrier_wait(q_bar.at[t])
    shape = (bq, bk)
    q_seg = None
    if cfg.segments:
        q_seg = mc.bcast(mc.load_vector(cfg, q_seg_s, 1), shape, 0)
    lse = mc.bcast(mc.load_vector(cfg, lse_s, 1), shape, 0)
    delta = mc.bcast(mc.load_vector(cfg, delta_s, 1), shape, 0)

    def body(j, dq, masked):
        slot = lax.rem(j, 2)
        pl.when(j + 1 < hi)(lambda: fetch(j + 1))
        for bar in kv_bar:
            plgpu.barrier_wait(bar.at[slot])
        k, v = k_s.at[slot], v_s.at[slot]
        if masked and cfg.varlen:  # keys the row does not own may hold NaN: zero K and V rows

            @pl.when((j * bk < kv_start) | (j * bk + bk > kv_len))
            def _():
                for tile in (k, v):
                    mc.zero_unowned(cfg, j * bk, kv_start, kv_len, tile)

        s2, t = softmax.scale_scores(
            mc.matmul(cfg, q_s, k, transpose_b=True), cfg.softmax_scale, cfg.softcap
        )
        p = jnp.exp2(s2 - lse)
        if masked:
            q_pos = q_first + mc.iota(cfg, shape, 0)
            k_pos = j * bk + mc.iota(cfg, shape, 1)
            kv_seg = None
            if cfg.segments:
                kv_seg = mc.bcast(mc.load_vector(cfg, kv_seg_s.at[slot], 0), shape, 1)
            mask = masks.visible(
                q_pos,
                k_pos,
                window=cfg.window,
                kv_start=kv_start,
                kv_len=kv_len,
                q_segment_ids=q_seg,
                kv_segment_ids=kv_seg,
            )
            p = jnp.where(mask, p, 0.0)
        dp = mc.matmul(cfg, do_s, v, transpose_b=True)
        mc.store_tile(ds_s, softmax.score_grad(p, dp, delta, t))
        return mc.matmul_acc(cfg, dq, ds_s, k)

    dq = fc.split_loop(cfg, lo, hi, full, body, mc.tile(cfg, jnp.zeros(q_s.shape, jnp.float32)))
    mc.store_tile(q_s, dq * cfg.softmax_scale)
    plgpu.copy_smem_to_gmem(q_s, dq_ref.at[rows])
    plgpu.wait_smem_to_gmem(0)


def backward(cfg: mc.Config, q, k, v, d_out, lse2, delta, q_seg=None, kv_seg=None, meta=None):
    """Padded backward.

    Args:
      q, d_out: [B, Tp, Hq, Dp]; k, v: [B, Sp, Hkv, Dp] (16-bit, padded as for the forward).
      lse2: [B, Hq, Tp] float32, ``log2(e) * lse`` with 0 on rows that saw no key.
      delta: [B, Hq, Tp] float32, ``rowsum(dO * O) - dlse``.
      q_seg: [B, Tp], kv_seg: [B, Sp] int32 when ``cfg.segments``.
      meta: [B, META_WIDTH] int32 rows ``(q_offset, kv_start, kv_len, 0...)`` when ``cfg.varlen``.

    Returns:
      dq [B, Tp, Hq, Dp], dk and dv [B, Sp, Hkv, Dp], in the input dtypes.
    """
    B, Tp, Hq, Dp = q.shape
    Sp, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    rows, bq, bk = mc.WGMMA_ROWS, cfg.block_q_bwd, cfg.block_k_bwd
    dtype = q.dtype
    params = dict(
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mc.interpret_params(cfg),
    )

    seg, varlen = cfg.segments, cfg.varlen
    optional = (q_seg, kv_seg, meta)
    present = tuple(x is not None for x in optional)
    inputs = (q, k, v, d_out, lse2, delta, *(x for x in optional if x is not None))

    def mosaic_flash_bwd_dkdv(*refs):  # the kernel's name in compile reports
        _dkdv_kernel(*mc.with_optional(refs, 6, present), cfg=cfg, G=G)

    def mosaic_flash_bwd_dq(*refs):
        _dq_kernel(*mc.with_optional(refs, 6, present), cfg=cfg, G=G)

    kv_type = jax.ShapeDtypeStruct(k.shape, dtype)
    dk, dv = plgpu.kernel(
        mosaic_flash_bwd_dkdv,
        out_type=(kv_type, kv_type),
        scratch_types=[
            mc.smem((rows, Dp), dtype, bq),
            mc.smem((rows, Dp), dtype, bq),
            mc.smem((2, bq, Dp), dtype, bq),
            mc.smem((2, bq, Dp), dtype, bq),
            plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((2, bq), jnp.float32),
            mc.smem((rows, bq), dtype),
            plgpu.SMEM((rows,), jnp.int32) if seg else None,
            plgpu.SMEM((2, bq), jnp.int32) if seg else None,
            plgpu.SMEM((mc.META_WIDTH,), jnp.int32) if varlen else None,
            plgpu.Barrier(num_barriers=4),
            [plgpu.Barrier(num_barriers=2) for _ in range(4 + seg)],
        ],
        grid=(Sp // rows, Hkv, B),
        grid_names=("k", "h", "b"),
        **params,
    )(*inputs)
    dq = plgpu.kernel(
        mosaic_flash_bwd_dq,
        out_type=jax.ShapeDtypeStruct(q.shape, dtype),
        scratch_types=[
            mc.smem((rows, Dp), dtype, bk),
            mc.smem((rows, Dp), dtype, bk),
            plgpu.SMEM((rows,), jnp.float32),
            plgpu.SMEM((rows,), jnp.float32),
            mc.smem((2, bk, Dp), dtype, bk),
            mc.smem((2, bk, Dp), dtype, bk),
            mc.smem((rows, bk), dtype),
            plgpu.SMEM((rows,), jnp.int32) if seg else None,
            plgpu.SMEM((2, bk), jnp.int32) if seg else None,
            plgpu.SMEM((mc.META_WIDTH,), jnp.int32) if varlen else None,
            plgpu.Barrier(num_barriers=6),
            [plgpu.Barrier(num_barriers=2) for _ in range(2 + seg)],
        ],
        grid=(Tp // rows, Hq, B),
        grid_names=("q", "h", "b"),
        **params,
    )(*inputs)
    return dq, dk, dv
