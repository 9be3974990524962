"""The online softmax (FlashAttention-2's running statistics), written once for every impl.

Plain ``jnp`` on arrays of any leading shape, so the same functions run in the reference, the XLA
path and inside the Pallas kernels. One log base: scores enter in base 2,
``s2 = log2(e) * cap(scale * q.k)`` (:func:`scale_scores`), so every exponential is an ``exp2``
(what GPUs compute natively); only the lse handed to callers is a natural log.

Per query row the state is

* ``m``: running max of the visible ``s2`` (``MASK_VALUE`` until a key is visible),
* ``l``: running sum of ``exp2(s2 - m)`` over visible keys,
* ``acc``: the unnormalised output ``sum exp2(s2 - m) v``, rescaled by ``exp2(m_old - m_new)``
  whenever the max grows.

:func:`finalize` gives ``out = acc / l`` and ``lse = ln(2) * m + ln(l)``; a row that saw no key has
``l = 0`` and gets out 0, lse ``-inf`` (never NaN). The backward recomputes
``p = exp2(s2 - log2(e) * lse)`` and uses :func:`score_grad`.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from pallas_attn.masks import MASK_VALUE

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def scale_scores(s, softmax_scale, softcap: float):
    """Raw scores ``q.k`` -> base-2 scores ``log2(e) * cap(scale * s)``, and ``tanh`` (softcap
    only, for the backward) or None. ``softmax_scale`` may be traced (an FP8 descale folded in);
    ``softcap`` is static: ``cap(x) = softcap * tanh(x / softcap)`` when > 0."""
    if softcap > 0:
        t = jnp.tanh(s * (softmax_scale / softcap))
        return t * (softcap * LOG2E), t
    return s * (softmax_scale * LOG2E), None


def init(rows: tuple[int, ...], D: int):
    """``(m, l, acc)`` for rows of shape ``rows`` and head dim D, float32."""
    return (
        jnp.full(rows, MASK_VALUE, jnp.float32),
        jnp.zeros(rows, jnp.float32),
        jnp.zeros((*rows, D), jnp.float32),
    )


def step(carry, s2, v, pv, mask=None, *, accumulate: bool = False):
    """One online-softmax step over a tile of keys.

    Args:
      carry: ``(m, l, acc)``: ``[..., M]``, ``[..., M]``, ``[..., M, D]`` float32.
      s2: base-2 scores ``[..., M, N]`` float32 of the tile.
      v: the tile's values, in whatever layout ``pv`` takes.
      pv: ``pv(p, v)`` -> ``[..., M, D]`` float32, the probabilities times the values; with
        ``accumulate``, ``pv(p, v, acc)`` -> ``acc + p v`` (a matmul that accumulates in place).
      mask: optional bool, broadcastable to ``s2``; False keys get probability 0.

    Returns:
      the new ``(m, l, acc)``.
    """
    m, l, acc = carry
    if mask is not None:
        s2 = jnp.where(mask, s2, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s2, axis=-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s2 - _expand(m_new, s2.shape))
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    acc = acc * _expand(alpha, acc.shape)
    acc = pv(p, v, acc) if accumulate else acc + pv(p, v)
    return m_new, l * alpha + jnp.sum(p, axis=-1), acc


def _expand(x, shape):
    """``x`` [..., M] broadcast to ``shape`` [..., M, N] (explicit dims: Mosaic GPU's layouts
    have no [..., M, 1] intermediate)."""
    return lax.broadcast_in_dim(x, shape, tuple(range(x.ndim)))


def finalize(m, l, acc):
    """``(out, lse)``: ``acc / l`` and the natural-log ``lse`` (float32); rows with ``l = 0`` get 0
    and ``-inf``. ``m`` is the base-2 max; ``acc`` keeps its dtype."""
    seen = l > 0
    l_safe = jnp.where(seen, l, jnp.ones((), l.dtype))
    out = acc / _expand(l_safe, acc.shape)
    l32 = l_safe.astype(jnp.float32)
    return out, jnp.where(seen, m.astype(jnp.float32) * LN2 + jnp.log(l32), -jnp.inf)


def combine(out_s, lse_s, axis: int):
    """Merges finalized partials over disjoint key sets (split-KV): ``lse = logsumexp(lse_s)``,
    ``out = sum exp(lse_s - lse) out_s``. ``out_s`` has a trailing D axis more than ``lse_s``;
    ``axis`` (negative) is the split axis of ``lse_s``. Parts that saw nothing (``-inf``) weigh 0."""
    m = jnp.max(lse_s, axis=axis, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_s - m_safe)
    total = jnp.sum(w, axis=axis)
    seen = total > 0
    out = jnp.sum(w[..., None] * out_s, axis=axis - 1) / jnp.where(seen, total, 1.0)[..., None]
    lse = jnp.where(
        seen, jnp.squeeze(m_safe, axis) + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf
    )
    return out, lse


def score_grad(p, dp, delta, t):
    """FlashAttention-2's backward through the softmax and softcap, for one tile:
    ``ds = p * (dp - delta)`` (``delta = rowsum(dO * O) - dlse``), times ``1 - tanh^2`` under a
    softcap. The result is the gradient of ``scale * q.k``; callers multiply by the scale."""
    ds = p * (dp - delta)
    if t is not None:
        ds = ds * (1.0 - t * t)
    return ds
