"""Materialised attention: softmax(QK^T)V with the full score matrix. The oracle for tests.

Never fast; O(T * S) memory. Gradients come from plain autodiff and are NaN-free for fully masked
rows (every ``exp``/``log`` sees a safe argument).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_attn import masks


def _per_batch(x, batch: int):
    """None, an int, or a [B] array -> a [B, 1, 1, 1] int32 array (or None)."""
    if x is None:
        return None
    return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (batch,))[:, None, None, None]


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
    upcast: bool = True,
):
    """Reference attention with the semantics of :mod:`pallas_attn.masks`.

    Args:
      q: [B, T, Hq, D]; k, v: [B, S, Hkv, D] with Hq % Hkv == 0.
      softmax_scale: multiplies QK^T before softcap and masking.
      window: normalised ``(left, right)``; causal is ``right = 0``.
      softcap: if > 0, ``s = softcap * tanh(s / softcap)``.
      q_segment_ids: [B, T] int, kv_segment_ids: [B, S] int (both or neither).
      q_offset: key position of query row 0, an int or [B]; default ``S - T``.
      kv_start, kv_len: int or [B]; keys outside ``[kv_start, kv_len)`` are hidden.
      tree_mask: [B, T, T] bool: among keys ``q_offset .. q_offset + T - 1`` query ``i`` sees key
        ``q_offset + j`` only if ``tree_mask[b, i, j]`` (see :func:`pallas_attn.masks.visible`).
      upcast: compute in float32 (the oracle); False computes in the input dtype, which is the
        "same-precision reference" used to set test tolerances.

    Returns:
      out [B, T, Hq, D] in q's dtype; lse [B, Hq, T] float32 (-inf on fully masked rows).
    """
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out_dtype = q.dtype
    if upcast:
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    qg = q.reshape(B, T, Hkv, G, D)
    s = jnp.einsum("bthgd,bshd->bhgts", qg, k) * jnp.asarray(softmax_scale, q.dtype)
    if softcap > 0:
        s = softcap * jnp.tanh(s / softcap)

    q_pos = jnp.arange(T, dtype=jnp.int32)[None, None, :, None]
    q_pos = q_pos + (S - T if q_offset is None else _per_batch(q_offset, B))
    k_pos = jnp.arange(S, dtype=jnp.int32)[None, None, None, :]
    q_seg = kv_seg = None
    if q_segment_ids is not None:
        q_seg = q_segment_ids[:, None, :, None]
        kv_seg = kv_segment_ids[:, None, None, :]
    mask = masks.visible(
        q_pos,
        k_pos,
        window=window,
        kv_start=_per_batch(kv_start, B),
        kv_len=_per_batch(kv_len, B),
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        tree_rows=None if tree_mask is None else tree_mask[:, None],
        tree_start=q_pos[..., :1, :] if tree_mask is not None else None,
    )[:, :, None]  # [B, 1, 1, T, S] broadcast over (Hkv, G)

    s_masked = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s_masked, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0).astype(s.dtype)
    p = jnp.where(mask, jnp.exp(s - m_safe), 0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    has_any = l > 0
    p = p / jnp.where(has_any, l, 1)
    out = jnp.einsum("bhgts,bshd->bthgd", p.astype(v.dtype), v)
    l32 = l.astype(jnp.float32)
    lse = jnp.where(
        has_any, m_safe.astype(jnp.float32) + jnp.log(jnp.where(has_any, l32, 1)), -jnp.inf
    )
    return out.reshape(B, T, Hq, D).astype(out_dtype), lse[..., 0].reshape(B, Hq, T)
