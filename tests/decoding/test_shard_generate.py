"""Greedy ``generate`` and the ``Engine`` with a sharded model equal the single-device tokens.

Runs in the 8-device pytest process started by
``tests/models/test_shard.py::test_sharding_on_8_host_devices`` (skipped elsewhere). ``generate``
runs its two dispatches under ``jax.transfer_guard("disallow")``, so these tests also show that
the sharded prefill and decode loop need no implicit transfer.
"""

from __future__ import annotations

import jax
import pytest
from conftest import random_transformer
from flax import nnx

import models
from decoding import (
    EarlyExit,
    Engine,
    Medusa,
    PromptLookup,
    TreeSpec,
    compiled_count,
    generate,
    speculative_generate,
)

pytestmark = pytest.mark.skipif(
    jax.device_count() < 8,
    reason="runs in the 8-device process of tests/models/test_shard.py",
)
OVERRIDES = dict(num_layers=1, num_heads=16, num_kv_heads=8, head_dim=8, attn_impl="xla")
# 6 ragged rows, padded to a batch of 8: rows split over every "data" axis below.
PROMPTS = [[5, 6, 7], [1], [200, 3, 3, 9, 12], [42, 42], [7, 1, 7, 1, 7, 1, 7], [100, 101]]
NEW = 10


@pytest.fixture(scope="module")
def single_device_tokens():
    return generate(random_transformer(**OVERRIDES), PROMPTS, max_new_tokens=NEW).tokens


@pytest.mark.parametrize("shape", [(1, 8), (2, 4), (8, 1)])
@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_sharded_greedy_generate_equals_single_device(shape, cache, single_device_tokens):
    assert len({tuple(t) for t in single_device_tokens}) > 1  # rows differ: a real check
    mesh = jax.make_mesh(shape, ("data", "model"))
    model = models.shard(random_transformer(**OVERRIDES), mesh)
    res = generate(model, PROMPTS, max_new_tokens=NEW, cache=cache, page_size=4)
    assert res.tokens == single_device_tokens
    assert res.stats["steps"] == NEW


def _engine_tokens(model):
    engine = Engine(model, num_pages=64, page_size=4, max_batch=4, max_seq_len=64)
    ids = [engine.submit(p, max_new_tokens=6) for p in PROMPTS]
    out = engine.run_until_done()
    return [out[i] for i in ids]


def test_engine_with_a_sharded_model_equals_single_device():
    """Continuous batching (4 rows for 6 requests, chunked prefill, shared pool) on (2, 4)."""
    want = _engine_tokens(random_transformer(**OVERRIDES))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    assert _engine_tokens(models.shard(random_transformer(**OVERRIDES), mesh)) == want


TWO_LAYERS = {**OVERRIDES, "num_layers": 2}  # room for an early exit


def test_speculation_on_a_sharded_target_equals_single_device():
    """Every chain draft kind on a (2, 4)-sharded target: weightless kinds as they are, Medusa
    heads replicated over the mesh, a model draft sharded over it; greedy = the target's tokens.
    (JAX raised "Disallowed device-to-device transfer" from inside the loop.)"""
    from test_medusa import random_heads

    want = generate(random_transformer(**TWO_LAYERS), PROMPTS, max_new_tokens=NEW).tokens
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    target = models.shard(random_transformer(**TWO_LAYERS), mesh)
    draft = models.shard(random_transformer(1, **OVERRIDES), mesh)
    heads = random_heads(random_transformer(**TWO_LAYERS), 2)
    for d in (PromptLookup(), EarlyExit(1), draft, Medusa(heads)):
        res = speculative_generate(target, d, PROMPTS, max_new_tokens=NEW, page_size=4)
        assert res.tokens == want, d
    assert all(leaf.sharding.num_devices == 1 for leaf in jax.tree.leaves(nnx.state(heads)))


def test_speculation_that_cannot_run_sharded_fails_before_work():
    from test_medusa import random_heads

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    target = models.shard(random_transformer(**OVERRIDES), mesh)
    heads = random_heads(random_transformer(**OVERRIDES), 2)
    before = compiled_count()
    with pytest.raises(ValueError, match=r"models.shard\(draft, target.mesh\)"):
        speculative_generate(target, random_transformer(1, **OVERRIDES), PROMPTS, max_new_tokens=2)
    with pytest.raises(ValueError, match="tree attention"):
        speculative_generate(
            target, Medusa(heads, tree=TreeSpec.default(2)), PROMPTS, max_new_tokens=2
        )
    assert compiled_count() == before
