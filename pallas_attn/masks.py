"""The one mask semantics every implementation shares.

Positions, not indices, decide visibility. Query row ``i`` of ``Tq`` sits at key position
``q_offset + i``; for plain attention ``q_offset = Tk - Tq`` (bottom-right alignment, as in
FlashAttention >= 2.1), for KV-cache attention ``q_offset = cache_seqlens + Tn - Tq``.

A key ``j`` is visible to query ``i`` (at position ``p = q_offset + i``) when all hold:

* ``kv_start <= j < kv_len``                  (valid keys: leftpad and ragged lengths),
* ``j >= p - left``  unless ``left == -1``    (sliding window, look-back),
* ``j <= p + right`` unless ``right == -1``   (look-ahead; ``causal`` is ``right = 0``),
* ``q_segment_ids[i] == kv_segment_ids[j]``   (packed sequences), when given,
* ``tree_mask[i, j - tree_start]`` when ``tree_start <= j < tree_start + Tq`` (tree attention:
  among the ``Tq`` keys from ``tree_start`` on, e.g. a speculative token tree's nodes, a query sees
  only those its row of ``tree_mask`` [Tq, Tq] allows: itself and its ancestors), when given.

The functions here are plain ``jnp`` broadcasting ops, so the reference, the XLA path and the
Pallas kernels (inside ``pallas_call`` bodies) all build masks with the same code.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# A finite "minus infinity" for kernels: exp(MASK_VALUE - m) underflows to 0 without producing
# NaN from (-inf) - (-inf) when a whole row is masked.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def normalize_window(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    """Folds ``causal`` into ``window_size``: causal means look-ahead ``right = 0``."""
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def visible(
    q_pos,
    k_pos,
    *,
    window: tuple[int, int],
    kv_start=None,
    kv_len=None,
    q_segment_ids=None,
    kv_segment_ids=None,
    tree_rows=None,
    tree_start=None,
):
    """Boolean mask, True where key ``k_pos`` is visible to query ``q_pos``.

    Args:
      q_pos: int array of query positions, broadcastable against ``k_pos`` (e.g. ``[..., Tq, 1]``).
      k_pos: int array of key indices (e.g. ``[..., 1, Tk]``).
      window: ``(left, right)`` after :func:`normalize_window`; ``-1`` means unbounded.
      kv_start, kv_len: optional, broadcastable; keys outside ``[kv_start, kv_len)`` are hidden.
      q_segment_ids, kv_segment_ids: optional, broadcastable like ``q_pos`` / ``k_pos``.
      tree_rows, tree_start: optional, see :func:`tree_visible`.
    """
    left, right = window
    ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(k_pos)), dtype=bool)
    if left >= 0:
        ok = ok & (k_pos >= q_pos - left)
    if right >= 0:
        ok = ok & (k_pos <= q_pos + right)
    ok = ok & key_owned(k_pos, kv_start, kv_len)
    if q_segment_ids is not None:
        ok = ok & (q_segment_ids == kv_segment_ids)
    if tree_rows is not None:
        ok = ok & tree_visible(tree_rows, k_pos, tree_start)
    return ok


def tree_visible(tree_rows, k_pos, tree_start):
    """True where key ``k_pos`` is outside the tree keys or allowed by the query's tree row.

    Args:
      tree_rows: [..., R, Tt] bool or int, row ``r``'s entry ``c`` says whether query row ``r``
        sees the key at position ``tree_start + c``.
      k_pos: int key positions broadcastable to [..., 1, K].
      tree_start: int, position of the first tree key, broadcastable to [..., 1, 1].

    Returns [..., R, K] bool. Written with a one-hot compare and a sum over ``Tt`` (no gather), so
    Pallas kernels build it with the same code.
    """
    Tt = tree_rows.shape[-1]
    c = k_pos - tree_start  # [..., 1, K]: column of the key among the tree keys
    onehot = c[..., None] == jnp.arange(Tt, dtype=jnp.int32)  # [..., 1, K, Tt]
    hit = jnp.sum(jnp.where(onehot, tree_rows[..., :, None, :].astype(jnp.int32), 0), -1) > 0
    return hit | (c < 0) | (c >= Tt)


def key_owned(k_pos, kv_start=None, kv_len=None):
    """True where key ``k_pos`` lies in its row's ``[kv_start, kv_len)`` (None = unbounded).

    Keys outside that range are memory the row does not own (leftpad slots, slots past the length,
    pages that only pad a block table, varlen padding) and may hold anything, NaN and inf included.
    A masked probability of 0 times NaN is still NaN, so every impl also zeroes the K and V rows of
    the keys a row does not own (:func:`zero_unowned`) before they enter a matmul.
    """
    ok = jnp.ones(jnp.shape(k_pos), dtype=bool)
    if kv_start is not None:
        ok = ok & (k_pos >= kv_start)
    if kv_len is not None:
        ok = ok & (k_pos < kv_len)
    return ok


def zero_unowned(owned, *xs):
    """``where(owned, x, 0)`` for each ``x`` (``owned`` broadcast against them)."""
    return tuple(jnp.where(owned, x, jnp.zeros((), x.dtype)) for x in xs)


def key_range(q_first, q_last, *, window: tuple[int, int], kv_start, kv_len):
    """Half-open range ``[lo, hi)`` of keys any query at positions ``q_first..q_last`` may see.

    Used to skip key blocks that are fully masked. Works on Python ints and on traced scalars.
    ``hi <= lo`` means nothing is visible.
    """
    left, right = window
    lo = kv_start if left < 0 else jnp.maximum(kv_start, q_first - left)
    hi = kv_len if right < 0 else jnp.minimum(kv_len, q_last + right + 1)
    return lo, hi
