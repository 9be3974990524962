import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_utils import jit_model

from models import KVCache, Transformer, TransformerConfig
from models.transformer import positions_from_segments


def _model(**overrides):
    config = TransformerConfig.preset("tiny", **{"attn_impl": "xla", **overrides})
    return jit_model(Transformer(config, rngs=nnx.Rngs(0)))


def _tokens(B, T, seed=1):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, 259, dtype=jnp.int32)


def test_full_forward_shape_dtype_and_causality():
    model = _model()
    tokens = _tokens(2, 9)
    logits = model(tokens)
    assert logits.shape == (2, 9, model.config.vocab_size) and logits.dtype == jnp.float32
    changed = tokens.at[:, 6].set((tokens[:, 6] + 1) % 259)
    other = model(changed)
    np.testing.assert_array_equal(logits[:, :6], other[:, :6])
    assert np.abs(logits[:, 6:] - other[:, 6:]).max() > 0


def test_impls_agree():
    overrides = dict(sliding_window=4, attn_softcap=20.0, final_softcap=30.0)
    tokens = _tokens(2, 13)
    xla = _model(**overrides)(tokens)
    reference = _model(**overrides, attn_impl="reference")(tokens)
    np.testing.assert_allclose(reference, xla, atol=2e-5, rtol=2e-5)


def test_packed_segments_equal_separate_sequences():
    model = _model()
    a, b = _tokens(1, 5, seed=2), _tokens(1, 7, seed=3)
    packed = jnp.concatenate([a, b], axis=1)
    seg = jnp.array([[0] * 5 + [1] * 7], jnp.int32)
    logits = model(packed, segment_ids=seg)
    np.testing.assert_allclose(logits[:, :5], model(a), atol=1e-5)
    np.testing.assert_allclose(logits[:, 5:], model(b), atol=1e-5)


def test_positions_from_segments():
    seg = jnp.array([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 5, 5]])
    np.testing.assert_array_equal(
        positions_from_segments(seg), [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    )


def _decode_all(model, tokens, cache, prefill):
    logits, cache = model(tokens[:, :prefill], cache=cache)
    steps = [logits]
    for i in range(prefill, tokens.shape[1]):
        logits, cache = model(tokens[:, i : i + 1], cache=cache)
        steps.append(logits)
    return jnp.concatenate(steps, axis=1), cache


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 3, "attn_softcap": 10.0}])
def test_prefill_then_decode_equals_full_forward_contiguous(overrides):
    model = _model(**overrides)
    tokens = _tokens(2, 12)
    full = model(tokens)
    cache = KVCache.contiguous(model.config, 2, 16)
    logits, cache = _decode_all(model, tokens, cache, prefill=5)
    np.testing.assert_allclose(logits, full, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [12, 12])


def test_prefill_then_decode_equals_full_forward_paged():
    model = _model()
    tokens = _tokens(2, 11)
    full = model(tokens)
    block_table = jnp.array([[3, 0, 5, -1], [1, 2, 4, -1]], jnp.int32)
    cache = KVCache.paged(model.config, num_pages=6, page_size=4, block_table=block_table)
    assert cache.capacity == 16 and cache.page_size == 4 and cache.is_paged
    logits, cache = _decode_all(model, tokens, cache, prefill=6)
    np.testing.assert_allclose(logits, full, atol=1e-5, rtol=1e-5)


def test_ragged_prefill_with_length_reset_and_rollback():
    """Right-padded prefill, lengths set to the prompt lengths, then decoding continues per row."""
    model = _model()
    long, short = _tokens(1, 7, seed=4), _tokens(1, 4, seed=5)
    pad = jnp.full((1, 3), model.config.pad_id, jnp.int32)
    batch = jnp.concatenate([long, jnp.concatenate([short, pad], axis=1)], axis=0)
    cache = KVCache.contiguous(model.config, 2, 12)
    _, cache = model(batch, cache=cache)
    cache = cache.replace(lengths=jnp.array([7, 4], jnp.int32))
    nxt = _tokens(2, 1, seed=6)
    logits, cache = model(nxt, cache=cache)
    ref_long = model(jnp.concatenate([long, nxt[:1]], axis=1))[:, -1]
    ref_short = model(jnp.concatenate([short, nxt[1:]], axis=1))[:, -1]
    np.testing.assert_allclose(logits[:, 0], jnp.concatenate([ref_long, ref_short]), atol=1e-5)
    # Rollback by one token and re-feed a different token.
    cache = cache.replace(lengths=cache.lengths - 1)
    other = (nxt + 1) % 259
    logits, _ = model(other, cache=cache)
    ref_short = model(jnp.concatenate([short, other[1:]], axis=1))[:, -1]
    np.testing.assert_allclose(logits[1, 0], ref_short[0], atol=1e-5)


@pytest.mark.parametrize("cached", [False, True])
def test_logits_at_is_the_full_logits_at_one_position_per_row(cached):
    model = _model()
    tokens = _tokens(3, 7)
    full = model(tokens)
    at = jnp.array([6, 0, 3], jnp.int32)
    if cached:
        cache = KVCache.contiguous(model.config, 3, 8)
        logits, cache = model(tokens, cache=cache, logits_at=at)
        np.testing.assert_array_equal(cache.lengths, [7, 7, 7])
    else:
        logits = model(tokens, logits_at=at)
    assert logits.shape == (3, 1, model.config.vocab_size)
    np.testing.assert_allclose(logits[:, 0], full[jnp.arange(3), at], atol=1e-5, rtol=1e-5)
    # With return_hidden the hidden states are every position's, the logits still one row's.
    _, h_full = model(tokens, return_hidden=True)
    if cached:
        cache = KVCache.contiguous(model.config, 3, 8)
        logits2, _, h = model(tokens, cache=cache, logits_at=at, return_hidden=True)
    else:
        logits2, h = model(tokens, logits_at=at, return_hidden=True)
    np.testing.assert_allclose(logits2, logits, atol=1e-6, rtol=1e-6)
    assert h.shape == (3, 7, model.config.dim)
    np.testing.assert_allclose(h, h_full, atol=1e-5, rtol=1e-5)


def test_bf16_forward_is_close_to_float32():
    model = Transformer(TransformerConfig.preset("tiny", attn_impl="xla"), rngs=nnx.Rngs(0))
    model16 = Transformer(
        TransformerConfig.preset("tiny", attn_impl="xla", dtype="bfloat16"), rngs=nnx.Rngs(0)
    )
    nnx.update(model16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model)))
    tokens = _tokens(2, 8)
    out16 = jit_model(model16)(tokens)
    assert out16.dtype == jnp.float32
    np.testing.assert_allclose(out16, jit_model(model)(tokens), atol=0.05)


def test_bad_input():
    model = Transformer(TransformerConfig.preset("tiny", attn_impl="xla"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="tokens"):
        model(jnp.zeros((3,), jnp.int32))
    cache = KVCache.contiguous(model.config, 1, 4)
    with pytest.raises(ValueError, match="segment_ids"):
        model(_tokens(1, 2), segment_ids=jnp.zeros((1, 2), jnp.int32), cache=cache)
    with pytest.raises(ValueError, match="logits_at"):
        model(_tokens(2, 3), logits_at=jnp.zeros((3,), jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize("paged", [False, True])
def test_cached_forward_through_interpreted_pallas_kernels(paged):
    """The cached forward with ``attn_impl="interpret"`` (the Pallas KV-cache kernels) equals
    the XLA path."""
    tokens = _tokens(2, 7)
    outs = []
    for impl in ("xla", "interpret"):
        model = _model(attn_impl=impl)
        if paged:
            table = jnp.array([[2, 0, -1], [1, 3, -1]], jnp.int32)
            cache = KVCache.paged(model.config, num_pages=4, page_size=4, block_table=table)
        else:
            cache = KVCache.contiguous(model.config, 2, 8)
        outs.append(_decode_all(model, tokens, cache, prefill=5)[0])
    np.testing.assert_allclose(outs[1], outs[0], atol=2e-5, rtol=2e-5)


def test_decode_layout_same_logits_and_only_for_big_kernels():
    """``attach_decode_weights`` (CPU): few-row calls multiply packed kernel copies, with the logits of
    the plain path; calls of more rows and small kernels keep the plain path; a tied LM head
    gets a packed copy of the embedding's transpose."""
    from models import rows_matmul
    from models.transformer import (
        DECODE_MIN_WEIGHTS,
        Linear,
        PackedWeights,
        attach_decode_weights,
        pack_decode_weights,
    )

    def laid_out(model):
        return attach_decode_weights(model, pack_decode_weights(model))

    if not rows_matmul.available():
        pytest.skip("no C++ compiler: attach_decode_weights is a no-op")
    config = TransformerConfig.preset(
        "tiny", attn_impl="xla", dim=192, mlp_dim=768, num_layers=2, tie_embeddings=False
    )
    plain = Transformer(config, rngs=nnx.Rngs(0))
    fast = laid_out(Transformer(config, rngs=nnx.Rngs(0)))
    made = {
        "/".join(map(str, path[-2:])): m.packed_kernel is not None
        for path, m in nnx.iter_modules(fast)
        if isinstance(m, Linear) and path[:2] in (("layers", 0), ("lm_head",))
    }
    # qkv (192 x 384), gate_up (192 x 1536) and down (768 x 192) qualify; o (192 x 192) and
    # the LM head (192 x 259) have under 2^16 weights.
    assert DECODE_MIN_WEIGHTS == 1 << 16
    assert made == {
        "attn/qkv_proj": True,
        "attn/o_proj": False,
        "mlp/gate_up_proj": True,
        "mlp/down_proj": True,
        "lm_head": False,
    }
    for _, m in nnx.iter_modules(fast):
        if isinstance(m, Linear) and m.packed_kernel is not None:
            assert isinstance(m.packed_kernel, PackedWeights)
            np.testing.assert_array_equal(m.packed_kernel[...], rows_matmul.pack(m.kernel[...]))
    assert fast.packed_head is None  # untied
    narrow = laid_out(Transformer(TransformerConfig.preset("tiny"), rngs=nnx.Rngs(0)))
    assert narrow.packed_head is None and all(
        m.packed_kernel is None for _, m in nnx.iter_modules(narrow) if isinstance(m, Linear)
    )
    tied_config = config.replace(tie_embeddings=True, vocab_size=512)
    tied = laid_out(Transformer(tied_config, rngs=nnx.Rngs(0)))
    np.testing.assert_array_equal(
        tied.packed_head[...], rows_matmul.pack(tied.embed.embedding[...].T)
    )
    x = _tokens(4, 2, seed=4)
    np.testing.assert_allclose(
        np.asarray(tied(x)),
        np.asarray(Transformer(tied_config, rngs=nnx.Rngs(0))(x)),
        rtol=1e-5,
        atol=1e-5,
    )
    prompt = _tokens(4, 7)
    for T in (1, 3):  # decode step and verification-sized calls (4 and 12 rows)
        cache = KVCache.contiguous(config, 4, 16)
        _, cache = plain(prompt, cache=cache)
        a, _ = plain(_tokens(4, T, seed=2), cache=cache)
        b, _ = fast(_tokens(4, T, seed=2), cache=cache)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    # A prefill (28 rows still few) and a long one (4 x 40 rows: the plain path, same numbers).
    for T in (7, 40):
        x = _tokens(4, T, seed=3)
        np.testing.assert_allclose(np.asarray(plain(x)), np.asarray(fast(x)), rtol=1e-5, atol=1e-5)


def test_decode_layout_bfloat16_weights():
    """A bfloat16 model's packed products (bfloat16 panels, float32 accumulation) give the plain
    path's logits within bfloat16 rounding of the outputs."""
    from models import rows_matmul
    from models.transformer import attach_decode_weights, pack_decode_weights

    if not rows_matmul.available():
        pytest.skip("no C++ compiler: attach_decode_weights is a no-op")
    config = TransformerConfig.preset(
        "tiny", attn_impl="xla", dim=256, mlp_dim=512, num_layers=2, dtype="bfloat16"
    )
    plain = Transformer(config, rngs=nnx.Rngs(1))
    fast = Transformer(config, rngs=nnx.Rngs(1))
    kernels = pack_decode_weights(fast)
    assert kernels and all(k.dtype == jnp.bfloat16 for k in kernels.values())
    fast = attach_decode_weights(fast, kernels)
    cache = KVCache.contiguous(config, 2, 16)
    _, cache = plain(_tokens(2, 5), cache=cache)
    a, _ = plain(_tokens(2, 2, seed=2), cache=cache)
    b, _ = fast(_tokens(2, 2, seed=2), cache=cache)
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    err = np.max(np.abs(a - b)) / np.max(np.abs(a))
    assert err <= 0.01, err  # 0.0036 here: outputs rounded to bfloat16 per op


@pytest.mark.parametrize("paged", [False, True])
def test_empty_cache_arrays_are_distinct_zero_buffers(paged):
    """One jitted call makes all of a cache's K and V arrays; each must be its own buffer
    (generate and the engine donate them) and all zeros, in the config's dtype."""
    config = TransformerConfig(
        vocab_size=16, dim=16, num_layers=3, num_heads=2, num_kv_heads=1, mlp_dim=32
    )
    if paged:
        cache = KVCache.paged(config, 5, 4, np.zeros((2, 3), np.int32))
    else:
        cache = KVCache.contiguous(config, 2, 8)
    arrays = cache.k + cache.v
    assert len({a.unsafe_buffer_pointer() for a in arrays}) == 2 * config.num_layers
    for a in arrays:
        assert a.dtype == config.jnp_dtype and not np.asarray(a).any()
    assert KVCache.contiguous(config, 2, 8, dtype=jnp.bfloat16).k[0].dtype == jnp.bfloat16


def test_configure_changes_runtime_fields_and_shares_weights():
    import models

    model = Transformer(TransformerConfig.preset("tiny"), rngs=nnx.Rngs(0))
    narrow = models.configure(model, kv_dtype="bfloat16", attn_impl="xla")
    assert model.config.kv_dtype is None  # the original is untouched
    assert narrow.config.kv_dtype == "bfloat16" and narrow.config.attn_impl == "xla"
    assert all(layer.attn.config == narrow.config for layer in narrow.layers)
    assert narrow.embed.embedding[...] is model.embed.embedding[...]
    assert KVCache.contiguous(narrow.config, 1, 8).k[0].dtype == jnp.bfloat16
    assert models.configure(model, kv_dtype=jnp.float16).config.kv_dtype == "float16"
    assert models.configure(narrow, kv_dtype=None).config.kv_dtype is None
    with pytest.raises(ValueError, match="dim"):
        models.configure(model, dim=8)
    with pytest.raises(ValueError, match="kv_dtype"):
        models.configure(model, kv_dtype="int8")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_bfloat16_cache_close_to_float32(paged):
    import models

    model = Transformer(TransformerConfig.preset("tiny", attn_impl="xla"), rngs=nnx.Rngs(0))
    narrow = models.configure(model, kv_dtype="bfloat16")
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, model.config.vocab_size)
    out = {}
    for name, m in (("f32", model), ("bf16", narrow)):
        if paged:
            cache = KVCache.paged(m.config, 9, 4, np.arange(8, dtype=np.int32).reshape(2, 4))
        else:
            cache = KVCache.contiguous(m.config, 2, 16)
        _, cache = m(tokens[:, :10], cache=cache)
        assert cache.k[0].dtype == m.config.kv_jnp_dtype
        logits, _ = m(tokens[:, 10:], cache=cache)
        out[name] = np.asarray(logits)
    scale = np.abs(out["f32"]).max()
    assert 0 < np.abs(out["bf16"] - out["f32"]).max() <= 2e-2 * scale
