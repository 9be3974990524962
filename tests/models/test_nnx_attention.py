import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.nnx_attention import pallas_attention_fn


def _mha(attention_fn):
    return nnx.MultiHeadAttention(
        num_heads=4,
        in_features=32,
        qkv_features=32,
        decode=False,
        attention_fn=attention_fn,
        rngs=nnx.Rngs(0),
    )


@pytest.mark.parametrize("causal", [False, True])
def test_matches_nnx_dot_product_attention(causal):
    x = jax.random.normal(jax.random.key(1), (2, 9, 32))
    ours = _mha(pallas_attention_fn(causal=causal, impl="xla"))
    theirs = _mha(nnx.dot_product_attention)
    mask = nnx.make_causal_mask(jnp.ones((2, 9))) if causal else None
    np.testing.assert_allclose(ours(x), theirs(x, mask=mask), atol=1e-5, rtol=1e-5)


def test_is_causal_flag_and_extra_batch_dims():
    x = jax.random.normal(jax.random.key(2), (2, 3, 7, 32))
    ours = _mha(pallas_attention_fn(impl="reference"))
    theirs = _mha(nnx.dot_product_attention)
    mask = nnx.make_causal_mask(jnp.ones((2, 3, 7)))
    np.testing.assert_allclose(ours(x, is_causal=True), theirs(x, mask=mask), atol=1e-5)


def test_mask_is_rejected():
    x = jnp.ones((1, 4, 32))
    with pytest.raises(ValueError, match="mask"):
        _mha(pallas_attention_fn())(x, mask=jnp.ones((1, 1, 4, 4), bool))
