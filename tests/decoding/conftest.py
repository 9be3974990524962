"""Shared fixtures: a tiny model with weights large enough that greedy output is not constant."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from models import Transformer, TransformerConfig


def random_transformer(seed: int = 0, scale: float = 0.3, **overrides) -> Transformer:
    """The "tiny" preset with every matrix drawn from N(0, scale^2) (norm weights stay 1)."""
    model = Transformer(TransformerConfig.preset("tiny", **overrides), rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [
        x if x.ndim < 2 else scale * jax.random.normal(k, x.shape, x.dtype)
        for k, x in zip(keys, leaves, strict=True)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@pytest.fixture(scope="session")
def tiny_model() -> Transformer:
    return random_transformer()
