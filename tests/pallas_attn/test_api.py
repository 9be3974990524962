"""Bad input raises at the public API, naming the argument."""

import jax.numpy as jnp
import pytest

from pallas_attn import BlockSizes, flash_attention


def _qkv(T=4, S=4, Hq=4, Hkv=2, D=8, B=1, dtype=jnp.float32):
    return (
        jnp.zeros((B, T, Hq, D), dtype),
        jnp.zeros((B, S, Hkv, D), dtype),
        jnp.zeros((B, S, Hkv, D), dtype),
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (_qkv(Hq=6, Hkv=4), {}, ValueError, "Hq=6"),
        ((_qkv()[0], *_qkv(D=16)[1:]), {}, ValueError, "head dim"),
        ((jnp.zeros((4, 4, 8)), *_qkv()[1:]), {}, ValueError, "q must have rank 4"),
        ((_qkv()[0], jnp.zeros((1, 4, 2)), _qkv()[2]), {}, ValueError, "k must have rank 4"),
        (_qkv(), {"impl": "cuda"}, ValueError, "impl"),
        (_qkv(), {"window_size": (2,)}, ValueError, "window_size"),
        (_qkv(), {"window_size": (-2, 0)}, ValueError, "window_size"),
        (_qkv(), {"softcap": -1.0}, ValueError, "softcap"),
        (_qkv(), {"softmax_scale": 0.0}, ValueError, "softmax_scale"),
        (_qkv(), {"q_segment_ids": jnp.zeros((1, 4), jnp.int32)}, ValueError, "segment"),
        (
            _qkv(),
            {
                "q_segment_ids": jnp.zeros((1, 5), jnp.int32),
                "kv_segment_ids": jnp.zeros((1, 4), jnp.int32),
            },
            ValueError,
            "q_segment_ids",
        ),
        (_qkv(dtype=jnp.int32), {}, TypeError, "q must have dtype"),
        ((*_qkv()[:2], _qkv(dtype=jnp.bfloat16)[2]), {}, TypeError, "dtype"),
        ((_qkv()[0], *_qkv(B=2)[1:]), {}, ValueError, "batch"),
        (_qkv(), {"block_sizes": (64, 64)}, TypeError, "block_sizes"),
        (([[1.0]], *_qkv()[1:]), {}, TypeError, "q must be an array"),
    ],
)
def test_bad_input_raises(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        flash_attention(*args, **kwargs)


def test_block_sizes_reject_non_positive():
    with pytest.raises(ValueError, match="block_q"):
        BlockSizes(block_q=0)


def test_auto_dispatch_runs_on_cpu_and_returns_dtype():
    q, k, v = _qkv(dtype=jnp.bfloat16)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (1, 4, 4)
