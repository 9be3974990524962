"""Shape glue shared by every path: rounding, per-row broadcasting, padding, per-row key ranges.

``round_up`` and ``next_pow2`` are public so that callers (``decoding``) bucket shapes with the same
rule as the kernels pad them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def round_up(x: int, m: int) -> int:
    """Smallest multiple of ``m`` >= ``x``."""
    return (x + m - 1) // m * m


def next_pow2(x: int, floor: int = 1) -> int:
    """Smallest power of two >= max(x, floor) (Triton block dims; its ``dot`` needs >= 16)."""
    return max(floor, 1 << max(0, (x - 1).bit_length()))


def per_batch(x, batch: int, default=None):
    """None (-> ``default``, which may be None), an int or a [B] array -> a [B] int32 array."""
    x = default if x is None else x
    if x is None:
        return None
    return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (batch,))


def pad_axis(x, axis: int, n: int):
    """Zero-pads ``x`` along ``axis`` to length ``n``."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, widths)


class RowRanges(NamedTuple):
    """Per batch row: where queries sit and which keys exist (:mod:`pallas_attn.masks` sense).

    Segment ids are zero-padded to the padded lengths (padded keys lie past ``kv_len`` anyway).
    """

    q_offset: jax.Array  # [B] int32, key position of query row 0
    kv_start: jax.Array  # [B] int32, first valid key
    kv_len: jax.Array  # [B] int32, keys [kv_start, kv_len) are valid; <= S
    q_seg: jax.Array | None  # [B, Tp] int32, or None without segments
    kv_seg: jax.Array | None  # [B, Sp] int32
    tree: jax.Array | None = None  # [B, Tp, T] int32 tree mask among keys q_offset + [0, T)

    def meta(self, width: int) -> jax.Array:
        """[B, width] int32 rows (q_offset, kv_start, kv_len, 0, ...): what a kernel program
        loads once for its batch row."""
        rows = jnp.stack([self.q_offset, self.kv_start, self.kv_len], 1).astype(jnp.int32)
        return pad_axis(rows, 1, width)


def row_ranges(
    q_shape, S: int, Tp: int, Sp: int, *, q_offset, kv_start, kv_len, q_segment_ids, kv_segment_ids
) -> RowRanges:
    """Fills the defaults (``q_offset = S - T``, ``kv_start = 0``, ``kv_len = S``) for q
    [B, T, Hq, D] over S keys, and pads segment ids to ``Tp`` / ``Sp``."""
    B, T = q_shape[:2]
    q_seg = kv_seg = None
    if q_segment_ids is not None:
        q_seg = pad_axis(q_segment_ids.astype(jnp.int32), 1, Tp)
        kv_seg = pad_axis(kv_segment_ids.astype(jnp.int32), 1, Sp)
    return RowRanges(
        per_batch(q_offset, B, S - T),
        per_batch(kv_start, B, 0),
        jnp.minimum(per_batch(kv_len, B, S), S),
        q_seg,
        kv_seg,
    )
