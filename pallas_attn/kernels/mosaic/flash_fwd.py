"""Flash-attention forward on Mosaic GPU (Hopper): FlashAttention-2, Alg. 1, with TMA and wgmma.

One CTA (one warpgroup) per (query block, query head, batch). It TMA-loads its ``[block_q, D]``
query tile once, then walks only the key blocks the mask can make visible
(:func:`flash_common.key_block_range`), double-buffering K and V: while block ``j`` is computed,
the TMA unit fetches block ``j + 1`` into the other SMEM slot (one barrier per slot and tensor).
Per block: ``S = Q K^T`` by wgmma (K transposed in the descriptor), the mask and softcap in
registers, FlashAttention-2's online softmax (:func:`pallas_attn.softmax.step`: base-2 running
max ``m``, sum ``l`` and accumulator ``acc``, float32 in registers), ``P`` written to SMEM in
the input dtype and ``P V`` by wgmma. Blocks every row fully sees skip the mask arithmetic
(:func:`flash_common.split_loop`). The end is ``out = acc / l``, ``lse = ln2 * m + ln(l)``;
a row that saw no key gets out 0 and lse ``-inf``. Out and lse leave through SMEM by TMA.

Inputs are padded by :mod:`pallas_attn.mosaic`: T to a multiple of ``block_q``, S of
``block_k``, D of 64; padded keys lie at positions ``>= S`` and are masked.
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


def _kernel(
    q_ref,  # [B, Tp, Hq, Dp] GMEM
    k_ref,  # [B, Sp, Hkv, Dp] GMEM
    v_ref,  # [B, Sp, Hkv, Dp] GMEM
    o_ref,  # [B, Tp, Hq, Dp] GMEM
    lse_ref,  # [B, Hq, Tp] float32 GMEM
    q_s,  # [block_q, Dp] SMEM, reused for the output tile
    k_s,  # [2, block_k, Dp] SMEM, double-buffered
    v_s,  # [2, block_k, Dp] SMEM
    p_s,  # [block_q, block_k] SMEM, probabilities in the input dtype
    lse_s,  # [block_q] float32 SMEM
    q_bar,  # 1 barrier
    k_bar,  # 2 barriers, one per slot
    v_bar,  # 2 barriers
    *,
    cfg: mc.Config,
    G: int,
):
    bq, bk = cfg.block_q, cfg.block_k
    qi, h, b = (lax.axis_index(n) for n in ("q", "h", "b"))
    kv_h = lax.div(h, G)
    num_k_blocks = k_ref.shape[1] // bk
    row0 = pl.multiple_of(qi * bq, bq)
    plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, bq), h], q_s, q_bar.at[0])

    q_first = cfg.q_offset + row0
    q_last = q_first + bq - 1
    lo, hi = fc.key_block_range(cfg, q_first, q_last, 0, cfg.S, bk, num_k_blocks)
    full = fc.full_key_blocks(cfg, q_first, q_last, 0, cfg.S, bk)

    def fetch(j):
        slot = lax.rem(j, 2)
        keys = (b, pl.ds(pl.multiple_of(j * bk, bk), bk), kv_h)
        plgpu.copy_gmem_to_smem(k_ref.at[keys], k_s.at[slot], k_bar.at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_s.at[slot], v_bar.at[slot])

    pl.when(lo < hi)(lambda: fetch(lo))
    plgpu.barrier_wait(q_bar.at[0])

    def pv(p, slot):
        mc.store_tile(p_s, p)
        plgpu.barrier_wait(v_bar.at[slot])
        return mc.matmul(cfg, p_s, v_s.at[slot])

    def body(j, carry, masked):
        slot = lax.rem(j, 2)
        pl.when(j + 1 < hi)(lambda: fetch(j + 1))
        plgpu.barrier_wait(k_bar.at[slot])
        s = mc.matmul(cfg, q_s, k_s.at[slot], transpose_b=True)  # [bq, bk]
        s2, _ = softmax.scale_scores(s, cfg.softmax_scale, cfg.softcap)
        mask = None
        if masked:
            q_pos = q_first + mc.iota(cfg, s.shape, 0)
            k_pos = j * bk + mc.iota(cfg, s.shape, 1)
            mask = masks.visible(q_pos, k_pos, window=cfg.window, kv_len=cfg.S)
        return softmax.step(carry, s2, slot, pv, mask)

    m, l, acc = softmax.init((bq,), q_s.shape[-1])
    carry = (mc.rows(cfg, m), mc.rows(cfg, l), mc.tile(cfg, acc))
    m, l, acc = fc.split_loop(cfg, lo, hi, full, body, carry)
    out, lse = softmax.finalize(m, l, acc)
    mc.store_tile(q_s, out)
    mc.store_tile(lse_s, lse)
    plgpu.copy_smem_to_gmem(q_s, o_ref.at[b, pl.ds(row0, bq), h])
    plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[b, h, pl.ds(row0, bq)])
    plgpu.wait_smem_to_gmem(0)


def forward(cfg: mc.Config, q, k, v):
    """Padded forward.

    Args:
      q: [B, Tp, Hq, Dp]; k, v: [B, Sp, Hkv, Dp], bfloat16 or float16, Tp % block_q == 0,
        Sp % block_k == 0, Dp % 64 == 0.

    Returns:
      out [B, Tp, Hq, Dp] in q's dtype, lse [B, Hq, Tp] float32 (natural log).
    """
    B, Tp, Hq, Dp = q.shape
    Hkv = k.shape[2]
    bq, bk = cfg.block_q, cfg.block_k
    dtype = q.dtype
    scratch = [
        mc.smem((bq, Dp), dtype),
        mc.smem((2, bk, Dp), dtype),
        mc.smem((2, bk, Dp), dtype),
        mc.smem((bq, bk), dtype),
        plgpu.SMEM((bq,), jnp.float32),
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=2),
        plgpu.Barrier(num_barriers=2),
    ]

    def mosaic_flash_fwd(*refs):  # the kernel's name in compile reports
        _kernel(*refs, cfg=cfg, G=Hq // Hkv)

    return plgpu.kernel(
        mosaic_flash_fwd,
        out_type=(
            jax.ShapeDtypeStruct(q.shape, dtype),
            jax.ShapeDtypeStruct((B, Hq, Tp), jnp.float32),
        ),
        scratch_types=scratch,
        grid=(Tp // bq, Hq, B),
        grid_names=("q", "h", "b"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mc.interpret_params(cfg),
    )(q, k, v)
