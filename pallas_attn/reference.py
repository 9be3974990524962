"""Materialised attention: softmax(QK^T)V with the full score matrix. The oracle for tests.

Never fast; O(T * S) memory. Gradients come from plain autodiff and are NaN-free for fully masked
rows (every ``exp``/``log`` sees a safe argument).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_attn import masks, shapes, softmax


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
    kv_start, kv_len = (_column(shapes.per_batch(x, B)) for x in (kv_start, kv_len))
    k_pos = jnp.arange(S, dtype=jnp.int32)[None, :, None, None]
    k, v = masks.zero_unowned(
        masks.key_owned(k_pos, kv_start, kv_len), k, v
    )  # no garbage in matmuls
    qg = q.reshape(B, T, Hkv, G, D)
    s = jnp.einsum("bthgd,bshd->bhgts", qg, k)
    s2, _ = softmax.scale_scores(s, jnp.asarray(softmax_scale, q.dtype), softcap)

    q_pos = jnp.arange(T, dtype=jnp.int32)[None, None, :, None]
    q_pos = q_pos + _column(shapes.per_batch(q_offset, B, S - T))
    q_seg = kv_seg = None
    if q_segment_ids is not None:
        q_seg = q_segment_ids[:, None, :, None]
        kv_seg = kv_segment_ids[:, None, None, :]
    mask = masks.visible(
        q_pos,
        jnp.arange(S, dtype=jnp.int32)[None, None, None, :],
        window=window,
        kv_start=kv_start,
        kv_len=kv_len,
        q_segment_ids=q_seg,
        kv_segment_ids=kv_seg,
        tree_rows=None if tree_mask is None else tree_mask[:, None],
        tree_start=q_pos[..., :1, :] if tree_mask is not None else None,
    )[:, :, None]  # [B, 1, 1, T, S] broadcast over (Hkv, G)

    # The whole row in one online-softmax step, with -inf (not MASK_VALUE) for masked scores: exact
    # in any dtype; the max of a fully masked row is replaced by 0 so nothing is NaN.
    s2 = jnp.where(mask, s2, -jnp.inf)
    m = jnp.max(s2, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0).astype(s2.dtype)
    p = jnp.where(mask, jnp.exp2(s2 - m[..., None]), 0)
    acc = jnp.einsum("bhgts,bshd->bhgtd", p.astype(v.dtype), v)
    out, lse = softmax.finalize(m, jnp.sum(p, axis=-1), acc)
    out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, Hq, D)
    return out.astype(out_dtype), lse.reshape(B, Hq, T)


def _column(x):
    """[B] -> [B, 1, 1, 1] (None stays None)."""
    return None if x is None else x[:, None, None, None]
