"""Flash-attention forward on Mosaic GPU (Hopper): FlashAttention-2, Alg. 1, warp-specialised as
FlashAttention-3 (a TMA producer warpgroup feeding two consumer warpgroups) with wgmma.

One CTA per (block of 128 queries, query head, batch) runs three warpgroups:

* the producer (warpgroup 2, 40 registers per thread) walks the key blocks any of the CTA's rows
  can see (:func:`flash_common.key_block_range`) and TMA-loads K and V into a ring of
  ``STAGES`` SMEM slots; before refilling a slot it waits on that slot's "free" barrier, which
  both consumers arrive on once their wgmmas have read it (and at the end it waits for the last
  releases too, so that every barrier phase is observed: the interpreter checks it);
* each consumer (warpgroups 0 and 1, 232 registers) owns 64 query rows: it TMA-loads its Q tile
  once, then per key block waits on the slot's "full" barriers, computes ``S = Q K^T`` by wgmma
  (K transposed in the descriptor), the mask and softcap in registers, FlashAttention-2's online
  softmax (:func:`pallas_attn.softmax.step`: base-2 running max ``m``, sum ``l``, accumulator
  ``acc``, float32 in registers), writes ``P`` to its SMEM tile in the input dtype and adds
  ``P V`` into ``acc`` by wgmma (in place, :func:`common.matmul_acc`). Both consumers walk the CTA's whole key range (the ring's order); blocks a
  consumer's rows cannot see run masked and add nothing (at most one block on the diagonal).
  Blocks all its rows fully see skip the mask arithmetic (:func:`flash_common.split_loop`).

With segment ids, the producer also loads each block's key segment ids into the ring (released
with the K slot) and each consumer its rows' ids once; every tile is then masked.

Varlen (per-row ``q_offset``, ``kv_start``, ``kv_len``: :func:`pallas_attn.flash_attention_varlen`
and prefill over padded rows): every warpgroup TMA-loads its batch row's metadata once into SMEM
and takes the loop bounds, the fully visible blocks and the masks from it, so a short row walks
only its own key blocks. This is not mapped onto segment ids: those would mask every tile and walk
every key block of the padded row. Keys outside ``[kv_start, kv_len)`` are memory the row does not
own (they may hold NaN): on the masked tiles each consumer multiplies ``P`` by its own copy of the
V slot with those rows zeroed (the slot itself is shared by both consumers; the full tiles, the
bulk of a long row, run as without varlen).

The end is ``out = acc / l``, ``lse = ln2 * m + ln(l)``; a row that saw no key gets out 0 and lse
``-inf``. Out and lse leave through SMEM by TMA. Inputs are padded by :mod:`pallas_attn.mosaic`:
T to a multiple of 128, S of ``block_k``, D of 64; padded keys lie at positions ``>= S`` and are
masked.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import masks, softmax
from pallas_attn.kernels import flash_common as fc
from pallas_attn.kernels.mosaic import common as mc

CONSUMERS = 2  # consumer warpgroups per CTA, 64 query rows each
STAGES = 2  # K/V ring slots
# Registers per thread of the producer and of the consumers (65536 per SM over 3 x 128 threads).
PRODUCER_REGS, CONSUMER_REGS = 40, 232


def _kernel(
    q_ref,  # [B, Tp, Hq, Dp] GMEM
    k_ref,  # [B, Sp, Hkv, Dp] GMEM
    v_ref,  # [B, Sp, Hkv, Dp] GMEM
    q_seg_ref,  # [B, Tp] int32 GMEM, segments only (else None)
    kv_seg_ref,  # [B, Sp] int32 GMEM, segments only
    meta_ref,  # [B, META_WIDTH] int32 GMEM: q_offset, kv_start, kv_len (varlen only)
    o_ref,  # [B, Tp, Hq, Dp] GMEM
    lse_ref,  # [B, Hq, Tp] float32 GMEM
    q_s,  # [2, 64, Dp] SMEM, a Q tile per consumer, reused for its output tile
    k_s,  # [STAGES, block_k, Dp] SMEM ring
    v_s,  # [STAGES, block_k, Dp] SMEM ring
    p_s,  # [2, 64, block_k] SMEM, probabilities per consumer, in the input dtype
    lse_s,  # [2, 64] float32 SMEM
    kt_s,  # [2, Dp, block_k] SMEM, K^T per consumer (interpreter only: no transposed operands)
    q_seg_s,  # [2, 64] int32 SMEM, segments only
    kv_seg_s,  # [STAGES, block_k] int32 SMEM ring, segments only
    meta_s,  # [3, META_WIDTH] int32 SMEM, a metadata row per warpgroup (varlen only)
    vz_s,  # [2, block_k, Dp] SMEM, V with unowned rows zeroed per consumer (varlen only)
    q_bar,  # [4] barriers: a Q tile per consumer, then its segment ids
    k_full,  # [STAGES] barriers: the K slot holds its block
    v_full,  # [STAGES] barriers
    seg_full,  # [STAGES] barriers: the slot's key segment ids (segments only)
    k_free,  # [STAGES] barriers, 2 arrivals: both consumers are done with the K slot
    v_free,  # [STAGES] barriers, 2 arrivals
    meta_bar,  # [3] barriers: a metadata row per warpgroup (varlen only)
    *,
    cfg: mc.Config,
    G: int,
):
    rows, bk = mc.WGMMA_ROWS, cfg.block_k
    qi, h, b, wg = (lax.axis_index(n) for n in ("q", "h", "b", "wg"))
    num_k_blocks = k_ref.shape[1] // bk
    meta = None
    if cfg.varlen:  # every warpgroup reads the row's metadata itself (no cross-group sync)
        meta = meta_s.at[wg]
        plgpu.copy_gmem_to_smem(meta_ref.at[b], meta, meta_bar.at[wg])
        plgpu.barrier_wait(meta_bar.at[wg])
    q_offset, kv_start, kv_len = mc.row_ranges(cfg, meta)
    start = mc.block_start(kv_start)
    cta_first = q_offset + qi * cfg.block_q
    lo, hi = fc.key_block_range(
        cfg, cta_first, cta_first + cfg.block_q - 1, start, kv_len, bk, num_k_blocks
    )

    @pl.when(wg == CONSUMERS)
    def _producer():
        plgpu.set_max_registers(PRODUCER_REGS, action="decrease")
        kv_h = lax.div(h, G)

        def step(j, _):
            n = j - lo
            slot = lax.rem(n, STAGES)
            keys = (b, pl.ds(pl.multiple_of(j * bk, bk), bk), kv_h)
            for src, dst, full, free in (
                (k_ref, k_s, k_full, k_free),
                (v_ref, v_s, v_full, v_free),
            ):
                pl.when(n >= STAGES)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
                plgpu.copy_gmem_to_smem(src.at[keys], dst.at[slot], full.at[slot])
                if cfg.segments and src is k_ref:  # released with the K slot
                    seg = kv_seg_ref.at[b, pl.ds(pl.multiple_of(j * bk, bk), bk)]
                    plgpu.copy_gmem_to_smem(seg, kv_seg_s.at[slot], seg_full.at[slot])

        lax.fori_loop(lo, hi, step, None)

        def drain(n, _):  # observe the consumers' last releases (every arrival is waited for)
            for free in (k_free, v_free):
                plgpu.barrier_wait(free.at[lax.rem(n, STAGES)])

        lax.fori_loop(jnp.maximum(hi - lo, STAGES) - STAGES, hi - lo, drain, None)

    @pl.when(wg < CONSUMERS)
    def _consumer():
        plgpu.set_max_registers(CONSUMER_REGS, action="increase")
        row0 = pl.multiple_of(qi * cfg.block_q + wg * rows, rows)
        q_tile, p_tile, lse_tile = q_s.at[wg], p_s.at[wg], lse_s.at[wg]
        kt = None if kt_s is None else kt_s.at[wg]
        vz = None if vz_s is None else vz_s.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, rows), h], q_tile, q_bar.at[wg])
        q_seg = None
        if cfg.segments:
            bar = q_bar.at[CONSUMERS + wg]
            plgpu.copy_gmem_to_smem(q_seg_ref.at[b, pl.ds(row0, rows)], q_seg_s.at[wg], bar)
            plgpu.barrier_wait(bar)
            q_seg = mc.bcast(mc.load_vector(cfg, q_seg_s.at[wg], 1), (rows, bk), 0)
        plgpu.barrier_wait(q_bar.at[wg])
        q_first = q_offset + row0
        full = fc.full_key_blocks(cfg, q_first, q_first + rows - 1, start, kv_len, bk)

        def pv(p, slot, acc, first=None):
            mc.store_tile(p_tile, p)
            plgpu.barrier_wait(v_full.at[slot])
            v = v_s.at[slot]
            if first is not None:  # both consumers read the slot: each zeroes its own copy
                mc.zero_unowned(cfg, first, kv_start, kv_len, v, vz)
                v = vz
            acc = mc.matmul_acc(cfg, acc, p_tile, v)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc

        def body(j, carry, masked):
            slot = lax.rem(j - lo, STAGES)
            plgpu.barrier_wait(k_full.at[slot])
            s = mc.matmul(cfg, q_tile, k_s.at[slot], transpose_b=True, scratch=kt)  # [64, bk]
            kv_seg = None
            if cfg.segments:
                plgpu.barrier_wait(seg_full.at[slot])
                kv_seg = mc.bcast(mc.load_vector(cfg, kv_seg_s.at[slot], 0), s.shape, 1)
            plgpu.barrier_arrive(k_free.at[slot])
            s2, _ = softmax.scale_scores(s, cfg.softmax_scale, cfg.softcap)
            mask = None
            if masked:
                q_pos = q_first + mc.iota(cfg, s.shape, 0)
                k_pos = j * bk + mc.iota(cfg, s.shape, 1)
                mask = masks.visible(
                    q_pos,
                    k_pos,
                    window=cfg.window,
                    kv_start=kv_start,
                    kv_len=kv_len,
                    q_segment_ids=q_seg,
                    kv_segment_ids=kv_seg,
                )
            step_pv = pv
            if masked and cfg.varlen:  # a tile that may hold keys the row does not own
                step_pv = functools.partial(pv, first=j * bk)
            return softmax.step(carry, s2, slot, step_pv, mask, accumulate=True)

        m, l, acc = softmax.init((rows,), q_tile.shape[-1])
        carry = (mc.rows(cfg, m), mc.rows(cfg, l), mc.tile(cfg, acc))
        m, l, acc = fc.split_loop(cfg, lo, hi, full, body, carry)
        out, lse = softmax.finalize(m, l, acc)
        mc.store_tile(q_tile, out)
        mc.store_tile(lse_tile, lse)
        plgpu.copy_smem_to_gmem(q_tile, o_ref.at[b, pl.ds(row0, rows), h])
        plgpu.copy_smem_to_gmem(lse_tile, lse_ref.at[b, h, pl.ds(row0, rows)])
        plgpu.wait_smem_to_gmem(0)


def forward(cfg: mc.Config, q, k, v, q_seg=None, kv_seg=None, meta=None):
    """Padded forward.

    Args:
      q: [B, Tp, Hq, Dp]; k, v: [B, Sp, Hkv, Dp], bfloat16 or float16, Tp % 128 == 0
        (``cfg.block_q``), Sp % block_k == 0, Dp % 64 == 0.
      q_seg: [B, Tp], kv_seg: [B, Sp] int32 when ``cfg.segments``.
      meta: [B, META_WIDTH] int32 rows ``(q_offset, kv_start, kv_len, 0...)`` when ``cfg.varlen``.

    Returns:
      out [B, Tp, Hq, Dp] in q's dtype, lse [B, Hq, Tp] float32 (natural log).
    """
    B, Tp, Hq, Dp = q.shape
    Hkv = k.shape[2]
    rows, bk = mc.WGMMA_ROWS, cfg.block_k
    dtype = q.dtype
    scratch = (
        mc.smem((CONSUMERS, rows, Dp), dtype),
        mc.smem((STAGES, bk, Dp), dtype),
        mc.smem((STAGES, bk, Dp), dtype),
        mc.smem((CONSUMERS, rows, bk), dtype),
        plgpu.SMEM((CONSUMERS, rows), jnp.float32),
        plgpu.SMEM((CONSUMERS, Dp, bk), dtype) if cfg.interpret else None,
        plgpu.SMEM((CONSUMERS, rows), jnp.int32) if cfg.segments else None,
        plgpu.SMEM((STAGES, bk), jnp.int32) if cfg.segments else None,
        plgpu.SMEM((CONSUMERS + 1, mc.META_WIDTH), jnp.int32) if cfg.varlen else None,
        mc.smem((CONSUMERS, bk, Dp), dtype) if cfg.varlen else None,
        plgpu.Barrier(num_barriers=2 * CONSUMERS),
        plgpu.Barrier(num_barriers=STAGES),
        plgpu.Barrier(num_barriers=STAGES),
        plgpu.Barrier(num_barriers=STAGES) if cfg.segments else None,
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=STAGES),
        plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=STAGES),
        plgpu.Barrier(num_barriers=CONSUMERS + 1) if cfg.varlen else None,
    )
    optional = (q_seg, kv_seg, meta)
    present = tuple(x is not None for x in optional)

    def mosaic_flash_fwd(*refs):  # the kernel's name in compile reports
        refs = mc.with_optional(refs, 3, present)
        pl.run_scoped(
            lambda *scoped: _kernel(*refs, *scoped, cfg=cfg, G=Hq // Hkv),
            *scratch,
            collective_axes="wg",
        )

    return plgpu.kernel(
        mosaic_flash_fwd,
        out_type=(
            jax.ShapeDtypeStruct(q.shape, dtype),
            jax.ShapeDtypeStruct((B, Hq, Tp), jnp.float32),
        ),
        grid=(Tp // cfg.block_q, Hq, B),
        grid_names=("q", "h", "b"),
        num_threads=CONSUMERS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mc.interpret_params(cfg),
    )(q, k, v, *(x for x in optional if x is not None))
