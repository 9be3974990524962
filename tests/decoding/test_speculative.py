"""Speculative decoding, greedy: identical to ``generate(target)`` for every draft kind, ragged
batches with EOS, both caches; consistent stats; n-gram lookup; usage errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_transformer

from decoding import EarlyExit, PromptLookup, SamplingConfig, generate, speculative_generate
from decoding.drafts import lookup

# Ragged (B = 3, padded to 4); repeated n-grams so that prompt lookup finds matches.
PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [100, 50, 3, 3, 3, 3, 3, 3, 9]]
NEW = 14


@pytest.fixture(scope="module")
def draft_model():
    return random_transformer(1, num_layers=1)


def _draft(name, draft_model):
    return {"model": draft_model, "lookup": PromptLookup(), "early-exit": EarlyExit(1)}[name]


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy ``generate`` with an EOS that row 0 produces at its 5th token."""
    eos = generate(tiny_model, PROMPTS, max_new_tokens=NEW).tokens[0][4]
    return eos, generate(tiny_model, PROMPTS, max_new_tokens=NEW, eos_id=eos).tokens


def _check_greedy(tiny_model, draft_model, reference, name, k, cache):
    eos, want = reference
    res = speculative_generate(
        tiny_model,
        _draft(name, draft_model),
        PROMPTS,
        num_draft_tokens=k,
        max_new_tokens=NEW,
        eos_id=eos,
        cache=cache,
    )
    assert res.tokens == want
    assert len(res.tokens[0]) == 5 and res.tokens[0][-1] == eos
    assert max(len(t) for t in want) == NEW  # some row runs to exactly max_new_tokens
    return res


@pytest.mark.parametrize(
    "name, k, cache",
    [("model", 3, "paged"), ("lookup", 5, "contiguous"), ("early-exit", 1, "paged")],
)
def test_greedy_equals_generate(tiny_model, draft_model, reference, name, k, cache):
    _check_greedy(tiny_model, draft_model, reference, name, k, cache)


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["paged", "contiguous"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("name", ["model", "lookup", "early-exit"])
def test_greedy_equals_generate_all(tiny_model, draft_model, reference, name, k, cache):
    _check_greedy(tiny_model, draft_model, reference, name, k, cache)


def test_target_as_its_own_draft_accepts_everything(tiny_model, reference):
    k, (eos, want) = 3, reference
    res = speculative_generate(
        tiny_model, tiny_model, PROMPTS, num_draft_tokens=k, max_new_tokens=NEW, eos_id=eos
    )
    s = res.stats
    assert res.tokens == want
    assert s["acceptance_rate"] == 1.0 and s["num_draft_tokens"] == k
    # 1 token from prefill, then k + 1 per step (the last step cut at max_new_tokens).
    assert s["target_calls"] == -(-(NEW - 1) // (k + 1)) == s["steps"] - 1
    assert s["draft_calls"] == 1 + k * s["target_calls"]  # prefill + k per step


def test_stats_are_consistent(tiny_model, draft_model):
    """Same shapes as the greedy model-draft test above (no recompilation), without EOS."""
    k = 3
    res = speculative_generate(
        tiny_model, draft_model, PROMPTS, num_draft_tokens=k, max_new_tokens=NEW
    )
    s, B = res.stats, len(PROMPTS)
    assert s["steps"] == s["target_calls"] + 1 and s["new_tokens"] == B * NEW
    row_steps = (s["new_tokens"] - B) / s["tokens_per_target_call"]
    assert s["target_calls"] <= row_steps + 1e-9 <= B * s["target_calls"] + 2e-9
    accepted = s["acceptance_rate"] * k * row_steps
    assert 0 <= accepted <= k * row_steps
    # Each step emits accepted + 1 tokens per row; only a row's last step may be cut.
    overshoot = accepted + row_steps - (s["new_tokens"] - B)
    assert -1e-6 <= overshoot <= B * k + 1e-6
    assert s["draft_calls"] == 1 + k * s["target_calls"]


def _lookup_reference(seq, n_known, k, min_ngram, max_ngram):
    """The n-gram rule in plain Python, for one row."""
    s = list(seq[:n_known])
    for n in range(max_ngram, min_ngram - 1, -1):
        if n_known < n:
            continue
        tail = s[-n:]
        starts = [i for i in range(n_known - n) if s[i : i + n] == tail]
        if starts:
            c = starts[-1] + n
            return [s[min(c + j, n_known - 1)] for j in range(k)]
    return [s[-1]] * k


def test_lookup_matches_a_plain_python_reference():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 4, size=(64, 24)).astype(np.int32)
    n_known = rng.integers(1, 25, size=64).astype(np.int32)
    for mn, mx, k in [(1, 3, 4), (2, 2, 1)]:
        fn = jax.jit(lookup, static_argnums=(2, 3, 4))
        got = np.asarray(fn(jnp.asarray(seq), jnp.asarray(n_known), k, mn, mx))
        want = [_lookup_reference(seq[b], n_known[b], k, mn, mx) for b in range(64)]
        assert got.tolist() == want


def test_bad_arguments_raise(tiny_model):
    other_vocab = random_transformer(2, vocab_size=32, num_layers=1)
    with pytest.raises(ValueError, match="vocab"):
        speculative_generate(tiny_model, other_vocab, PROMPTS, max_new_tokens=2)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(
            tiny_model, PromptLookup(), PROMPTS, max_new_tokens=2, num_draft_tokens=0
        )
    with pytest.raises(ValueError, match="num_layers"):
        speculative_generate(tiny_model, EarlyExit(2), PROMPTS, max_new_tokens=2)
    with pytest.raises(ValueError, match="num_layers"):
        EarlyExit(0)
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)
    with pytest.raises(TypeError, match="draft"):
        speculative_generate(tiny_model, "code-draft", PROMPTS, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(tiny_model, PromptLookup(), PROMPTS, max_new_tokens=0)


def test_early_exit_equals_the_target_when_the_skipped_layer_is_a_no_op():
    """With the last block's output projections zeroed the first L - 1 blocks compute the same
    hidden state as all L: the early-exit draft, reading and writing the shared cache, must then
    agree with the target on every token (acceptance 1), which wrong cache positions would break.
    """
    target = random_transformer(3)
    last = target.layers[target.config.num_layers - 1]
    for p in (last.attn.o_proj.kernel, last.mlp.down_proj.kernel):
        p[...] = jnp.zeros_like(p[...])
    res = speculative_generate(
        target, EarlyExit(1), PROMPTS, num_draft_tokens=3, max_new_tokens=NEW, cache="contiguous"
    )
    assert res.stats["acceptance_rate"] == 1.0
    assert len({tuple(t) for t in res.tokens}) == len(PROMPTS)  # not degenerate


def test_greedy_rule_is_the_limit_of_the_sampling_rule():
    """accept_greedy (argmax compare, no randomness) == accept on one-hot p and q, for random
    logits with ties and drafts that agree with the target for a random prefix."""
    from decoding.acceptance import accept, accept_greedy, verify
    from decoding.sampling import SamplingConfig, argmax, probabilities

    rng = np.random.default_rng(0)
    B, k, V = 64, 4, 7
    logits = jnp.asarray(rng.integers(0, 3, (B, k + 1, V)), jnp.float32)  # many ties
    best = np.asarray(argmax(logits))
    agree = rng.integers(0, k + 1, B)
    draft = np.where(np.arange(k) < agree[:, None], best[:, :k], rng.integers(0, V, (B, k)))
    draft = jnp.asarray(draft, jnp.int32)
    greedy = SamplingConfig()
    n, nxt = accept_greedy(jnp.asarray(best), draft)
    n2, nxt2 = accept(
        probabilities(logits, greedy), jax.nn.one_hot(draft, V), draft, jax.random.key(1)
    )
    np.testing.assert_array_equal(n, n2)
    np.testing.assert_array_equal(nxt, nxt2)
    assert np.all(np.asarray(n) >= np.minimum(agree, k))
    n3, nxt3 = verify(logits, None, draft, greedy, None)
    np.testing.assert_array_equal(n3, n)
    np.testing.assert_array_equal(nxt3, nxt)


def test_default_num_draft_tokens_per_backend(monkeypatch):
    """The unmeasured k of each kind (used where nothing can be measured, e.g. sharded)."""
    from decoding.drafts import DEFAULT_K, ModelDraft

    kinds = {"prompt-lookup": PromptLookup(), "early-exit": EarlyExit(num_layers=1)}
    kinds["model"] = ModelDraft.split(random_transformer(seed=1))[0]
    for backend, table in [("cpu", "cpu"), ("gpu", "gpu"), ("tpu", "gpu")]:
        monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
        for name, kind in kinds.items():
            assert kind.default_num_draft_tokens == DEFAULT_K[table][name], (backend, name)
    monkeypatch.undo()


def test_lookup_program_does_not_grow_with_max_ngram(tiny_model):
    """PromptLookup(max_ngram=60) unrolled 60 * 61 / 2 comparisons (18 s to compile); the n-gram
    match is now a loop: the traced program has the same size for every max_ngram >= 4."""
    seq, length = jnp.zeros((2, 128), jnp.int32), jnp.array([100, 7], jnp.int32)

    def size(max_ngram):
        return len(jax.make_jaxpr(lambda s, n: lookup(s, n, 3, 1, max_ngram))(seq, length).eqns)

    assert size(4) == size(60) == size(500)
    res = speculative_generate(tiny_model, PromptLookup(max_ngram=60), PROMPTS, max_new_tokens=4)
    assert res.tokens == generate(tiny_model, PROMPTS, max_new_tokens=4).tokens


def test_numpy_scalars_accepted_bools_rejected(tiny_model):
    assert PromptLookup(np.int64(4), np.int32(2)) == PromptLookup(4, 2)
    assert EarlyExit(np.int64(1)) == EarlyExit(1) and type(EarlyExit(np.int64(1)).num_layers) is int
    res = speculative_generate(
        tiny_model, PromptLookup(), PROMPTS, max_new_tokens=np.int64(3), num_draft_tokens=np.int8(2)
    )
    assert res.stats["num_draft_tokens"] == 2
    for bad in (lambda: EarlyExit(True), lambda: PromptLookup(max_ngram=True)):
        with pytest.raises(TypeError):
            bad()
    with pytest.raises(TypeError, match="num_draft_tokens"):
        speculative_generate(
            tiny_model, PromptLookup(), PROMPTS, max_new_tokens=2, num_draft_tokens=True
        )
    with pytest.raises(TypeError, match="target"):
        speculative_generate("code-target", PromptLookup(), PROMPTS, max_new_tokens=2)


@pytest.mark.parametrize("sampling", [None, SamplingConfig(temperature=1.0)])
def test_lookup_without_a_match_takes_plain_steps(tiny_model, sampling):
    """Where no live row's n-gram occurred before, the step is a plain Tq = 1 step (one token,
    nothing proposed or judged), and greedy output still equals ``generate``; a row with
    matches in a batch keeps every row verifying."""
    distinct = list(range(10, 40))
    kw = dict(max_new_tokens=3, sampling=sampling or SamplingConfig(), seed=0)
    draft = PromptLookup(min_ngram=3, max_ngram=3)
    res = speculative_generate(tiny_model, draft, [distinct], num_draft_tokens=4, **kw)
    assert len(res.tokens[0]) == 3
    if sampling is None:
        assert res.tokens == generate(tiny_model, [distinct], **kw).tokens
    assert res.stats["draft_proposed"] == 0 and res.stats["tokens_per_target_call"] == 1.0
    if sampling is not None:
        return
    # Beside a row that repeats itself, the distinct row verifies too, and is still unchanged.
    p = [3, 1, 4, 1, 5, 9, 2, 6]
    cont = generate(tiny_model, [p], max_new_tokens=8).tokens[0]
    repeats = p + cont + p + cont[:2]  # its greedy continuation is cont[2:] again
    both = speculative_generate(tiny_model, draft, [distinct, repeats], num_draft_tokens=4, **kw)
    assert both.stats["draft_proposed"] > 0 and both.tokens[0] == res.tokens[0]


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=1.0)])
def test_a_cut_verifies_the_first_m_tokens_alone(tiny_model, sampling):
    """``Proposal.cut = (m, long)``: where no row is long, the verification of ``[last, d_1 ..
    d_m]`` (n <= m, the hidden states of its m + 1 positions, zero past them); otherwise the
    whole k."""
    from decoding.drafts import Proposal, verify_chain
    from models import KVCache

    B, k, m, V = 2, 5, 2, tiny_model.config.vocab_size
    rng = np.random.default_rng(0)
    prefix = jnp.asarray(rng.integers(1, V, (B, 6)), jnp.int32)
    _, cache = tiny_model(prefix, cache=KVCache.contiguous(tiny_model.config, B, 16))
    last = jnp.asarray(rng.integers(1, V, (B, 1)), jnp.int32)
    tokens = jnp.asarray(rng.integers(1, V, (B, k)), jnp.int32)
    q = jax.nn.softmax(jnp.asarray(rng.normal(size=(B, k, V)), jnp.float32))
    key = jax.random.key(3)

    def run(prop):  # jitted as the loop runs it (the cut's m static, its rows traced)
        cut = prop.cut

        def step(p, short):
            p = p if cut is None else p._replace(cut=(cut[0], short))
            return verify_chain(tiny_model, last, p, sampling, key, hidden=True)

        short = None if cut is None else cut[1]
        return jax.jit(step)(prop._replace(cut=None), short)

    whole = Proposal(tokens, q, None, cache, 0)
    head = Proposal(tokens[:, :m], q[:, :m], None, cache, 0)
    n, nxt, _, h = run(whole._replace(cut=(m, jnp.zeros((B,), bool))))
    n_m, nxt_m, _, h_m = run(head)
    np.testing.assert_array_equal(n, n_m)
    np.testing.assert_array_equal(nxt, nxt_m)
    assert h.shape == (B, k + 1, tiny_model.config.dim) and np.all(np.asarray(n) <= m)
    np.testing.assert_allclose(h[:, : m + 1], h_m, rtol=1e-6, atol=1e-6)
    assert not np.any(np.asarray(h[:, m + 1 :]))
    got, want = run(whole._replace(cut=(m, jnp.asarray([False, True])))), run(whole)
    for a, b in zip((got[0], got[1], got[3]), (want[0], want[1], want[3]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
