"""A drop-in ``attention_fn`` for ``flax.nnx.MultiHeadAttention`` backed by ``pallas_attn``."""

from __future__ import annotations

import pallas_attn


def pallas_attention_fn(
    *, causal: bool = False, window_size=(-1, -1), softcap: float = 0.0, impl: str = "auto"
):
    """An ``attention_fn`` with the signature of ``nnx.dot_product_attention``.

    ``nnx.MultiHeadAttention(..., attention_fn=pallas_attention_fn(causal=True))`` then computes
    attention through :func:`pallas_attn.flash_attention` (query, key, value ``[B, T, H, D]``; the
    leading batch dims of NNX are flattened into B). Masks are expressed with ``causal`` /
    ``window_size`` (or the call's ``is_causal``), not with a boolean ``mask`` or ``bias``, which
    raise ValueError; dropout on the attention weights is not supported.
    """

    def attention_fn(
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout=True,
        dropout_rng=None,
        dropout_rate=0.0,
        deterministic=False,
        dtype=None,
        precision=None,
        module=None,
        promote_dtype=None,
        is_causal=False,
    ):
        if bias is not None or mask is not None:
            raise ValueError("pallas attention_fn takes no mask/bias; use causal / window_size")
        if dropout_rate > 0.0 and not deterministic:
            raise ValueError(f"attention dropout is not supported, got dropout_rate={dropout_rate}")
        if dtype is not None:
            query, key, value = (x.astype(dtype) for x in (query, key, value))
        batch = query.shape[:-3]
        q, k, v = (x.reshape(-1, *x.shape[-3:]) for x in (query, key, value))
        out = pallas_attn.flash_attention(
            q,
            k,
            v,
            causal=causal or is_causal,
            window_size=window_size,
            softcap=softcap,
            impl=impl,
        )
        return out.reshape(*batch, *out.shape[-3:])

    return attention_fn
