"""Each sampler's empirical distribution against the exact one (chi-square) on a tiny vocabulary."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from decoding.checks import ArgumentTypeError
from decoding.sampling import (
    TOP_K_BOUND,
    SamplingConfig,
    SamplingParams,
    argmax,
    filtered_logits,
    probabilities,
    sample,
)

N_DRAWS = 20_000
LOGITS = np.array([2.0, 1.5, 1.5, 0.3, -0.7, -1.0, -3.0, 0.9], np.float32)  # V = 8, a tie at 1.5


def exact_distribution(logits, cfg: SamplingConfig) -> np.ndarray:
    """Float64 reference written from the definitions, one filter after another."""
    x = np.asarray(logits, np.float64)
    if cfg.temperature == 0.0:
        p = np.zeros_like(x)
        p[np.argmax(x)] = 1.0
        return p
    x = x / cfg.temperature

    def softmax(z):
        e = np.exp(z - z.max())
        return e / e.sum()

    if 0 < cfg.top_k < x.size:
        kth = np.sort(x)[::-1][cfg.top_k - 1]
        x = np.where(x >= kth, x, -np.inf)
    if cfg.top_p < 1.0:
        p = softmax(x)
        order = np.argsort(-x, kind="stable")
        total, kept = 0.0, []
        for i in order:
            kept.append(i)
            total += p[i]
            if total >= cfg.top_p:
                break
        threshold = x[kept[-1]]
        x = np.where(x >= threshold, x, -np.inf)
    if cfg.min_p > 0.0:
        p = softmax(x)
        x = np.where(p >= cfg.min_p * p.max(), x, -np.inf)
    return softmax(x)


def draw(cfg: SamplingConfig, seed: int = 0, logits=LOGITS, data: bool = False) -> np.ndarray:
    """Token counts of N_DRAWS rows sampled under ``cfg``: a static argument, or (``data``) one
    ``SamplingParams`` row per draw, traced (what the engine and generate compile)."""
    batch = jnp.broadcast_to(jnp.asarray(logits), (N_DRAWS, len(logits)))
    if data:
        params = SamplingParams.rows([cfg] * N_DRAWS)
        tokens = _sample_data(batch, jax.random.key(seed), params)
    else:
        tokens = jax.jit(sample, static_argnums=2)(batch, jax.random.key(seed), cfg)
    return np.bincount(np.asarray(tokens), minlength=len(logits))


_sample_data = jax.jit(sample)


CONFIGS = {
    "temperature_1": SamplingConfig(temperature=1.0),
    "temperature_0.5": SamplingConfig(temperature=0.5),
    "temperature_2": SamplingConfig(temperature=2.0),
    "top_k_2_tie_at_threshold": SamplingConfig(temperature=1.0, top_k=2),
    "top_k_4": SamplingConfig(temperature=0.8, top_k=4),
    "top_k_1": SamplingConfig(temperature=1.0, top_k=1),
    "top_k_ge_vocab": SamplingConfig(temperature=1.0, top_k=50),
    "top_p_0.5": SamplingConfig(temperature=1.0, top_p=0.5),
    "top_p_0.9": SamplingConfig(temperature=1.0, top_p=0.9),
    "top_p_tiny": SamplingConfig(temperature=1.0, top_p=1e-6),
    "min_p_0.2": SamplingConfig(temperature=1.0, min_p=0.2),
    "top_k_then_top_p": SamplingConfig(temperature=1.3, top_k=5, top_p=0.8),
    "all_filters": SamplingConfig(temperature=0.7, top_k=6, top_p=0.95, min_p=0.05),
}


@pytest.mark.parametrize("data", [False, True], ids=["static", "data"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_empirical_matches_exact(name, data):
    cfg = CONFIGS[name]
    expected = exact_distribution(LOGITS, cfg)
    sampling = SamplingParams.rows([cfg]) if data else cfg
    np.testing.assert_allclose(
        np.asarray(jax.jit(probabilities)(jnp.asarray(LOGITS)[None], sampling))[0]
        if data
        else np.asarray(probabilities(jnp.asarray(LOGITS), cfg)),
        expected,
        rtol=1e-5,
        atol=1e-7,
    )
    counts = draw(cfg, data=data)
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew filtered tokens: {counts} vs {expected}"
    if support.sum() == 1:
        assert counts[support].sum() == N_DRAWS
        return
    _, pvalue = stats.chisquare(counts[support], N_DRAWS * expected[support])
    assert pvalue > 1e-3, f"{name}: counts {counts}, expected {N_DRAWS * expected}"


def test_chi_square_detects_a_wrong_distribution():
    """The test above has power: draws at temperature 1 are rejected against temperature 2."""
    counts = draw(SamplingConfig(temperature=1.0))
    expected = exact_distribution(LOGITS, SamplingConfig(temperature=2.0))
    _, pvalue = stats.chisquare(counts, N_DRAWS * expected)
    assert pvalue < 1e-6


def test_top_k_keeps_ties_and_top_p_edges():
    tie = SamplingConfig(temperature=1.0, top_k=2)
    kept = np.isfinite(np.asarray(filtered_logits(jnp.asarray(LOGITS), tie)))
    assert kept.tolist() == [True, True, True, False, False, False, False, False]
    # top_p just above the top token's probability keeps exactly one more token (and its tie).
    p0 = exact_distribution(LOGITS, SamplingConfig(temperature=1.0))[0]
    for top_p, n_kept in ((p0 * 0.999, 1), (p0 * 1.001, 3)):
        cfg = SamplingConfig(temperature=1.0, top_p=float(top_p))
        assert np.isfinite(np.asarray(filtered_logits(jnp.asarray(LOGITS), cfg))).sum() == n_kept


def test_argmax_matches_jnp_argmax_on_ties_infinities_and_nan():
    x = np.array(
        [[1.0, 3.0, 3.0, 0.0], [-np.inf] * 4, [2.0, np.nan, 5.0, np.nan], [np.inf, 0, np.inf, 1]],
        np.float32,
    )
    x = np.concatenate([x, np.asarray(jax.random.normal(jax.random.key(2), (8, 4)))])
    np.testing.assert_array_equal(argmax(jnp.asarray(x)), np.asarray(jnp.argmax(x, axis=-1)))
    assert argmax(jnp.asarray(x)).dtype == jnp.int32


def test_greedy_is_argmax_and_ignores_key():
    logits = jax.random.normal(jax.random.key(1), (16, 50))
    want = np.argmax(np.asarray(logits), axis=-1)
    for seed in (0, 1):
        got = sample(logits, jax.random.key(seed), SamplingConfig())
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), want)
    onehot = np.asarray(probabilities(logits, SamplingConfig()))
    np.testing.assert_array_equal(onehot.argmax(-1), want)
    assert (onehot.sum(-1) == 1).all()


def test_same_key_same_tokens():
    cfg = SamplingConfig(temperature=1.0, top_p=0.9)
    logits = jax.random.normal(jax.random.key(2), (64, 100))
    a = sample(logits, jax.random.key(7), cfg)
    b = sample(logits, jax.random.key(7), cfg)
    c = sample(logits, jax.random.key(8), cfg)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (np.asarray(a) != np.asarray(c)).any()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"top_k": -1},
        {"top_k": 1.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"min_p": -0.1},
        {"min_p": 2.0},
    ],
)
def test_bad_config_raises(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingConfig(**kwargs)


def test_config_is_hashable_static_arg():
    assert hash(SamplingConfig(temperature=1, top_k=3)) == hash(SamplingConfig(1.0, 3))


REPRO = np.array([[2.0, 5.0, -1.0, 0.0], [0.5, 0.1, 3.0, 2.9]], np.float32)  # argmax [1, 2]
TINY_TEMPERATURES = (1e-30, 1.5e-38, 1e-38, 1e-40, 1.4e-45, 5e-324, 1e-300)
FILTERS = {
    "none": {},
    "top_k": {"top_k": 2},
    "top_p": {"top_p": 0.9},
    "min_p": {"min_p": 0.1},
    "all": {"top_k": 3, "top_p": 0.5, "min_p": 0.2},
}


@pytest.mark.parametrize("filters", list(FILTERS))
@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_tiny_temperatures_are_greedy(temperature, filters):
    """T far below float32's range (denormal, or 0 once converted) must still pick the argmax:
    dividing first gave inf - inf = NaN probabilities and arbitrary tokens."""
    cfg = SamplingConfig(temperature=temperature, **FILTERS[filters])
    want = REPRO.argmax(-1)
    for seed in range(3):
        got = np.asarray(sample(jnp.asarray(REPRO), jax.random.key(seed), cfg))
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(probabilities(REPRO, cfg)), np.eye(4)[want])
    filtered = np.asarray(filtered_logits(REPRO, cfg))
    assert not np.isnan(filtered).any() and (filtered < np.inf).all()
    np.testing.assert_array_equal(filtered.argmax(-1), want)


@settings(max_examples=25, deadline=None)
@given(
    temperature=st.floats(-307.0, 308.0).map(lambda e: 10.0**e),  # log-uniform
    row=st.lists(
        st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=False), min_size=2, max_size=6
    ),
)
def test_probabilities_are_a_distribution_for_any_finite_temperature(temperature, row):
    logits = np.asarray(row, np.float32)
    p = np.asarray(probabilities(logits, SamplingConfig(temperature=temperature, min_p=0.01)))
    assert np.isfinite(p).all() and (p >= 0).all(), (temperature, row, p)
    assert abs(p.sum() - 1.0) < 1e-5
    assert p[logits.argmax()] == p.max()


def test_data_path_draws_the_same_tokens_as_a_static_config():
    """One compiled sampler for every setting gives, per config, the static program's tokens."""
    logits = jax.random.normal(jax.random.key(3), (32, 100))
    for cfg in list(CONFIGS.values()) + [SamplingConfig(), SamplingConfig(1.0, top_k=90)]:
        params = SamplingParams.rows([cfg] * 32)
        static = sample(logits, jax.random.key(4), cfg)
        np.testing.assert_array_equal(_sample_data(logits, jax.random.key(4), params), static)
        np.testing.assert_array_equal(
            jax.jit(filtered_logits)(logits, params), filtered_logits(logits, cfg)
        )


def test_rows_of_one_batch_use_their_own_settings():
    """A greedy row in a batch of sampled rows is its argmax; each sampled row draws from its
    own config's distribution; a row with per-row keys draws as it would alone."""
    cfgs = [SamplingConfig(), CONFIGS["top_k_2_tie_at_threshold"], CONFIGS["top_p_0.5"]]
    cfgs += [SamplingConfig(temperature=1.0, top_k=TOP_K_BOUND + 1)]
    n = 3000
    rows = [cfgs[i % len(cfgs)] for i in range(n * len(cfgs))]
    batch = jnp.broadcast_to(jnp.asarray(LOGITS), (len(rows), len(LOGITS)))
    tokens = np.asarray(_sample_data(batch, jax.random.key(0), SamplingParams.rows(rows)))
    for i, cfg in enumerate(cfgs):
        counts = np.bincount(tokens[i :: len(cfgs)], minlength=len(LOGITS))
        expected = exact_distribution(LOGITS, cfg)
        assert counts[expected == 0].sum() == 0, (cfg, counts)
        if cfg.greedy:
            assert counts[int(np.argmax(LOGITS))] == n
            continue
        _, pvalue = stats.chisquare(counts[expected > 0], n * expected[expected > 0])
        assert pvalue > 1e-3, (cfg, counts)
    keys = jax.random.split(jax.random.key(5), len(cfgs))
    logits = jax.random.normal(jax.random.key(6), (len(cfgs), 50))
    together = _sample_data(logits, keys, SamplingParams.rows(cfgs))
    for b, cfg in enumerate(cfgs):
        alone = sample(logits[b : b + 1], keys[b], cfg)
        assert int(together[b]) == int(alone[0])


def test_new_settings_do_not_recompile():
    traces = []

    @jax.jit
    def run(logits, key, params):
        traces.append(1)
        return sample(logits, key, params)

    logits = jax.random.normal(jax.random.key(1), (4, 30))
    for t in np.linspace(0.0, 2.0, 20):
        cfg = SamplingConfig(temperature=float(t), top_p=1.0 - float(t) / 4, top_k=int(t * 10))
        run(logits, jax.random.key(0), SamplingParams.rows([cfg] * 4))
    assert len(traces) == 1


def test_numpy_scalars_accepted_bools_rejected():
    cfg = SamplingConfig(np.float32(0.5), np.int64(3), np.float64(0.9), np.float32(0.0))
    assert cfg == SamplingConfig(0.5, 3, 0.9, 0.0) and type(cfg.top_k) is int
    for kwargs in ({"temperature": True}, {"top_k": True}, {"top_p": np.bool_(True)}):
        with pytest.raises(ArgumentTypeError, match=next(iter(kwargs))):
            SamplingConfig(**kwargs)
    with pytest.raises(TypeError, match="sampling"):
        sample(jnp.zeros((1, 4)), jax.random.key(0), "greedy")
