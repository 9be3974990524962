"""models.fused_decode: one native call per decoder layer on CPU decode steps, against the
unfused modules on random small models and on SmolLM2."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from decoding import generate
from models import KVCache, fused_decode
from models.config import TransformerConfig
from models.transformer import Transformer, attach_decode_weights, pack_decode_weights

pytestmark = pytest.mark.skipif(
    not fused_decode.enabled(), reason="native CPU kernels not built or disabled"
)

TARGET = "pallas_attn_decode_layer"


def _config(*, heads, kv_heads, head_dim, bias=False, tied=False, dtype="float32", **kw):
    # Every projection at least DECODE_MIN_WEIGHTS weights: attach_decode_weights packs them all.
    return TransformerConfig(
        vocab_size=512,
        dim=320,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        mlp_dim=256,
        qkv_bias=bias,
        tie_embeddings=tied,
        dtype=dtype,
        **kw,
    )


def _model(config, seed=0):
    model = Transformer(config, rngs=nnx.Rngs(seed))
    if config.qkv_bias:  # random, not the zeros it starts with
        for i, layer in enumerate(model.layers):
            b = layer.attn.qkv_proj.bias
            b[...] = 0.5 * jax.random.normal(jax.random.key(100 + i), b.shape).astype(b.dtype)
    return model


def _cached_step(model, tokens, cache, *, fused: bool):
    """(logits, cache, HLO text) of one cached call, through the decode weights as generate
    attaches them."""
    model.fused_decode = fused
    graphdef, params = nnx.split(model)
    kernels = pack_decode_weights(model, params)

    @jax.jit
    def step(params, kernels, tokens, cache):
        m = attach_decode_weights(nnx.merge(graphdef, params), kernels)
        return m(tokens, cache=cache)

    lowered = step.lower(params, kernels, tokens, cache)
    logits, new = lowered.compile()(params, kernels, tokens, cache)
    return logits, new, lowered.as_text()


def _prefilled(model, B, *, paged, seed=0):
    """A cache holding ragged prompts (lengths 1 .. 20) for B rows."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 21, B).astype(np.int32)
    lengths[0] = 20
    if paged:  # rows' pages interleaved in the pool, one scratch page past them
        P, pages = 8, 4
        table = np.arange(B * pages, dtype=np.int32).reshape(pages, B).T.copy()
        cache = KVCache.paged(model.config, B * pages + 1, P, table)
    else:
        cache = KVCache.contiguous(model.config, B, 32)
    tokens = jnp.asarray(rng.integers(0, 512, (B, 20)), jnp.int32)
    model.fused_decode = False
    _, cache = model(tokens, cache=cache)
    return cache.replace(lengths=jnp.asarray(lengths)), rng


def _compare(model, B, T=1, *, paged=True):
    cache, rng = _prefilled(model, B, paged=paged)
    tokens = jnp.asarray(rng.integers(0, 512, (B, T)), jnp.int32)
    ref, ref_cache, ref_hlo = _cached_step(model, tokens, cache, fused=False)
    out, out_cache, hlo = _cached_step(model, tokens, cache, fused=True)
    assert TARGET in hlo and TARGET not in ref_hlo
    assert hlo.count(TARGET) >= model.config.num_layers
    logit_err = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
    cache_err = max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        for a, b in zip(out_cache.k + out_cache.v, ref_cache.k + ref_cache.v, strict=True)
    )
    np.testing.assert_array_equal(out_cache.lengths, ref_cache.lengths)
    return logit_err, cache_err


@pytest.mark.parametrize(
    "B, heads, kv_heads, head_dim, bias, tied, paged",
    [
        (1, 4, 4, 64, True, False, True),
        (3, 6, 2, 40, False, True, True),
        (8, 6, 2, 64, True, True, False),
        (3, 8, 8, 40, True, False, False),
    ],
)
def test_float32_matches_unfused(B, heads, kv_heads, head_dim, bias, tied, paged):
    config = _config(heads=heads, kv_heads=kv_heads, head_dim=head_dim, bias=bias, tied=tied)
    logit_err, cache_err = _compare(_model(config), B, paged=paged)
    assert logit_err <= 1e-5
    assert cache_err <= 1e-5


def test_bfloat16_close_to_unfused():
    # Within a layer the fused kernel rounds where XLA does; between layers XLA feeds the next
    # norm the unrounded residual sum, the fused layers its bfloat16 value: a few bfloat16 ulps.
    config = _config(heads=6, kv_heads=2, head_dim=64, bias=True, tied=True, dtype="bfloat16")
    logit_err, cache_err = _compare(_model(config), 3)
    assert logit_err <= 2e-2
    assert cache_err <= 0.05


def test_quantized_matches_unfused():
    # Each format on attention and MLP projections of one model: the same quantized products
    # (and activation handling) as the unfused layers, float32 reassociation only.
    config = _config(heads=6, kv_heads=2, head_dim=64, bias=True)
    names = ("attn/qkv_proj", "attn/o_proj", "mlp/gate_up_proj", "mlp/down_proj")
    paths = [f"layers/{i}/{n}" for i in range(config.num_layers) for n in names]
    fmts = {p: ("q8_0", "q4_0", "q4_1")[j % 3] for j, p in enumerate(paths)}
    model = models.quantize(_model(config), fmts)
    logit_err, cache_err = _compare(model, 3)
    assert logit_err <= 1e-4
    assert cache_err <= 1e-4


def test_verification_tokens():
    # T = 4 new tokens per row (a speculative verification): causal among them.
    config = _config(heads=6, kv_heads=2, head_dim=64)
    logit_err, cache_err = _compare(_model(config), 2, T=4)
    assert logit_err <= 1e-5
    assert cache_err <= 1e-5


def test_falls_back(monkeypatch):
    config = _config(heads=6, kv_heads=2, head_dim=64)
    model = _model(config)
    cache, _ = _prefilled(model, 2, paged=True)
    tokens = jnp.zeros((2, 1), jnp.int32)
    for other in (
        _model(_config(heads=6, kv_heads=2, head_dim=64, qk_norm=True)),  # Qwen3 / Gemma 3
        _model(_config(heads=6, kv_heads=2, head_dim=64, sandwich_norm=True)),
    ):
        assert TARGET not in _cached_step(other, tokens, cache, fused=True)[2]
    assert TARGET not in _cached_step(model, jnp.zeros((2, 9), jnp.int32), cache, fused=True)[2]
    monkeypatch.setenv(fused_decode.ENV, "0")
    assert TARGET not in _cached_step(model, tokens, cache, fused=True)[2]


@pytest.mark.parametrize("fmt", [None, "q4_1"])
def test_lowers_for_cuda_without_the_native_kernels(fmt):
    # A GPU program compiled from this CPU host (deviceless): the modules' XLA path, no CPU target.
    model = _model(_config(heads=6, kv_heads=2, head_dim=64, bias=True))
    model = model if fmt is None else models.quantize(model, fmt)
    graphdef, params = nnx.split(model)
    kernels = pack_decode_weights(model, params)
    cache = KVCache.contiguous(model.config, 2, 16)

    def step(params, kernels, tokens, cache):
        return attach_decode_weights(nnx.merge(graphdef, params), kernels)(tokens, cache=cache)[0]

    traced = jax.jit(step).trace(params, kernels, jnp.zeros((2, 1), jnp.int32), cache)
    assert TARGET in traced.lower().as_text()
    cuda_text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "pallas_attn_" not in cuda_text and "stablehlo.dot_general" in cuda_text


@pytest.mark.parametrize("fmt", [None, "q4_0"])
def test_bfloat16_cache_matches_unfused(fmt):
    # A float32 (or quantized) model over a bfloat16 cache: the fused layer rounds the new keys
    # and values once on the write, as the jnp scatter does, and reads them back exactly; a key
    # whose float32 value (RoPE reassociated) sits at a rounding boundary may differ by an ulp.
    config = _config(heads=6, kv_heads=2, head_dim=64, bias=True, kv_dtype="bfloat16")
    model = _model(config) if fmt is None else models.quantize(_model(config), fmt)
    cache, _ = _prefilled(model, 3, paged=True)
    assert cache.k[0].dtype == jnp.bfloat16
    logit_err, cache_err = _compare(model, 3)
    assert logit_err <= 1e-4
    assert cache_err <= 0.02


def _generate(model, prompts, n, *, fused):
    model.fused_decode = fused
    return generate(model, prompts, max_new_tokens=n).tokens


def test_generate_tokens_identical():
    config = _config(heads=6, kv_heads=2, head_dim=64, bias=True, tied=True)
    model = _model(config, seed=3)
    prompts = [[1, 2, 3, 4, 5], list(range(40, 57))]
    assert _generate(model, prompts, 32, fused=True) == _generate(model, prompts, 32, fused=False)


@functools.cache
def _smollm2(path):
    return models.load_gguf(path, dtype=jnp.float32)


@pytest.mark.slow  # two 30-layer programs compiled twice: about a minute on 2 cores
def test_generate_smollm2(smollm2_gguf):
    model = _smollm2(smollm2_gguf)
    _, tok = models.pretrained("smollm2-135m-instruct")
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    assert _generate(model, [prompt], 16, fused=True) == _generate(model, [prompt], 16, fused=False)
