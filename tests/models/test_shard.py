"""Tensor + data parallel sharding (``models.shard``) on 8 host CPU devices.

XLA_FLAGS=--xla_force_host_platform_device_count=8 only takes effect before jax starts, so
``test_sharding_on_8_host_devices`` runs this file and ``tests/decoding/test_shard_generate.py``
in a fresh pytest process with the flag set; in that process the 8-device tests below run and
the launcher skips itself. In the parent process (any device count) they are skipped.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import models
from models import KVCache, Transformer, TransformerConfig, data, train
from models.sharding import mesh_of
from models.transformer import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv

ROOT = Path(__file__).resolve().parents[2]
SHARD_FILES = ("tests/models/test_shard.py", "tests/decoding/test_shard_generate.py")
MESHES = [(1, 8), (2, 4), (8, 1)]
ON_8 = jax.device_count() >= 8
needs_8 = pytest.mark.skipif(
    not ON_8, reason="runs in the 8-device process of test_sharding_on_8_host_devices"
)
# GQA with G = 2 and Hkv = 8: every mesh above divides the KV heads, mlp_dim and V = 264. One
# layer: every layer runs the same code, and compiling the attention loops dominates the time.
CONFIG = TransformerConfig.preset(
    "tiny",
    num_layers=1,
    num_heads=16,
    num_kv_heads=8,
    head_dim=8,
    tie_embeddings=False,
    attn_impl="xla",
)


@pytest.mark.skipif(ON_8, reason="already on 8 devices: the sharding tests run in this process")
def test_sharding_on_8_host_devices():
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [*cmd, "-m", "not slow", *SHARD_FILES],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= 10, log  # the 8-device tests did run


def _mesh(shape):
    return jax.make_mesh(shape, ("data", "model"))


def _has_spec(x, mesh, spec) -> bool:
    return x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)


def _model(seed=0):
    return Transformer(CONFIG, rngs=nnx.Rngs(seed))


def _forward(model, tokens, segment_ids):
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda s, t, seg: nnx.merge(graphdef, s)(t, segment_ids=seg))
    return run(state, tokens, segment_ids)


def _batch(B=8, T=24, seed=0):
    stream = np.random.default_rng(seed).integers(0, 256, size=4000).astype(np.uint16)
    stream[::29] = 256  # document starts: packed windows with several segments
    return data.windows(stream, np.arange(B) * 97, T)


@pytest.fixture(scope="module")
def single_device_logits():
    inputs, _, segment_ids, _ = _batch()
    return _forward(_model(), inputs, segment_ids)


@needs_8
@pytest.mark.parametrize("shape", MESHES)
def test_sharded_logits_equal_single_device(shape, single_device_logits):
    inputs, _, segment_ids, _ = _batch()
    model = models.shard(_model(), _mesh(shape))
    got = _forward(model, inputs, segment_ids)
    np.testing.assert_allclose(got, single_device_logits, atol=2e-6, rtol=1e-5)
    assert _has_spec(got, mesh_of(model), P("data", None, "model"))  # rows, vocabulary
    if shape[0] > 1:  # 3 rows do not split over the data axis: replicated, same logits
        got = _forward(model, inputs[:3], segment_ids[:3])
        np.testing.assert_allclose(got, single_device_logits[:3], atol=2e-6, rtol=1e-5)


@needs_8
@pytest.mark.parametrize(
    "shape, names", [((8,), ("data",)), ((8,), ("model",)), ((4, 2), ("model", "data"))]
)
def test_meshes_the_docstring_allows(shape, names, single_device_logits):
    """One-axis meshes (the absent axis counts as size 1) and swapped axis order."""
    inputs, _, segment_ids, _ = _batch()
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(shape), names)
    model = models.shard(_model(), mesh)
    assert mesh_of(model).axis_names[: len(names)] == names and mesh_of(model).size == 8
    got = _forward(model, inputs, segment_ids)
    np.testing.assert_allclose(got, single_device_logits, atol=2e-6, rtol=1e-5)


def test_other_meshes_are_value_errors_naming_mesh_and_move_nothing():
    d = jax.devices()[0]
    model = _model()
    before = jax.tree.leaves(nnx.state(model))
    for mesh in [
        Mesh(np.array([d]).reshape(1, 1), ("model", "model")),
        Mesh(np.array([d, d]), ("data",)),
        Mesh(np.array([d]).reshape(1, 1, 1), ("data", "model", "pipe")),
    ]:
        with pytest.raises(ValueError, match="mesh"):
            models.shard(model, mesh)
    assert mesh_of(model) is None
    assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(model)), before, strict=True))


def test_medusa_heads_are_refused_before_any_parameter_moves():
    heads = models.MedusaHeads(CONFIG, 2, rngs=nnx.Rngs(0))
    before = jax.tree.leaves(nnx.state(heads))
    with pytest.raises(TypeError, match="models.Transformer, got MedusaHeads; shard the target"):
        models.shard(heads, Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model")))
    assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(heads)), before, strict=True))
    assert getattr(heads, "mesh", None) is None


@needs_8
def test_parameters_are_megatron_sharded():
    model = models.shard(_model(), _mesh((2, 4)))
    mesh = mesh_of(model)
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    col, row = P(None, "model"), P("model", None)
    for param, spec in [
        (attn.qkv_proj.kernel, col),
        (attn.o_proj.kernel, row),
        (mlp.gate_up_proj.kernel, col),
        (mlp.down_proj.kernel, row),
        (model.embed.embedding, row),
        (model.lm_head.kernel, col),
        (model.norm.weight, P()),
    ]:
        assert _has_spec(param[...], mesh, spec)
    biased = models.shard(Transformer(CONFIG.replace(qkv_bias=True), rngs=nnx.Rngs(0)), mesh)
    assert _has_spec(biased.layers[0].attn.qkv_proj.bias[...], mesh, P("model"))
    # Device (d, j) holds the KV heads [2j, 2j + 2) and the query heads [4j, 4j + 4) that read
    # them (its block of the fused kernel is exactly their q, k and v columns), and the gate and
    # up columns of the same hidden units.
    D, M = CONFIG.resolved_head_dim, CONFIG.mlp_dim // 4
    q, k, v = (w.reshape(CONFIG.dim, -1, D) for w in split_qkv(attn.qkv_proj.kernel[...], 8, D))
    gate, up = split_gate_up(mlp.gate_up_proj.kernel[...])
    for j in range(4):
        kv, heads, units = slice(2 * j, 2 * j + 2), slice(4 * j, 4 * j + 4), slice(j * M, j * M + M)
        want = fuse_qkv(*(x.reshape(CONFIG.dim, -1) for x in (q[:, heads], k[:, kv], v[:, kv])), 2)
        _assert_block(attn.qkv_proj.kernel[...], j, want)
        _assert_block(mlp.gate_up_proj.kernel[...], j, fuse_gate_up(gate[:, units], up[:, units]))


def _assert_block(x, j: int, want):
    """The shards of column-parallel x whose column block is the j-th of 4 hold ``want``."""
    width = x.shape[1] // 4
    blocks = [s.data for s in x.addressable_shards if (s.index[1].start or 0) == j * width]
    assert blocks
    for block in blocks:
        np.testing.assert_array_equal(block, want)


@needs_8
@pytest.mark.parametrize("paged", [False, True])
def test_cache_is_created_sharded_and_stays_sharded(paged):
    mesh = _mesh((2, 4))
    model = models.shard(_model(), mesh)
    if paged:
        table = np.arange(8 * 4, dtype=np.int32).reshape(8, 4)
        cache = KVCache.paged(CONFIG, 32, 8, table, mesh=mesh)
        spec = P(None, None, "model", None)  # the pool is shared by all rows
    else:
        cache = KVCache.contiguous(CONFIG, 8, 32, mesh=mesh)
        spec = P("data", None, "model", None)
    assert _has_spec(cache.k[0], mesh_of(model), spec)
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda s, t, c: nnx.merge(graphdef, s)(t, cache=c), donate_argnums=2)
    tokens = jnp.ones((8, 5), jnp.int32)
    _, cache = run(state, tokens, cache)
    assert _has_spec(cache.k[-1], mesh_of(model), spec)
    assert cache.k[-1].addressable_shards[0].data.shape[2] == CONFIG.num_kv_heads // 4


# Gradient clipping and momentum SGD: updates linear in the gradients, so the comparison below
# measures the gradients' rounding. (Adam's first step, +-lr wherever |g| >> eps, turns a 1e-10
# rounding difference of a ~1e-9 gradient into a visible one.)
TX = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.9))


def _train_step(shape):
    """``(params, opt_state, loss)`` after one step from ``_model()``, and the shardings."""
    model = _model()
    if shape is None:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return train.make_train_step(graphdef, TX)(params, rest, TX.init(params), _batch()), None
    model = models.shard(model, _mesh(shape))
    step, sh = models.make_sharded_train_step(model, TX)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = jax.jit(TX.init, out_shardings=sh.opt_state)(params)
    return step(params, rest, opt_state, _batch()), sh


@pytest.fixture(scope="module")
def single_device_step():
    return _train_step(None)[0]


@needs_8
@pytest.mark.parametrize("shape", MESHES)
def test_sharded_train_step_equals_single_device(shape, single_device_step):
    want_params, _, want_loss = single_device_step
    (params, opt_state, loss), sh = _train_step(shape)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    for p, w in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
        np.testing.assert_allclose(p, w, atol=1e-6, rtol=1e-5)
    for p, want in zip(jax.tree.leaves(params), jax.tree.leaves(sh.params), strict=True):
        assert p.sharding.is_equivalent_to(want, p.ndim)  # the stated shardings, kept
    trace = opt_state[1][0].trace["layers"][0]["mlp"]["down_proj"]["kernel"][...]  # momentum
    assert _has_spec(trace, sh.batch.mesh, P("model", None))


@needs_8
def test_adamw_state_follows_the_parameters():
    model = models.shard(_model(), _mesh((2, 4)))
    sh = models.train_shardings(model, train.optimizer(train.TrainConfig()))
    adam = sh.opt_state[1][0]
    for moment in (adam.mu, adam.nu):
        for got, want in zip(jax.tree.leaves(moment), jax.tree.leaves(sh.params), strict=True):
            assert got == want
    assert adam.count == NamedSharding(mesh_of(model), P())
    assert _has_spec(jnp.zeros((8, 3), device=sh.batch), mesh_of(model), P("data", None))


@needs_8
def test_sharded_pallas_model_lowers_for_cuda_with_local_kernels():
    """On a GPU mesh the Pallas (Triton) kernels sit inside the shard_map, on local shapes:
    rows B/dp = 2, query heads Hq/tp = 4, KV heads Hkv/tp = 2 (lowered from this CPU host)."""
    config = CONFIG.replace(attn_impl="pallas", head_dim=16, dtype="bfloat16")
    model = models.shard(Transformer(config, rngs=nnx.Rngs(0)), _mesh((2, 4)))
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((4, 8), jnp.int32)
    cache = KVCache.contiguous(config, 4, 64, mesh=mesh_of(model))
    full = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t)).trace(state, tokens)
    cached = jax.jit(lambda s, t, c: nnx.merge(graphdef, s)(t, cache=c)).trace(state, tokens, cache)
    for traced, local_kv in [(full, "2x8x2x16xbf16"), (cached, "2x64x2x16xbf16")]:
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
        manual = text[text.index("sdy.manual_computation") :]
        header = manual[: manual.index("{\n")]
        assert "tensor<2x8x4x16xbf16>" in header and f"tensor<{local_kv}>" in header, header
        assert "xla.gpu.triton" in manual


@needs_8
def test_bad_meshes_raise():
    with pytest.raises(ValueError, match="num_kv_heads"):  # Hkv = 2 on 8 model shards
        models.shard(Transformer(TransformerConfig.preset("tiny"), rngs=nnx.Rngs(0)), _mesh((1, 8)))
    with pytest.raises(ValueError, match="axis names"):
        models.shard(_model(), jax.make_mesh((2, 4), ("batch", "model")))
    with pytest.raises(TypeError, match="mesh"):
        models.shard(_model(), (2, 4))
    with pytest.raises(TypeError, match="models.Transformer"):
        models.shard(object(), _mesh((2, 4)))
    assert mesh_of(_model()) is None
    step, _ = models.make_sharded_train_step(models.shard(_model(), _mesh((2, 4))), optax.sgd(0.1))
    with pytest.raises(ValueError, match="multiple of the 'data' axis"):
        step(None, None, None, [x[:3] for x in _batch()])


def test_memory_plan_for_llama_3_8b_on_8_h200():
    """The README's figures: weights and KV bytes per token from the arrays the model and the
    cache really allocate (shapes only), and the largest batch that fits, but not one more."""
    config = TransformerConfig.preset("llama-3-8b")
    hbm, context, reserve = 141e9, 8192, 0.1
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(abstract)))
    cache = jax.eval_shape(lambda: KVCache.contiguous(config, 1, 1))
    per_token = sum(x.size * x.dtype.itemsize for x in (*cache.k, *cache.v))
    assert per_token == 128 * 1024  # 2 x 32 layers x 8 KV heads x 128 x 2 bytes
    for tp in (8, 4, 1):
        plan = models.memory_plan(config, devices=8, model_axis=tp, hbm_bytes=hbm, context=context)
        assert plan["weight_bytes"] == weights
        assert plan["kv_bytes_per_token"] == per_token
        per_replica = plan["max_batch"] // (8 // tp)

        def used(batch, tp=tp):  # bytes on one device
            return (weights + batch * context * per_token) / tp

        assert used(per_replica) <= hbm * (1 - reserve) < used(per_replica + 1)
    with pytest.raises(ValueError, match="model_axis"):
        models.memory_plan(config, devices=8, model_axis=16, hbm_bytes=hbm, context=context)
    with pytest.raises(ValueError, match="processes"):
        models.memory_plan(config, devices=8, model_axis=4, hbm_bytes=hbm, context=8, processes=3)


def test_memory_plan_per_process_of_two_hosts():
    """Two hosts of 4 devices on a (2, 4) mesh: each process's devices hold a whole tensor
    parallel copy of the weights and 4 / 4 of a token's KV bytes; each reads the whole file."""
    config = TransformerConfig.preset("llama-3-8b")
    one = models.memory_plan(config, devices=8, model_axis=4, hbm_bytes=141e9, context=8192)
    two = models.memory_plan(
        config, devices=8, model_axis=4, hbm_bytes=141e9, context=8192, processes=2
    )
    assert two["max_batch"] == one["max_batch"]  # the same devices, split among hosts
    assert two["weight_bytes_per_process"] == 4 * one["weight_bytes_per_device"]
    assert two["weight_bytes_per_process"] == two["weight_bytes"]
    assert two["kv_bytes_per_token_per_process"] == two["kv_bytes_per_token"]
    assert two["host_bytes_per_process_at_load"] == two["weight_bytes"]
    eight = models.memory_plan(
        config, devices=8, model_axis=2, hbm_bytes=141e9, context=8192, processes=8
    )
    assert eight["weight_bytes_per_process"] == eight["weight_bytes"] / 2
