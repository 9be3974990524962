import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from models import PRESETS, Transformer, TransformerConfig


def test_presets_and_overrides():
    c = TransformerConfig.preset("tiny", attn_impl="xla")
    assert c.attn_impl == "xla" and c.vocab_size == PRESETS["tiny"].vocab_size
    assert c.resolved_head_dim == c.dim // c.num_heads
    with pytest.raises(ValueError, match="unknown preset"):
        TransformerConfig.preset("nope")


def test_config_is_frozen_and_hashable():
    c = TransformerConfig.preset("tiny")
    assert hash(c) == hash(TransformerConfig.preset("tiny"))
    with pytest.raises(AttributeError):
        c.dim = 3


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_kv_heads", 3),
        ("attn_impl", "cuda"),
        ("dtype", "int8"),
        ("sliding_window", 0),
        ("kv_dtype", "float64"),
        ("kv_dtype", "int8"),
    ],
)
def test_bad_fields_raise_naming_them(field, value):
    with pytest.raises(ValueError, match=field):
        TransformerConfig.preset("tiny", **{field: value})


def test_window_size():
    assert TransformerConfig.preset("tiny").window_size == (-1, 0)
    assert TransformerConfig.preset("tiny", sliding_window=5).window_size == (4, 0)


@pytest.mark.parametrize("name", ["code-draft", "code-target", "llama-3-8b", "mistral-7b"])
def test_preset_shapes_and_param_count(name):
    """Builds each preset abstractly (nothing allocated) and checks num_params() against it."""
    config = PRESETS[name]
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    count = sum(x.size for x in jax.tree.leaves(params))
    assert count == config.num_params()
    assert abstract.embed.embedding.shape == (config.vocab_size, config.dim)


def test_shipped_sizes():
    assert 5e6 <= PRESETS["code-target"].num_params() <= 10e6
    assert 0.5e6 <= PRESETS["code-draft"].num_params() <= 1e6


def test_kv_dtype():
    c = TransformerConfig.preset("tiny")
    assert c.kv_dtype is None and c.kv_jnp_dtype == c.jnp_dtype == jnp.float32
    assert c.replace(kv_dtype="bfloat16").kv_jnp_dtype == jnp.bfloat16
    assert c.replace(kv_dtype="float16").kv_jnp_dtype == jnp.float16
    bf16 = c.replace(dtype="bfloat16")
    assert bf16.replace(kv_dtype="bfloat16").kv_jnp_dtype == jnp.bfloat16
    for bad in ("float16", "float32"):  # only a float32 model narrows its cache
        with pytest.raises(ValueError, match="kv_dtype"):
            bf16.replace(kv_dtype=bad)
