"""Medusa drafting: greedy identical to ``generate(target)`` (ragged batch, EOS, both caches),
sampling exactly the target's distribution (chi-square), usage errors."""

from __future__ import annotations

import jax
import pytest
from conftest import random_transformer
from flax import nnx
from test_speculative import NEW, PROMPTS, reference  # noqa: F401 (a fixture)
from test_speculative_exact import SMALL, T07_TOPK, T1, _check

from decoding import Medusa, speculative_generate
from models import MedusaHeads


def random_heads(target, num_heads=4, seed=0, scale=0.3):
    """Heads initialised from the target's LM head, their residual layers random."""
    heads = MedusaHeads(target.config, num_heads, rngs=nnx.Rngs(seed)).init_from(target)
    for i, head in enumerate(heads.heads):
        shape = head.res.kernel.shape
        head.res.kernel.set_value(scale * jax.random.normal(jax.random.key(seed + i), shape))
    return heads


@pytest.mark.parametrize("k, cache", [(4, "paged"), (2, "contiguous")])
def test_chain_greedy_equals_generate(tiny_model, reference, k, cache):  # noqa: F811
    eos, want = reference
    draft = Medusa(random_heads(tiny_model))
    res = speculative_generate(
        tiny_model, draft, PROMPTS, num_draft_tokens=k, max_new_tokens=NEW, eos_id=eos,
        cache=cache,
    )  # fmt: skip
    assert res.tokens == want
    assert res.stats["num_draft_tokens"] == k
    assert 0 <= res.stats["acceptance_rate"] <= 1


@pytest.fixture(scope="module")
def small_target():
    return random_transformer(10, num_layers=2, **SMALL)


def test_chain_sampling_is_exact_t1(small_target):
    _check(small_target, Medusa(random_heads(small_target, 3, seed=5, scale=1.0)), 3, T1)


@pytest.mark.slow
def test_chain_sampling_is_exact_t07_top_k(small_target):
    _check(small_target, Medusa(random_heads(small_target, 2, seed=6, scale=1.0)), 2, T07_TOPK)


def test_bad_arguments(tiny_model):
    heads = random_heads(tiny_model, 2)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(tiny_model, Medusa(heads), PROMPTS, num_draft_tokens=3,
                             max_new_tokens=2)  # fmt: skip
    with pytest.raises(TypeError, match="heads"):
        Medusa(tiny_model)
    with pytest.raises(ValueError, match="num_heads"):
        MedusaHeads(tiny_model.config, 0, rngs=nnx.Rngs(0))
