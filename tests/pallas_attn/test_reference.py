"""The reference against an independent float64 NumPy loop."""

import jax.numpy as jnp
import numpy as np
import pytest
from attn_utils import max_err, numpy_attention, random_qkv

from pallas_attn import flash_attention, reference

CASES = [
    dict(B=1, T=1, S=1, Hq=1, Hkv=1, D=8),
    dict(B=2, T=7, S=7, Hq=4, Hkv=2, D=16, causal=True),
    dict(B=1, T=5, S=13, Hq=4, Hkv=1, D=8, causal=True, softcap=3.0),
    dict(B=2, T=9, S=6, Hq=2, Hkv=2, D=8, causal=True),  # T > S: early rows see nothing
    dict(B=1, T=11, S=11, Hq=3, Hkv=1, D=8, window=(3, 2)),
    dict(B=2, T=10, S=10, Hq=2, Hkv=1, D=8, causal=True, segments=True),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_reference_matches_numpy(case):
    case = dict(case)
    causal = case.pop("causal", False)
    window = case.pop("window", (-1, -1))
    softcap = case.pop("softcap", 0.0)
    segments = case.pop("segments", False)
    q, k, v = random_qkv(0, **case)
    B, T = case["B"], case["T"]
    q_seg = kv_seg = None
    if segments:
        rng = np.random.default_rng(0)
        q_seg = np.sort(rng.integers(0, 3, (B, T)), axis=1)
        kv_seg = q_seg.copy()
    scale = 0.37
    out, lse = flash_attention(
        q,
        k,
        v,
        causal=causal,
        window_size=window,
        softcap=softcap,
        softmax_scale=scale,
        q_segment_ids=None if q_seg is None else jnp.asarray(q_seg),
        kv_segment_ids=None if kv_seg is None else jnp.asarray(kv_seg),
        return_lse=True,
        impl="reference",
    )
    want_out, want_lse = numpy_attention(
        q,
        k,
        v,
        scale=scale,
        causal=causal,
        window=window,
        softcap=softcap,
        q_seg=q_seg,
        kv_seg=kv_seg,
    )
    assert max_err(out, want_out) < 1e-5
    assert max_err(lse, want_lse) < 1e-5


def test_reference_ragged_offsets_match_numpy():
    """Per-row q_offset / kv_start / kv_len (the KV-cache form of the mask)."""
    q, k, v = random_qkv(1, 3, 4, 12, 4, 2, 8)
    q_offset, kv_start, kv_len = np.array([0, 5, 8]), np.array([0, 2, 1]), np.array([4, 9, 12])
    out, lse = reference.attention(
        q,
        k,
        v,
        softmax_scale=0.5,
        window=(5, 0),
        q_offset=q_offset,
        kv_start=kv_start,
        kv_len=kv_len,
    )
    want_out, want_lse = numpy_attention(
        q, k, v, scale=0.5, window=(5, 0), q_offset=q_offset, kv_start=kv_start, kv_len=kv_len
    )
    assert max_err(out, want_out) < 1e-5
    assert max_err(lse, want_lse) < 1e-5
