"""The public ``flash_attention``: validation, defaults, dispatch on ``impl``."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_attn import masks, reference, validation, xla
from pallas_attn.heuristics import BlockSizes


def flash_attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    q_segment_ids=None,
    kv_segment_ids=None,
    return_lse: bool = False,
    impl: str = "auto",
    block_sizes: BlockSizes | None = None,
):
    """Scaled dot-product attention, ``softmax(scale * Q K^T + mask) V``, without the T x S matrix.

    Args:
      q: [B, T, Hq, D]; k, v: [B, S, Hkv, D], float32 / bfloat16 / float16, ``Hq % Hkv == 0``
        (query head ``h`` reads KV head ``h // (Hq // Hkv)``).
      causal: query ``i`` sees keys up to position ``i + S - T`` (bottom-right aligned). For
        T = 2, S = 5 (1 = visible; with T > S the first T - S rows see nothing: out 0)::

            causal=True            window_size=(1, 0)     window_size=(1, 1)
            1 1 1 1 0              0 0 1 1 0              0 0 1 1 1
            1 1 1 1 1              0 0 0 1 1              0 0 0 1 1

      softmax_scale: default ``1 / sqrt(D)``; a finite Python or NumPy float > 0.
      window_size: ``(left, right)``: query ``i`` sees keys ``[i + S - T - left, i + S - T + right]``,
        ``-1`` = unbounded on that side; ``causal`` is ``right = 0``.
      softcap: if > 0, scores become ``softcap * tanh(s / softcap)`` after scaling (finite, >= 0).
      q_segment_ids, kv_segment_ids: [B, T] and [B, S] ints; a query only sees keys of its own
        segment (packed sequences). Give both or neither.
      return_lse: also return the log-sum-exp of the scaled scores, natural log, float32
        [B, Hq, T]; ``-inf`` for a row that sees no key (whose output is 0).
      impl: "reference", "xla", "pallas" / "interpret" (Triton kernels, compiled or under the
        Pallas interpreter), "mosaic" / "mosaic_interpret" (Hopper kernels: TMA and wgmma,
        16-bit inputs, D <= 128; compiled for sm_90a or under JAX's GPU interpreter) or
        "auto": mosaic on sm_90+ for 16-bit inputs, pallas on other GPUs, else xla.
      block_sizes: tile sizes for "xla"/"pallas"/"interpret"/"mosaic"; default per head dim and
        dtype.

    Returns:
      ``out`` [B, T, Hq, D] in q's dtype, or ``(out, lse)`` when ``return_lse``. Differentiable in
      q, k and v; the lse is differentiable too, with every impl (the backward folds its
      cotangent into ``delta = rowsum(dO * O) - dlse``). First derivatives only, except with
      ``impl="reference"``: differentiating the backward raises ValueError.

    Raises:
      ValueError / TypeError naming the argument: wrong rank, empty dim, dtype mismatch,
      ``Hq % Hkv != 0``, bad window, NaN/inf or negative ``softcap``/``softmax_scale``, unknown impl.
    """
    validation.check_qkv(q, k, v, letters="BTHD")
    impl = resolve(impl, q, block_sizes=block_sizes)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch of q ({q.shape[0]}) must equal batch of k ({k.shape[0]})")
    B, T, _, D = q.shape
    S = k.shape[1]
    window = masks.normalize_window(causal, validation.check_window(window_size))
    softcap = validation.check_softcap(softcap)
    scale = validation.softmax_scale_or_default(softmax_scale, D)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if q_segment_ids is not None:
        validation.check_int_array("q_segment_ids", q_segment_ids, (B, T))
        validation.check_int_array("kv_segment_ids", kv_segment_ids, (B, S))
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise TypeError(f"block_sizes must be a BlockSizes, got {type(block_sizes).__name__}")

    common = dict(
        softmax_scale=scale,
        window=window,
        softcap=softcap,
        q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids,
    )
    out, lse = run_impl(impl, q, k, v, block_sizes=block_sizes, **common)
    return (out, lse.astype(jnp.float32)) if return_lse else out


def resolve(impl, q, *, block_sizes: BlockSizes | None, varlen: bool = False) -> str:
    """``impl`` checked, with ``"auto"`` resolved for this call: ``"mosaic"`` on sm_90+ where the
    Mosaic kernels take ``q`` and ``block_sizes`` (16-bit, D <= 128, their tiles), else
    ``"pallas"`` on a GPU and ``"xla"`` elsewhere. A forced ``"mosaic"`` stays, and raises at
    the call where it does not apply."""
    resolved = validation.resolve_impl(impl, mosaic_dtype=q.dtype)
    if impl == "auto" and resolved == "mosaic":
        from pallas_attn import mosaic  # the Mosaic GPU kernels: imported only on sm_90+

        try:
            mosaic.check_supported(q, block_sizes=block_sizes, varlen=varlen)
        except (TypeError, ValueError):
            return "pallas"
    return resolved


def run_impl(impl: str, q, k, v, *, block_sizes: BlockSizes | None, **kwargs):
    """Runs a resolved ``impl`` on checked [B, T, H, D] inputs; ``kwargs`` as
    :func:`pallas_attn.reference.attention` (window normalised). Returns ``(out, lse)``."""
    if impl == "reference":
        return reference.attention(q, k, v, **kwargs)
    if impl == "xla":
        blocks = {}
        if block_sizes is not None:
            blocks = dict(block_q=block_sizes.block_q, block_k=block_sizes.block_k)
        return xla.attention(q, k, v, **kwargs, **blocks)
    if impl in ("mosaic", "mosaic_interpret"):
        from pallas_attn import mosaic  # the Mosaic GPU kernels: imported only when asked for

        varlen = bool(kwargs.keys() & {"q_offset", "kv_start", "kv_len"})  # per-row lengths
        mosaic.check_supported(q, block_sizes=block_sizes, varlen=varlen)
        return mosaic.attention(
            q, k, v, **kwargs, block_sizes=block_sizes, interpret=impl == "mosaic_interpret"
        )
    from pallas_attn import flash  # the Pallas kernels: imported only when asked for

    block_sizes = block_sizes or BlockSizes.get_default(q.shape[-1], q.dtype)
    return flash.attention(
        q, k, v, **kwargs, block_sizes=block_sizes, interpret=impl == "interpret"
    )
