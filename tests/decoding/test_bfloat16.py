"""bfloat16 weights through every decode path, tied and untied LM heads, with the CPU's packed
few-row products in play (matrices of at least ``DECODE_MIN_WEIGHTS``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decoding import Engine, PromptLookup, generate, speculative_generate
from models import Transformer, TransformerConfig
from models.transformer import DECODE_MIN_WEIGHTS, pack_decode_weights

PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 3], [7, 8, 2]]
NEW = 10


def model(tied: bool) -> Transformer:
    config = TransformerConfig(
        vocab_size=1024,
        dim=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=512,
        tie_embeddings=tied,
        max_position=256,
        dtype="bfloat16",
    )
    m = Transformer(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(m)
    keys = iter(jax.random.split(jax.random.key(1), 64))
    params = jax.tree.map(
        lambda x: (
            x if x.ndim < 2 else (0.3 * jax.random.normal(next(keys), x.shape)).astype(x.dtype)
        ),
        params,
    )
    return nnx.merge(graphdef, params)


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def bf16_model(request):
    m = model(request.param)
    assert m.config.vocab_size * m.config.dim >= DECODE_MIN_WEIGHTS
    kernels = pack_decode_weights(m)
    if kernels:  # the native kernels are built here: the packed head is among them
        assert ("embed.T" in kernels) == request.param
    return m


@pytest.fixture(scope="module")
def greedy(bf16_model):
    return generate(bf16_model, PROMPTS, max_new_tokens=NEW).tokens


def test_generate_both_caches(bf16_model, greedy):
    assert all(len(t) == NEW for t in greedy)
    assert generate(bf16_model, PROMPTS, max_new_tokens=NEW, cache="contiguous").tokens == greedy


def test_speculative(bf16_model, greedy):
    res = speculative_generate(
        bf16_model, PromptLookup(), PROMPTS, num_draft_tokens=3, max_new_tokens=NEW
    )
    assert res.tokens == greedy


def test_engine(bf16_model, greedy):
    eng = Engine(bf16_model, max_batch=2, num_pages=8, page_size=16, max_seq_len=64)
    rids = [eng.submit(p, NEW) for p in PROMPTS]
    out = eng.run_until_done()
    assert [out[r] for r in rids] == greedy


def test_logits_are_float32(bf16_model):
    logits = bf16_model(jnp.asarray(PROMPTS[:1]))
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
