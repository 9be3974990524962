"""generate / speculative_generate on a model with sliding-window layers: a paged cache gives
those layers rings of pages (models.kv_cache) when that holds fewer pages than a row, with the
same tokens as the contiguous cache."""

from __future__ import annotations

import pytest
from flax import nnx

from decoding import PromptLookup, generate, speculative_generate
from decoding.generate import bucket, make_cache
from models import Transformer, TransformerConfig
from models.kv_cache import ring_pages_for

WINDOW, PAGE = 4, 4


@pytest.fixture(scope="module")
def windowed():
    config = TransformerConfig(
        vocab_size=64,
        dim=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=64,
        sliding_window=WINDOW,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        attn_impl="xla",
    )
    return Transformer(config, rngs=nnx.Rngs(3))


PROMPTS = [[5, 9, 2, 7, 5, 9, 2], [11, 3, 5]]


def test_paged_cache_rings_its_sliding_layers(windowed):
    batch = bucket(PROMPTS, 40)
    T = batch.tokens.shape[1]
    n_pad = len(batch.done) - batch.num_rows
    cache, _ = make_cache(windowed, "paged", batch.need, n_pad, batch.capacity, PAGE, None, T)
    R = ring_pages_for(WINDOW, T, PAGE)
    rows = len(batch.done)
    assert cache.ring_pages == R and R * PAGE < batch.capacity
    assert cache.k[0].shape[0] == cache.k[2].shape[0] == rows * R  # the sliding layers
    assert cache.k[1].shape[0] > rows * R  # the global layer: every page of every row
    plain, _ = make_cache(windowed, "paged", batch.need, n_pad, batch.capacity, PAGE, None)
    assert plain.ring_pages is None  # no max_call, no ring


def test_generate_with_rings_equals_contiguous(windowed):
    want = generate(windowed, PROMPTS, max_new_tokens=40, cache="contiguous").tokens
    got = generate(windowed, PROMPTS, max_new_tokens=40, cache="paged", page_size=PAGE).tokens
    assert got == want and all(len(r) == 40 for r in want)
    spec = speculative_generate(
        windowed,
        PromptLookup(),
        PROMPTS,
        max_new_tokens=40,
        num_draft_tokens=3,
        cache="paged",
        page_size=PAGE,
    ).tokens
    assert spec == want
