"""Rotary position embedding (RoPE) on the first ``R`` dims of a head, both pairing styles.

With ``cos``, ``sin`` of shape ``[max_pos, R/2]`` and a token at position ``p``, pair ``i`` of the
first ``R`` dims is rotated by angle ``theta_i(p)``:

* interleaved (GPT-J, FlashAttention's default): pairs ``(2i, 2i+1)``;
* not interleaved (GPT-NeoX / Llama): pairs ``(i, i + R/2)``.

``out[d] = x[d] * cos[p, f(d)] + sign(d) * x[partner(d)] * sin[p, f(d)]`` with ``sign = -1`` for
the first element of a pair. Dims ``d >= R`` pass through. The index maps below (``frequency_index``,
``partner_index``, ``sign``) are elementwise ops on an array of dims, so the same formula runs in
plain ``jnp`` (:func:`apply`) and inside a Pallas kernel (as gathers from refs).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def frequency_index(d, R: int, interleaved: bool):
    """The column of ``cos``/``sin`` that dim ``d`` (an int array, ``d < R``) uses."""
    return d // 2 if interleaved else d % (R // 2)


def partner_index(d, R: int, interleaved: bool):
    """The other dim of ``d``'s pair (``d < R``)."""
    return d ^ 1 if interleaved else (d + R // 2) % R


def sign(d, R: int, interleaved: bool):
    """float32 -1 for the first element of a pair, +1 for the second (``d < R``)."""
    first = d % 2 == 0 if interleaved else d < R // 2
    return jnp.where(first, -1.0, 1.0).astype(jnp.float32)


def apply(x, cos, sin, positions, *, interleaved: bool):
    """Rotates the first ``R = 2 * cos.shape[1]`` dims of ``x``.

    Args:
      x: [B, T, H, D] float.
      cos, sin: [max_pos, R/2] float, ``R <= D``.
      positions: [B, T] int; clipped to ``[0, max_pos)``.
      interleaved: pairing style (see the module docstring).

    Returns:
      [B, T, H, D] in x's dtype; rotation computed in float32.
    """
    R = 2 * cos.shape[1]
    positions = jnp.clip(positions, 0, cos.shape[0] - 1)
    d = np.arange(R)
    f = frequency_index(d, R, interleaved)
    c = cos.astype(jnp.float32)[positions][..., None, f]  # [B, T, 1, R]
    s = sin.astype(jnp.float32)[positions][..., None, f]
    xr = x[..., :R].astype(jnp.float32)
    rotated = xr * c + sign(d, R, interleaved) * xr[..., partner_index(d, R, interleaved)] * s
    return jnp.concatenate([rotated.astype(x.dtype), x[..., R:]], axis=-1)
