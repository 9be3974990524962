"""Blockwise online-softmax attention in plain ``jnp``/``lax``: the path for CPU and TPU.

Forward (FlashAttention-2, Alg. 1, written with XLA loops): for each query block (``lax.map``) a
``fori_loop`` walks only the key blocks that the mask can make visible (causal, window, valid
length), keeping per row a running max ``m`` of the scaled scores, a running sum ``l`` of
``exp(s - m)`` and an unnormalised accumulator ``acc = sum exp(s - m) v``. At the end
``out = acc / l`` and ``lse = m + log(l)``; a row that saw no key has ``l = 0`` -> out 0, lse -inf.

Backward (Alg. 2) is a ``jax.custom_vjp`` that recomputes the probabilities block by block from the
saved lse: ``p = exp(s - lse)``, ``dp = dO V^T``, ``ds = p * (dp - delta)`` with
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

from pallas_attn import masks


@dataclasses.dataclass(frozen=True)
class _Static:
    softmax_scale: float
    window: tuple[int, int]
    softcap: float
    block_q: int
    block_k: int


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def default_blocks(T: int, S: int) -> tuple[int, int]:
    """Tiles big enough to keep XLA's matmuls efficient on CPU, small enough for O(T) memory."""
    return min(512, _round_up(T, 8)), min(512, _round_up(S, 8))


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
    B, T, Hq, D = q.shape
    S = k.shape[1]
    dq, dk = default_blocks(T, S)
    bq, bk = block_q or dq, block_k or dk
    Tp, Sp = _round_up(T, bq), _round_up(S, bk)

    def per_batch(x, default):
        x = default if x is None else x
        return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (B,))

    aux = {
        "q_offset": per_batch(q_offset, S - T),
        "kv_start": per_batch(kv_start, 0),
        "kv_len": jnp.minimum(per_batch(kv_len, S), S),
    }
    if q_segment_ids is not None:
        aux["q_seg"] = jnp.pad(q_segment_ids.astype(jnp.int32), ((0, 0), (0, Tp - T)))
        aux["kv_seg"] = jnp.pad(kv_segment_ids.astype(jnp.int32), ((0, 0), (0, Sp - S)))
    if tree_mask is not None:  # [B, Tp, T]
        aux["tree"] = jnp.pad(tree_mask.astype(jnp.int32), ((0, 0), (0, Tp - T), (0, 0)))
    pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1]), (0, 0), (0, 0)))  # noqa: E731
    static = _Static(float(softmax_scale), tuple(window), float(softcap), bq, bk)
    out, lse = _attend(static, pad(q, Tp), pad(k, Sp), pad(v, Sp), aux)
    return out[:, :T], lse[:, :, :T]


def _tile_mask(static: _Static, aux, i, j):
    """[B, 1, 1, bq, bk] visibility of key block j to query block i."""
    bq, bk = static.block_q, static.block_k
    q_pos = aux["q_offset"][:, None] + i * bq + jnp.arange(bq, dtype=jnp.int32)[None]  # [B, bq]
    k_pos = j * bk + jnp.arange(bk, dtype=jnp.int32)  # [bk]
    extra = {}
    if "q_seg" in aux:
        extra = {
            "q_segment_ids": lax.dynamic_slice_in_dim(aux["q_seg"], i * bq, bq, 1)[:, :, None],
            "kv_segment_ids": lax.dynamic_slice_in_dim(aux["kv_seg"], j * bk, bk, 1)[:, None, :],
        }
    if "tree" in aux:
        extra["tree_rows"] = lax.dynamic_slice_in_dim(aux["tree"], i * bq, bq, 1)  # [B, bq, T]
        extra["tree_start"] = aux["q_offset"][:, None, None]
    mask = masks.visible(
        q_pos[:, :, None],
        k_pos[None, None, :],
        window=static.window,
        kv_start=aux["kv_start"][:, None, None],
        kv_len=aux["kv_len"][:, None, None],
        **extra,
    )
    return mask[:, None, None]


def _kv_block_range(static: _Static, aux, i, num_k_blocks: int):
    """Key blocks [jlo, jhi) that any row of query block i (in any batch row) may see."""
    bq, bk = static.block_q, static.block_k
    first = aux["q_offset"] + i * bq
    lo, hi = masks.key_range(
        first, first + bq - 1, window=static.window, kv_start=aux["kv_start"], kv_len=aux["kv_len"]
    )
    visible_rows = hi > lo
    lo = jnp.min(jnp.where(visible_rows, lo, jnp.iinfo(jnp.int32).max))
    hi = jnp.max(jnp.where(visible_rows, hi, 0))
    jlo = jnp.clip(lo // bk, 0, num_k_blocks)
    jhi = jnp.clip((hi + bk - 1) // bk, jlo, num_k_blocks)
    return jlo, jhi


def _scores(static: _Static, q_i, k_j):
    """Scaled (and soft-capped) scores [B, Hkv, G, bq, bk] in float32; also returns tanh for bwd."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q_i, k_j) * static.softmax_scale
    if static.softcap > 0:
        t = jnp.tanh(s / static.softcap)
        return static.softcap * t, t
    return s, None


def _split_heads(q, k):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    return q.reshape(B, T, Hkv, Hq // Hkv, D)


def _forward(static: _Static, q, k, v, aux):
    B, Tp, Hq, D = q.shape
    Sp, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk = static.block_q, static.block_k
    qg = _split_heads(q, k).astype(jnp.float32)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)

    def q_block(i):
        q_i = lax.dynamic_slice_in_dim(qg, i * bq, bq, 1)

        def body(j, carry):
            m, l, acc = carry
            s, _ = _scores(static, q_i, lax.dynamic_slice_in_dim(k32, j * bk, bk, 1))
            mask = _tile_mask(static, aux, i, j)
            s = jnp.where(mask, s, masks.MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            v_j = lax.dynamic_slice_in_dim(v32, j * bk, bk, 1)
            acc = acc * alpha[..., None] + jnp.einsum("bhgqk,bkhd->bhgqd", p, v_j)
            return m_new, l * alpha + jnp.sum(p, axis=-1), acc

        init = (
            jnp.full((B, Hkv, G, bq), masks.MASK_VALUE, jnp.float32),
            jnp.zeros((B, Hkv, G, bq), jnp.float32),
            jnp.zeros((B, Hkv, G, bq, D), jnp.float32),
        )
        jlo, jhi = _kv_block_range(static, aux, i, Sp // bk)
        m, l, acc = lax.fori_loop(jlo, jhi, body, init)
        seen = l > 0
        out = acc / jnp.where(seen, l, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        return out, lse

    out, lse = lax.map(q_block, jnp.arange(Tp // bq))  # [nq, B, Hkv, G, bq, (D)]
    out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(B, Tp, Hq, D)
    lse = jnp.transpose(lse, (1, 2, 3, 0, 4)).reshape(B, Hq, Tp)
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(static: _Static, q, k, v, aux):
    return _forward(static, q, k, v, aux)


def _attend_fwd(static, q, k, v, aux):
    out, lse = _forward(static, q, k, v, aux)
    return (out, lse), (q, k, v, aux, out, lse)


def _attend_bwd(static: _Static, res, cotangents):
    q, k, v, aux, out, lse = res
    d_out, d_lse = cotangents
    B, Tp, Hq, D = q.shape
    Sp, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bq, bk = static.block_q, static.block_k
    qg = _split_heads(q, k).astype(jnp.float32)
    dog = _split_heads(d_out, k).astype(jnp.float32)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)
    # delta = rowsum(dO * O) - dlse  ->  ds = p * (dp - delta) covers both cotangents.
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", dog, _split_heads(out, k).astype(jnp.float32))
    delta = delta - d_lse.reshape(B, Hkv, G, Tp)
    lse_g = lse.reshape(B, Hkv, G, Tp)
    lse_g = jnp.where(jnp.isfinite(lse_g), lse_g, 0.0)

    def q_block(i, carry):
        dq, dk, dv = carry
        q_i = lax.dynamic_slice_in_dim(qg, i * bq, bq, 1)
        do_i = lax.dynamic_slice_in_dim(dog, i * bq, bq, 1)
        lse_i = lax.dynamic_slice_in_dim(lse_g, i * bq, bq, 3)
        delta_i = lax.dynamic_slice_in_dim(delta, i * bq, bq, 3)

        def body(j, inner):
            dq_i, dk, dv = inner
            k_j = lax.dynamic_slice_in_dim(k32, j * bk, bk, 1)
            v_j = lax.dynamic_slice_in_dim(v32, j * bk, bk, 1)
            s, t = _scores(static, q_i, k_j)
            mask = _tile_mask(static, aux, i, j)
            p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_i, v_j)
            ds = p * (dp - delta_i[..., None])
            if t is not None:
                ds = ds * (1.0 - t * t)
            ds = ds * static.softmax_scale
            dv_j = jnp.einsum("bhgqk,bqhgd->bkhd", p, do_i)
            dk_j = jnp.einsum("bhgqk,bqhgd->bkhd", ds, q_i)
            dq_i = dq_i + jnp.einsum("bhgqk,bkhd->bqhgd", ds, k_j)
            dk = lax.dynamic_update_slice_in_dim(
                dk, lax.dynamic_slice_in_dim(dk, j * bk, bk, 1) + dk_j, j * bk, 1
            )
            dv = lax.dynamic_update_slice_in_dim(
                dv, lax.dynamic_slice_in_dim(dv, j * bk, bk, 1) + dv_j, j * bk, 1
            )
            return dq_i, dk, dv

        jlo, jhi = _kv_block_range(static, aux, i, Sp // bk)
        dq_i, dk, dv = lax.fori_loop(jlo, jhi, body, (jnp.zeros_like(q_i), dk, dv))
        return lax.dynamic_update_slice_in_dim(dq, dq_i, i * bq, 1), dk, dv

    init = (
        jnp.zeros_like(qg),
        jnp.zeros((B, Sp, Hkv, D), jnp.float32),
        jnp.zeros((B, Sp, Hkv, D), jnp.float32),
    )
    dq, dk, dv = lax.fori_loop(0, Tp // bq, q_block, init)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_attend.defvjp(_attend_fwd, _attend_bwd)
