"""The engine on models with sliding-window layers: those layers keep per-slot rings of pages
(decoding.engine), the pool serves the global layers only, and greedy outputs equal
``generate``'s with several ragged requests longer than the window, with preemption, with
prefix hits (whose rings are rebuilt by a replay) and with prompt-lookup speculation.

Two tiny random models: Gemma-3-style (local, global, local layers; per-head q/k norms, sandwich
norms, GELU, two RoPE bases) and Mistral-style (every layer windowed). Every engine here has the
same shapes for a model (batch 3, pages of 4, chunks of at most 16), so each compiles a few steps.
"""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from decoding import PromptLookup, engine_steps
from decoding.engine import Engine
from decoding.generate import generate
from decoding.serve.metrics import Metrics
from models import Transformer, TransformerConfig, shard
from models.kv_cache import ring_pages_for

WINDOW, PAGE, BATCH, MAX_SEQ, POOL = 4, 4, 3, 64, 40
CHUNK = 16  # max_prefill_tokens: the longest step, longer than a verification's MAX_K + 1
MAX_NEW = 20
_BASE = dict(vocab_size=64, dim=32, num_heads=4, num_kv_heads=2, mlp_dim=64, attn_impl="xla")
CONFIGS = {
    "gemma3": TransformerConfig(
        **_BASE,
        num_layers=3,
        head_dim=16,
        qk_norm=True,
        norm_plus_one=True,
        sandwich_norm=True,
        embed_scale=True,
        mlp_act="gelu_tanh",
        sliding_window=WINDOW,
        local_rope_theta=1e4,
        rope_theta=1e6,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        query_pre_attn_scalar=16,
        tie_embeddings=True,
    ),
    "mistral": TransformerConfig(**_BASE, num_layers=2, sliding_window=WINDOW),
}

_rng = np.random.default_rng(0)
_SHARED = _rng.integers(0, 64, 13).tolist()  # 3 full pages and one token: longer than W
PROMPTS = [
    _rng.integers(0, 64, 9).tolist(),
    _rng.integers(0, 64, 22).tolist(),  # two chunks
    _SHARED + _rng.integers(0, 64, 5).tolist(),
    _SHARED + _rng.integers(0, 64, 2).tolist(),
    _SHARED[:12],  # exactly the shared full pages
]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request):
    """(config name, model, generate's greedy tokens of PROMPTS)."""
    model = Transformer(CONFIGS[request.param], rngs=nnx.Rngs(1))
    want = generate(model, PROMPTS, max_new_tokens=MAX_NEW).tokens
    return request.param, model, want


def _engine(model, num_pages=POOL, **kw):
    return Engine(
        model,
        max_batch=BATCH,
        num_pages=num_pages,
        page_size=PAGE,
        max_prefill_tokens=CHUNK,
        max_seq_len=MAX_SEQ,
        **kw,
    )


def _run(eng, prompts=PROMPTS):
    ids = [eng.submit(p, MAX_NEW) for p in prompts]
    out = eng.run_until_done()
    return [out[i] for i in ids]


def test_sliding_layers_keep_rings_and_the_pool_serves_global_layers(case):
    name, model, _ = case
    c = model.config
    eng = _engine(model)
    R = ring_pages_for(WINDOW, CHUNK, PAGE)  # the longest step: one chunk
    assert eng.ring_pages == R and R < eng.max_pages
    sliding = [i for i in range(c.num_layers) if c.is_sliding(i)]
    glob = [i for i in range(c.num_layers) if not c.is_sliding(i)]
    assert eng.pool_layers == tuple(glob) and sliding
    D, item = c.resolved_head_dim, np.dtype(c.jnp_dtype).itemsize
    for i in sliding:  # a ring of R pages per slot and a scratch page, whatever the pool size
        assert (
            eng.runner.k[i].shape
            == eng.runner.v[i].shape
            == (BATCH * R + 1, PAGE, c.num_kv_heads, D)
        )
    for i in glob:  # the pool: num_pages and a scratch page
        assert eng.runner.k[i].shape == (POOL + 1, PAGE, c.num_kv_heads, D)
    s = eng.stats()
    page = PAGE * c.num_kv_heads * D * item * 2  # K and V of one page of one layer
    assert s["ring_pages"] == R and s["pool_layers"] == len(glob)
    assert s["page_bytes"] == page * len(glob)
    assert s["ring_bytes"] == page * len(sliding) * (BATCH * R + 1)
    # O(window) per slot: a bigger pool or a longer max_seq_len leaves the rings as they are
    big = _engine(model, num_pages=2 * POOL)
    assert [big.runner.k[i].shape for i in sliding] == [eng.runner.k[i].shape for i in sliding]
    if name == "mistral":
        assert eng.pool_layers == () and s["page_bytes"] == 0
    metrics = Metrics()  # /metrics reads the worker's published stats
    metrics.worker = types.SimpleNamespace(stats=s)
    text = metrics.render().decode()
    for key, value in (("ring_bytes", s["ring_bytes"]), ("page_bytes", s["page_bytes"])):
        assert f"decoding_serve_kv_{key} {float(value)}" in text.splitlines(), key


def test_outputs_equal_generate_with_prefix_hits(case):
    _, model, want = case
    eng = _engine(model)
    eng.warmup()  # ring replays included: nothing below compiles
    before = dict(engine_steps.TRACES)
    assert _run(eng) == want
    s = eng.stats()
    assert s["prefix_cache_hits"] > 0 and s["replay_tokens"] > 0
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"]
    # the same prompts again: every one hits what the first round registered
    assert _run(eng) == want
    assert eng.stats()["prefix_cache_hits"] > s["prefix_cache_hits"]
    assert dict(engine_steps.TRACES) == before


def test_outputs_equal_generate_with_preemption(case):
    _, model, want = case
    eng = _engine(model, num_pages=14)
    assert _run(eng) == want
    assert eng.stats()["preemptions"] > 0


def test_outputs_equal_generate_with_speculation(case):
    _, model, want = case
    eng = _engine(model, draft=PromptLookup(), num_draft_tokens=3)
    assert eng.ring_pages == ring_pages_for(WINDOW, CHUNK, PAGE)
    assert _run(eng) == want
    assert eng.stats()["draft_proposed"] > 0


def _ring_keys(eng, slot: int, stop: int):
    """The sliding layers' keys of positions [stop - W + 1, stop) in ``slot``'s ring."""
    R, c = eng.ring_pages, eng.config
    pos = np.arange(stop - WINDOW + 1, stop)
    pages = slot * R + (pos // PAGE) % R
    return [
        np.asarray(eng.runner.k[i])[pages, pos % PAGE]
        for i in range(c.num_layers)
        if c.is_sliding(i)
    ]


def test_a_prefix_hit_rebuilds_the_ring_of_the_window_before_it(case):
    """After a hit, the ring holds the keys a fresh prefill computes; replaying only the last
    W - 1 positions is not enough once two sliding layers are stacked (each reaches W - 1 back)."""
    name, model, _ = case
    first, other = _SHARED + [1, 2, 3], _rng.integers(0, 64, 30).tolist()
    second = _SHARED + [7]

    def ring_after_hit(replay_tokens=None):
        eng = _engine(model)
        if replay_tokens is not None:
            eng.scheduler.replay_tokens = replay_tokens
        _run(eng, [first])
        _run(eng, [other])  # slot 0's ring now holds another sequence's keys
        hits = eng.stats()["prefix_cache_hits"]
        rid = eng.submit(second, 1)
        eng.step()  # replay, prefill of the rest, and the one token
        eng.pop_finished()
        assert eng.stats()["prefix_cache_hits"] - hits == len(_SHARED) // PAGE, rid
        return _ring_keys(eng, 0, len(second))

    fresh = _engine(model, prefix_caching=False)
    fresh.submit(second, 1)
    fresh.run_until_done()
    want = _ring_keys(fresh, 0, len(second))
    got = ring_after_hit()
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    short = ring_after_hit(WINDOW - 1)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(short, want, strict=True))
    assert worst > 1e-3, worst  # the upper sliding layer's keys saw stale lower-layer keys


def test_a_failed_step_rebuilds_the_rings_and_the_pool(case):
    """An exception after a prefill step consumed (donated) the pool and the rings: the engine
    rebuilds both and recomputes every request from its tokens, with the same outputs."""
    _, model, want = case
    eng = _engine(model)
    real, calls = eng.runner.prefill_fn, []

    def fails_once(*args):
        out = real(*args)
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected")
        return out

    eng.runner.prefill_fn = fails_once
    ids = [eng.submit(p, MAX_NEW) for p in PROMPTS]
    with pytest.raises(RuntimeError, match="injected"):
        while eng.busy:
            eng.step()
    assert eng.stats()["rebuilds"] == 1
    assert all(not x.is_deleted() for x in (*eng.runner.k, *eng.runner.v))
    R = eng.ring_pages
    c = model.config
    assert all(
        eng.runner.k[i].shape[0] == BATCH * R + 1 for i in range(c.num_layers) if c.is_sliding(i)
    )
    out = eng.run_until_done()
    assert [out[i] for i in ids] == want


def test_a_sharded_model_keeps_every_layer_on_the_pool():
    """models.shard runs attention per device (shard_map), which a ring replay does not go
    through: the engine keeps the sliding layers on the pool there."""
    model = Transformer(CONFIGS["gemma3"], rngs=nnx.Rngs(1))
    shard(model, Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model")))
    eng = _engine(model)
    assert eng.ring_pages is None and eng.pool_layers == (0, 1, 2)
    assert eng.stats()["ring_bytes"] == 0
