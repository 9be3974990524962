"""``flash_attention_varlen``: attention over packed variable-length sequences (FlashAttention API).

The packed ``[total, H, D]`` tokens are gathered into ``[N, max_seqlen, H, D]`` rows and run through
the batched kernels with per-row ``q_offset = len_k - len_q`` (each sequence is bottom-right
aligned on its own) and ``kv_len = len_k``, then gathered back. The padding costs
``N * max_seqlen`` rows of memory, never a T x S matrix.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_attn import api, masks, validation
from pallas_attn.heuristics import BlockSizes


def _check_cu_seqlens(name: str, cu, n_plus_1: int | None):
    if not hasattr(cu, "dtype") or not jnp.issubdtype(cu.dtype, jnp.integer) or cu.ndim != 1:
        raise TypeError(f"{name} must be a 1-D integer array, got {getattr(cu, 'dtype', cu)!r}")
    if cu.shape[0] < 2 or (n_plus_1 is not None and cu.shape[0] != n_plus_1):
        raise ValueError(f"{name} must have shape [N + 1] with N >= 1 shared, got {cu.shape}")


def _check_max_seqlen(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a Python int >= 1, got {value!r}")
    return value


def _unpack(x, cu, max_len: int):
    """[total, H, D] -> [N, max_len, H, D], zeros past each sequence's end."""
    rows = jnp.arange(max_len, dtype=jnp.int32)[None, :]
    idx = cu[:-1, None] + rows
    valid = rows < (cu[1:] - cu[:-1])[:, None]
    gathered = x[jnp.clip(idx, 0, x.shape[0] - 1)]
    return jnp.where(valid[..., None, None], gathered, 0)


def flash_attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    impl: str = "auto",
    block_sizes: BlockSizes | None = None,
):
    """Attention over N packed sequences, each with its own lengths.

    Args:
      q: [total_q, Hq, D]; k, v: [total_k, Hkv, D] (tokens of all sequences, concatenated).
      cu_seqlens_q, cu_seqlens_k: [N + 1] int, cumulative lengths starting at 0; sequence ``n``
        owns query tokens ``cu_seqlens_q[n]:cu_seqlens_q[n + 1]`` (likewise for keys).
      max_seqlen_q, max_seqlen_k: Python ints bounding every sequence's length (static).
      causal, softmax_scale, window_size, softcap, impl, block_sizes: as
        :func:`pallas_attn.flash_attention`; causal/window are bottom-right aligned per sequence.
      return_lse: also return the lse, float32 [Hq, total_q].

    Returns:
      out [total_q, Hq, D], or ``(out, lse)``. Tokens past ``cu_seqlens_q[-1]`` get 0 / -inf.
    """
    validation.resolve_impl(impl)  # an unknown impl is the first error
    validation.check_qkv(q, k, v, letters="THD")
    impl = api.resolve(impl, q, block_sizes=block_sizes, varlen=True)
    _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None)
    _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape[0])
    max_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    window = masks.normalize_window(causal, validation.check_window(window_size))
    softcap = validation.check_softcap(softcap)
    D = q.shape[-1]
    scale = validation.softmax_scale_or_default(softmax_scale, D)
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}")

    cu_q = cu_seqlens_q.astype(jnp.int32)
    cu_k = cu_seqlens_k.astype(jnp.int32)
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    qb, kb, vb = _unpack(q, cu_q, max_q), _unpack(k, cu_k, max_k), _unpack(v, cu_k, max_k)
    common = dict(softmax_scale=scale, window=window, softcap=softcap, q_offset=len_k - len_q)
    common["kv_len"] = len_k
    out, lse = api.run_impl(impl, qb, kb, vb, block_sizes=block_sizes, **common)

    # Pack back: token t belongs to sequence n (cu_q[n] <= t < cu_q[n + 1]) at row t - cu_q[n].
    tokens = jnp.arange(q.shape[0], dtype=jnp.int32)
    n = jnp.clip(jnp.searchsorted(cu_q[1:], tokens, side="right"), 0, len_q.shape[0] - 1)
    row = jnp.clip(tokens - cu_q[n], 0, max_q - 1)
    inside = tokens < cu_q[-1]
    out = jnp.where(inside[:, None, None], out[n, row], 0).astype(q.dtype)
    lse = jnp.where(inside[None, :], lse[n, :, row].T.astype(jnp.float32), -jnp.inf)
    return (out, lse) if return_lse else out
