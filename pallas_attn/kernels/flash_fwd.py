"""Flash-attention forward kernel: FlashAttention-2, Alg. 1 (Dao, 2023), in Pallas (Triton).

One program per (query block, batch, query head). It loads its ``[block_q, D]`` query tile once and
walks only the key blocks the mask can make visible (causal/window/valid length; see
:func:`flash_common.key_block_range`); the blocks every row fully sees skip the mask arithmetic
(:func:`flash_common.split_loop`). It keeps per row the online-softmax state of
:mod:`pallas_attn.softmax` (running max ``m`` of the base-2 scores, sum ``l``, accumulator ``acc``,
float32) and ends with ``out = acc / l``, ``lse = ln2 * m + log(l)`` (natural log); a row that saw
no key gets ``out = 0``, ``lse = -inf``.

Inputs are pre-padded by :mod:`pallas_attn.flash`: T to a multiple of ``block_q``, S to a multiple
of ``block_k``, D to a power of two >= 16, so every load is a full, unmasked tile. Masked tiles
zero the K/V rows of keys outside ``[kv_start, kv_len)`` (memory the row does not own).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn import softmax
from pallas_attn.kernels import flash_common as fc


def _kernel(
    meta_ref,  # [META_WIDTH] int32: q_offset, kv_start, kv_len of this batch row
    q_ref,  # [block_q, D]
    k_ref,  # [Sp, D]
    v_ref,  # [Sp, D]
    *refs,  # segments only: q_seg_ref [block_q], kv_seg_ref [Sp]; then o_ref [block_q, D], lse_ref [block_q]
    cfg: fc.Config,
    num_k_blocks: int,
):
    if cfg.segments:
        q_seg_ref, kv_seg_ref, o_ref, lse_ref = refs
    else:
        o_ref, lse_ref = refs
    bq, bk = cfg.block_q, cfg.block_k
    q_offset, kv_start, kv_len = (meta_ref[i] for i in (fc.Q_OFFSET, fc.KV_START, fc.KV_LEN))
    q_first = q_offset + pl.program_id(0) * bq
    q_pos = fc.positions(q_first, bq)[:, None]  # [bq, 1]
    q = q_ref[...]  # [bq, D]
    q_seg = q_seg_ref[...][:, None] if cfg.segments else None

    def body(j, carry, masked):
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]  # [bk, D]
        v = v_ref[pl.ds(start, bk), :]
        mask = None
        if masked:
            k, v = fc.zero_unowned_rows(start, kv_start, kv_len, k, v)
            kv_seg = kv_seg_ref[pl.ds(start, bk)][None, :] if cfg.segments else None
            k_pos = fc.positions(start, bk)[None, :]
            mask = fc.tile_visible(cfg, q_pos, k_pos, kv_start, kv_len, q_seg, kv_seg)
        s, _ = fc.scores(cfg, q, k)  # [bq, bk]
        return softmax.step(carry, s, v, fc.pv, mask)

    q_last = q_first + bq - 1
    lo, hi = fc.key_block_range(cfg, q_first, q_last, kv_start, kv_len, bk, num_k_blocks)
    full = fc.full_key_blocks(cfg, q_first, q_last, kv_start, kv_len, bk)
    m, l, acc = fc.split_loop(cfg, lo, hi, full, body, softmax.init((bq,), q.shape[-1]))
    out, lse = softmax.finalize(m, l, acc)
    o_ref[...] = out.astype(o_ref.dtype)
    lse_ref[...] = lse


def forward(cfg: fc.Config, q, k, v, meta, q_seg=None, kv_seg=None):
    """Padded forward.

    Args:
      q: [B, Tp, Hq, Dp]; k, v: [B, Sp, Hkv, Dp] with Tp % block_q == 0, Sp % block_k == 0.
      meta: [B, META_WIDTH] int32 (q_offset, kv_start, kv_len per batch row).
      q_seg: [B, Tp], kv_seg: [B, Sp] int32 when ``cfg.segments``.

    Returns:
      out [B, Tp, Hq, Dp] in q's dtype, lse [B, Hq, Tp] float32 (natural log).
    """
    B, Tp, Hq, Dp = q.shape
    Sp, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk = cfg.block_q, cfg.block_k
    in_specs = [
        pl.BlockSpec((None, fc.META_WIDTH), lambda i, b, h: (b, 0)),
        pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, h // G, 0)),
        pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, h // G, 0)),
    ]
    args = [meta, q, k, v]
    if cfg.segments:
        in_specs += [
            pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
            pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0)),
        ]
        args += [q_seg, kv_seg]
    kernel = functools.partial(_kernel, cfg=cfg, num_k_blocks=Sp // bk)
    return pl.pallas_call(
        kernel,
        grid=(Tp // bq, B, Hq),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),
            pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((B, Hq, Tp), jnp.float32),
        ],
        compiler_params=fc.compiler_params(cfg),
        interpret=cfg.interpret,
        name="flash_fwd",
    )(*args)
