"""The roofline arithmetic and goal report of ``benchmarks/generate.py`` (no timing, no torch)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from benchmarks.generate import goals, step_bytes
from models import Transformer, TransformerConfig


@pytest.mark.parametrize("tied", [False, True])
def test_step_bytes_counts_every_weight_but_a_gathered_embedding_and_the_kv_read(tied):
    config = TransformerConfig.preset("tiny", tie_embeddings=tied)
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    sizes = {
        "/".join(str(getattr(k, "key", k)) for k in path): np.prod(x.shape)
        for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    }
    read = sum(n for name, n in sizes.items() if tied or not name.startswith("embed"))
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.resolved_head_dim
    assert step_bytes(config, 1, 0) == 4 * read
    assert step_bytes(config, 3, 10.5) == 4 * (read + 3 * 10.5 * kv_per_token)
    half = config.replace(dtype="bfloat16")
    assert step_bytes(half, 3, 10.5) == step_bytes(config, 3, 10.5) / 2


def test_goals_report_each_measured_goal_and_whether_it_is_met():
    rows = [
        dict(config="tiny", batch=1, dtype="float32", speedup=4.5, roofline=0.3),
        dict(config="tiny", batch=1, dtype="bfloat16", speedup=9.0, roofline=0.9),
        dict(config="small", batch=1, dtype="float32", speedup=1.0, roofline=0.79),
    ]
    got = {(g["config"], g["batch"], g["metric"]): (g["value"], g["met"]) for g in goals(rows)}
    assert got == {("tiny", 1, "speedup"): (4.5, True), ("small", 1, "roofline"): (0.79, False)}
