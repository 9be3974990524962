"""Flash-attention forward kernel: FlashAttention-2, Alg. 1 (Dao, 2023), in Pallas (Triton).

One program per (query block, batch, query head). It loads its ``[block_q, D]`` query tile once and
walks only the key blocks the mask can make visible (causal/window/valid length; see
:func:`flash_common.key_block_range`); the blocks every row fully sees skip the mask arithmetic
(:func:`flash_common.split_loop`). It keeps per row, in float32:

* ``m``: running max of the base-2 scores seen so far (``MASK_VALUE`` until a key is visible),
* ``l``: running sum of ``exp2(s - m)`` over visible keys,
* ``acc``: the unnormalised output ``sum exp2(s - m) v``, rescaled by ``exp2(m_old - m_new)``
  whenever the max grows.

At the end ``out = acc / l`` and ``lse = ln2 * m + log(l)`` (natural log); a row that saw no key
has ``l = 0`` and gets ``out = 0``, ``lse = -inf``.

Inputs are pre-padded by :mod:`pallas_attn.flash`: T to a multiple of ``block_q``, S to a multiple
of ``block_k``, D to a power of two >= 16, so every load is a full, unmasked tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_attn import masks
from pallas_attn.kernels import flash_common as fc


def _kernel(meta_ref, q_ref, k_ref, v_ref, *refs, cfg: fc.Config, num_k_blocks: int):
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
        m, l, acc = carry
        start = pl.multiple_of(j * bk, bk)
        k = k_ref[pl.ds(start, bk), :]  # [bk, D]
        v = v_ref[pl.ds(start, bk), :]
        if masked:
            k_pos = fc.positions(start, bk)[None, :]
            k, v = fc.zero_unowned_rows(start, kv_start, kv_len, k, v)
        s, _ = fc.scores(cfg, q, k)  # [bq, bk]
        if masked:
            kv_seg = kv_seg_ref[pl.ds(start, bk)][None, :] if cfg.segments else None
            mask = fc.tile_visible(cfg, q_pos, k_pos, kv_start, kv_len, q_seg, kv_seg)
            s = jnp.where(mask, s, masks.MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp2(m - m_new)
        p = jnp.exp2(s - m_new[:, None])
        if masked:
            p = jnp.where(mask, p, 0.0)
        acc = acc * alpha[:, None] + fc.dot_nn(p.astype(v.dtype), v)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    q_last = q_first + bq - 1
    lo, hi = fc.key_block_range(cfg, q_first, q_last, kv_start, kv_len, bk, num_k_blocks)
    full = fc.full_key_blocks(cfg, q_first, q_last, kv_start, kv_len, bk)
    init = (
        jnp.full((bq,), masks.MASK_VALUE, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
        jnp.zeros(q.shape, jnp.float32),
    )
    m, l, acc = fc.split_loop(cfg, lo, hi, full, body, init)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m * fc.LN2 + jnp.log(l_safe), -jnp.inf)


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
