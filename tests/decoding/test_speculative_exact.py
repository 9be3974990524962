"""Speculative sampling is lossless: chi-square tests of the first generated tokens against the
target's exact joint distribution, enumerated, on a V = 16 vocabulary.

The first new token comes from the target's prefill; the second and third from the first
verification step (accepted draft tokens, a residual sample or the bonus token), so the joints
of (t1, t2) and of (t2, t3) both test the acceptance rule. Each case draws 20k samples as the
rows of one batch in one jitted call, with tiny caches (capacity = prompt + 3 + k).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_transformer
from flax import nnx
from scipy import stats

from decoding import EarlyExit, PromptLookup, SamplingConfig, probabilities
from decoding.drafts import ModelDraft
from decoding.eagle import EagleDraft
from decoding.speculative import draft_kind, speculative_decode, speculative_prefill
from models import KVCache

V = 16
N = 20_000
PROMPT = [1, 2, 3, 1, 2]  # "1 2" recurs, so prompt lookup proposes "3 1 2 ..."
NEW = 3
SMALL = dict(vocab_size=V, dim=32, mlp_dim=64, scale=0.25)


@pytest.fixture(scope="module")
def target():
    return random_transformer(10, num_layers=2, **SMALL)


@pytest.fixture(scope="module")
def draft():
    return random_transformer(11, num_layers=1, **SMALL)


def sample_new_tokens(target, draft, *, k, sampling, seed=0):
    """[N, NEW] first new tokens of N independent rows with the same prompt."""
    kind, params = draft_kind(draft)
    graphdef, target_params = nnx.split(target)
    Tp, cap = len(PROMPT), len(PROMPT) + NEW + k

    @jax.jit
    def run(target_params, params, key):
        model = nnx.merge(graphdef, target_params)
        tokens = jnp.broadcast_to(jnp.asarray(PROMPT, jnp.int32), (N, Tp))
        draft_cache = None
        if isinstance(kind, ModelDraft):
            draft_cache = KVCache.contiguous(kind.config, N, cap)
        elif isinstance(kind, EagleDraft):
            draft_cache = kind.empty_state(model, params, N, cap)
        common = dict(eos_id=-1, max_new_tokens=NEW, sampling=sampling)
        state = speculative_prefill(
            model,
            kind,
            params,
            draft_cache,
            tokens,
            jnp.full((N,), Tp, jnp.int32),
            KVCache.contiguous(target.config, N, cap),
            key=key,
            done=jnp.zeros((N,), bool),
            seq_len=cap + 1,
            **common,
        )
        state = speculative_decode(model, kind, params, state, k=k, **common)
        return state.seq[:, Tp : Tp + NEW], state.num_new

    seq, num_new = jax.device_get(run(target_params, params, jax.random.key(seed)))
    assert (num_new == NEW).all()
    return seq


def exact_joints(target, sampling):
    """P(t1, t2) and P(t2, t3), each [V, V], from full forwards over every (t1, t2)."""
    pairs = np.stack(np.meshgrid(np.arange(V), np.arange(V), indexing="ij"), -1).reshape(-1, 2)
    seqs = np.concatenate([np.tile(PROMPT, (V * V, 1)), pairs], axis=1).astype(np.int32)
    logits = jax.jit(lambda x: target(x))(jnp.asarray(seqs))
    probs = np.asarray(probabilities(logits, sampling), np.float64)
    Tp = len(PROMPT)
    p1 = probs[0, Tp - 1]  # [V]
    p2 = probs[::V, Tp].reshape(V, V)  # [t1, t2]
    p3 = probs[:, Tp + 1].reshape(V, V, V)  # [t1, t2, t3]
    joint12 = p1[:, None] * p2
    joint23 = np.einsum("a,ab,abc->bc", p1, p2, p3)
    return joint12, joint23


def assert_matches(observed_pairs, expected):
    """Chi-square goodness of fit of pairs [N, 2] against ``expected`` [V, V]; no mass where the
    expected probability is 0 (cells with < 5 expected counts are pooled)."""
    counts = np.zeros((V, V))
    np.add.at(counts, (observed_pairs[:, 0], observed_pairs[:, 1]), 1)
    expected = expected / expected.sum()
    impossible = expected == 0
    assert counts[impossible].sum() == 0
    exp_counts = expected * len(observed_pairs)
    big = exp_counts >= 5
    small = ~big & ~impossible
    obs = np.append(counts[big], counts[small].sum())
    exp = np.append(exp_counts[big], exp_counts[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert len(exp) >= 5, "the distribution is too peaked for a meaningful test"
    p_value = stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue
    assert p_value > 1e-3, p_value


def check_exact(target, draft, k, sampling):
    """Speculative sampling with ``draft`` drafting k tokens has the target's exact joint
    distribution of the first two and of the second and third new tokens (chi-square tests);
    returns the sampled tokens."""
    tokens = sample_new_tokens(target, draft, k=k, sampling=sampling)
    joint12, joint23 = exact_joints(target, sampling)
    assert_matches(tokens[:, :2], joint12)
    assert_matches(tokens[:, 1:], joint23)
    return tokens


T1 = SamplingConfig(temperature=1.0)
T07_TOPK = SamplingConfig(temperature=0.7, top_k=5)


def test_model_draft_t1(target, draft):
    tokens = check_exact(target, draft, 2, T1)
    # The test has power: the same samples are far from the draft's own distribution.
    with pytest.raises(AssertionError):
        assert_matches(tokens[:, 1:], exact_joints(draft, T1)[1])


def test_model_draft_t07_top_k(target, draft):
    check_exact(target, draft, 3, T07_TOPK)


def test_prompt_lookup_t1(target):
    check_exact(target, PromptLookup(), 2, T1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, k, sampling",
    [
        ("lookup", 3, T07_TOPK),
        ("early-exit", 2, T1),
        ("early-exit", 1, T07_TOPK),
        ("model", 1, SamplingConfig(temperature=1.0, top_p=0.8, min_p=0.05)),
    ],
)
def test_other_kinds_and_filters(target, draft, kind, k, sampling):
    d = {"lookup": PromptLookup(max_ngram=2), "early-exit": EarlyExit(1), "model": draft}[kind]
    check_exact(target, d, k, sampling)
