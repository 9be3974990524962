"""Blockwise online-softmax attention in plain ``jnp``/``lax``: the path for CPU and TPU.

Forward (FlashAttention-2, Alg. 1, written with XLA loops): for each query block (``lax.map``) a
``fori_loop`` walks only the key blocks that the mask can make visible (causal, window, valid
length), running the online softmax of :mod:`pallas_attn.softmax` (base-2 running max ``m``, sum
``l``, accumulator ``acc``); at the end ``out = acc / l``, ``lse = ln2 * m + log(l)``, and a row
that saw no key gets out 0, lse -inf. K/V rows outside a row's ``[kv_start, kv_len)`` are zeroed
per tile, so garbage there never reaches a matmul.

Backward (Alg. 2) is a ``jax.custom_vjp`` that recomputes the probabilities block by block from the
saved lse: ``p = exp2(s2 - log2(e) lse)``, ``dp = dO V^T``, ``ds = p * (dp - delta)`` with
``delta = rowsum(dO * O) - dlse``. Nothing of size T x S is ever materialised: memory is O(T + S)
plus one ``[B, H, block_q, block_k]`` tile.

All arithmetic is float32 whatever the input dtype; outputs and gradients are cast back.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_attn import heuristics, masks, shapes, softmax, validation


@dataclasses.dataclass(frozen=True)
class _Static:
    softmax_scale: float
    window: tuple[int, int]
    softcap: float
    block_q: int
    block_k: int


def attention(
    q,
    k,
    v,
    *,
    softmax_scale: float,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    q_segment_ids=None,
    kv_segment_ids=None,
    q_offset=None,
    kv_start=None,
    kv_len=None,
    tree_mask=None,
    block_q: int | None = None,
    block_k: int | None = None,
):
    """Blockwise attention; same arguments and results as :func:`pallas_attn.reference.attention`.

    ``q_offset``, ``kv_start``, ``kv_len`` may be ints or [B] arrays (traced is fine).
    Differentiable in q, k, v (and through lse) via a custom VJP.
    """
    T, S = q.shape[1], k.shape[1]
    default_q, default_k = heuristics.xla_blocks(T, S)
    bq, bk = block_q or default_q, block_k or default_k
    Tp, Sp = shapes.round_up(T, bq), shapes.round_up(S, bk)
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
    if tree_mask is not None:
        ranges = ranges._replace(tree=shapes.pad_axis(tree_mask.astype(jnp.int32), 1, Tp))
    static = _Static(float(softmax_scale), tuple(window), float(softcap), bq, bk)
    pad_q, pad_k = (functools.partial(shapes.pad_axis, axis=1, n=n) for n in (Tp, Sp))
    out, lse = _attend(static, pad_q(q), pad_k(k), pad_k(v), ranges)
    return out[:, :T], lse[:, :, :T]


def _tile_mask(static: _Static, ranges: shapes.RowRanges, i, j):
    """[B, 1, 1, bq, bk] visibility of key block j to query block i."""
    bq, bk = static.block_q, static.block_k
    q_pos = ranges.q_offset[:, None] + i * bq + jnp.arange(bq, dtype=jnp.int32)[None]  # [B, bq]
    k_pos = j * bk + jnp.arange(bk, dtype=jnp.int32)  # [bk]
    q_seg = kv_seg = None
    if ranges.q_seg is not None:
        q_seg = lax.dynamic_slice_in_dim(ranges.q_seg, i * bq, bq, 1)[:, :, None]
        kv_seg = lax.dynamic_slice_in_dim(ranges.kv_seg, j * bk, bk, 1)[:, None, :]
    tree = {}
    if ranges.tree is not None:
        tree = dict(
            tree_rows=lax.dynamic_slice_in_dim(ranges.tree, i * bq, bq, 1),  # [B, bq, T]
            tree_start=ranges.q_offset[:, None, None],
        )
    mask = masks.visible(
        q_pos[:, :, None],
        k_pos[None, None, :],
        window=static.window,
        kv_start=ranges.kv_start[:, None, None],
        kv_len=ranges.kv_len[:, None, None],
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        **tree,
    )
    return mask[:, None, None]


def _kv_block_range(static: _Static, ranges: shapes.RowRanges, i, num_k_blocks: int):
    """Key blocks [jlo, jhi) that any row of query block i (in any batch row) may see."""
    bq, bk = static.block_q, static.block_k
    first = ranges.q_offset + i * bq
    lo, hi = masks.key_range(
        first, first + bq - 1, window=static.window, kv_start=ranges.kv_start, kv_len=ranges.kv_len
    )
    visible_rows = hi > lo
    lo = jnp.min(jnp.where(visible_rows, lo, jnp.iinfo(jnp.int32).max))
    hi = jnp.max(jnp.where(visible_rows, hi, 0))
    jlo = jnp.clip(lo // bk, 0, num_k_blocks)
    jhi = jnp.clip((hi + bk - 1) // bk, jlo, num_k_blocks)
    return jlo, jhi


def _kv_tile(ranges: shapes.RowRanges, j, bk: int, *xs):
    """Key block j of each of ``xs`` [B, Sp, Hkv, D], rows outside ``[kv_start, kv_len)`` zeroed."""
    k_pos = j * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]
    owned = masks.key_owned(k_pos, ranges.kv_start[:, None], ranges.kv_len[:, None])
    tiles = (lax.dynamic_slice_in_dim(x, j * bk, bk, 1) for x in xs)
    return masks.zero_unowned(owned[:, :, None, None], *tiles)


def _scores(static: _Static, q_i, k_j):
    """Base-2 scores [B, Hkv, G, bq, bk] float32 (:func:`softmax.scale_scores`), and tanh."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q_i, k_j)
    return softmax.scale_scores(s, static.softmax_scale, static.softcap)


def _pv(p, v_j):
    """[B, Hkv, G, bq, bk] x [B, bk, Hkv, D] -> [B, Hkv, G, bq, D]."""
    return jnp.einsum("bhgqk,bkhd->bhgqd", p, v_j)


def _split_heads(x, Hkv: int):
    """[B, T, Hq, D] -> [B, T, Hkv, G, D] float32."""
    B, T, Hq, D = x.shape
    return x.reshape(B, T, Hkv, Hq // Hkv, D).astype(jnp.float32)


def _forward(static: _Static, q, k, v, ranges: shapes.RowRanges):
    B, Tp, Hq, D = q.shape
    Sp, Hkv = k.shape[1], k.shape[2]
    bq, bk = static.block_q, static.block_k
    qg = _split_heads(q, Hkv)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)

    def q_block(i):
        q_i = lax.dynamic_slice_in_dim(qg, i * bq, bq, 1)

        def body(j, carry):
            k_j, v_j = _kv_tile(ranges, j, bk, k32, v32)
            s, _ = _scores(static, q_i, k_j)
            return softmax.step(carry, s, v_j, _pv, _tile_mask(static, ranges, i, j))

        jlo, jhi = _kv_block_range(static, ranges, i, Sp // bk)
        init = softmax.init((B, Hkv, Hq // Hkv, bq), D)
        return softmax.finalize(*lax.fori_loop(jlo, jhi, body, init))

    out, lse = lax.map(q_block, jnp.arange(Tp // bq))  # [nq, B, Hkv, G, bq, (D)]
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(B, Tp, Hq, D)
    lse = jnp.transpose(lse, (1, 2, 3, 0, 4)).reshape(B, Hq, Tp)
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(static: _Static, q, k, v, ranges):
    return _forward(static, q, k, v, ranges)


def _attend_fwd(static, q, k, v, ranges):
    # _attend, not _forward: differentiating this again meets the backward's guard.
    out, lse = _attend(static, q, k, v, ranges)
    return (out, lse), (q, k, v, ranges, out, lse)


def _attend_bwd(static: _Static, res, cotangents):
    q, k, v, ranges, out, lse = res
    guarded = validation.first_order_only("xla", (q, k, v, out, lse, *cotangents))
    q, k, v, out, lse, d_out, d_lse = guarded
    B, Tp, Hq, D = q.shape
    Sp, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk = static.block_q, static.block_k
    qg, dog = _split_heads(q, Hkv), _split_heads(d_out, Hkv)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    # delta = rowsum(dO * O) - dlse  ->  ds = p * (dp - delta) covers both cotangents.
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", dog, _split_heads(out, Hkv))
    delta = delta - d_lse.reshape(B, Hkv, G, Tp)
    lse2 = lse.reshape(B, Hkv, G, Tp)
    lse2 = jnp.where(jnp.isfinite(lse2), lse2 * softmax.LOG2E, 0.0)

    def q_block(i, carry):
        dq, dk, dv = carry
        q_i, do_i = (lax.dynamic_slice_in_dim(x, i * bq, bq, 1) for x in (qg, dog))
        lse_i, delta_i = (
            lax.dynamic_slice_in_dim(x, i * bq, bq, 3)[..., None] for x in (lse2, delta)
        )

        def body(j, inner):
            dq_i, dk, dv = inner
            k_j, v_j = _kv_tile(ranges, j, bk, k32, v32)
            s, t = _scores(static, q_i, k_j)
            p = jnp.where(_tile_mask(static, ranges, i, j), jnp.exp2(s - lse_i), 0.0)
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_i, v_j)
            ds = softmax.score_grad(p, dp, delta_i, t) * static.softmax_scale
            dq_i = dq_i + jnp.einsum("bhgqk,bkhd->bqhgd", ds, k_j)
            dk = _add_block(dk, jnp.einsum("bhgqk,bqhgd->bkhd", ds, q_i), j * bk)
            dv = _add_block(dv, jnp.einsum("bhgqk,bqhgd->bkhd", p, do_i), j * bk)
            return dq_i, dk, dv

        jlo, jhi = _kv_block_range(static, ranges, i, Sp // bk)
        dq_i, dk, dv = lax.fori_loop(jlo, jhi, body, (jnp.zeros_like(q_i), dk, dv))
        return lax.dynamic_update_slice_in_dim(dq, dq_i, i * bq, 1), dk, dv

    zeros_kv = jnp.zeros((B, Sp, Hkv, D), jnp.float32)
    dq, dk, dv = lax.fori_loop(0, Tp // bq, q_block, (jnp.zeros_like(qg), zeros_kv, zeros_kv))
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


def _add_block(acc, block, start):
    """``acc[:, start:start + n] += block`` along axis 1."""
    n = block.shape[1]
    return lax.dynamic_update_slice_in_dim(
        acc, lax.dynamic_slice_in_dim(acc, start, n, 1) + block, start, 1
    )


_attend.defvjp(_attend_fwd, _attend_bwd)
