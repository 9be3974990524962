"""The draft kinds' protocol (``decoding.drafts.DraftKind``) and the options ``generate`` and
``speculative_generate`` share (``decoding.generate.GenerateOptions``): no compilation."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from test_medusa import random_heads

from decoding import EarlyExit, Medusa, PromptLookup, TreeSpec, generate, speculative_generate
from decoding.drafts import MAX_K, PRIOR_ACCEPTANCE, DraftKind, ModelDraft
from decoding.generate import GenerateOptions
from decoding.speculative import draft_kind


def _kinds(tiny_model):
    heads = random_heads(tiny_model, num_heads=3)
    return {
        "model": draft_kind(tiny_model),
        "prompt-lookup": draft_kind(PromptLookup()),
        "early-exit": draft_kind(EarlyExit(1)),
        "medusa": draft_kind(Medusa(heads)),
        "tree": draft_kind(Medusa(heads, tree=TreeSpec(((0,), (1,), (0, 0))))),
    }


def test_every_kind_implements_the_protocol_and_states_its_costs(tiny_model):
    kinds = _kinds(tiny_model)
    for name, (kind, params) in kinds.items():
        assert isinstance(kind, DraftKind), name
        hash(kind)  # a static argument of the jitted loop
        costs = kind.costs(tiny_model, params)
        assert costs.prior == PRIOR_ACCEPTANCE["medusa" if name == "tree" else name], name
    model, _ = kinds["model"]
    assert isinstance(model, ModelDraft) and model.prefill_calls == 1
    assert kinds["model"][0].costs(tiny_model, kinds["model"][1]).calls(3) == 3
    early = kinds["early-exit"][0].costs(tiny_model, None)
    assert early.model is tiny_model  # its calls are a share of the target's own step
    assert early.calls(2) == pytest.approx(2 / tiny_model.config.num_layers)
    chain = kinds["medusa"][0].costs(tiny_model, kinds["medusa"][1])
    assert (chain.max_k, chain.fixed_k, chain.calls(4)) == (min(MAX_K, 3), None, 0)
    tree, tree_params = kinds["tree"]
    assert tree.costs(tiny_model, tree_params).fixed_k == 2 and tree.verify_width == 3
    assert kinds["prompt-lookup"][0].verify_width == 0  # a chain writes k slots only


def test_an_eagle_heads_calls_cost_its_bytes_share_of_the_target(tiny_model):
    """A drafting call costs the head's weights' share of the target's bytes (a memory-bound
    step reads them): a bfloat16 head on a float32 target half its float32 self's."""
    from test_eagle import random_head

    from decoding import Eagle
    from decoding.eagle import draft_share

    head = random_head(tiny_model)
    bf16 = random_head(tiny_model)
    nnx.update(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(bf16, nnx.Param)))
    calls = {}
    for name, h in (("float32", head), ("bfloat16", bf16)):
        kind, params = draft_kind(Eagle(h, lookup_ngram=2, head_tokens=2))
        calls[name] = kind.costs(tiny_model, params).calls
    share = draft_share(head)
    assert calls["float32"](1) == pytest.approx(share)
    assert calls["float32"](5) == pytest.approx(2 * share)  # the head drafts at most 2
    assert calls["bfloat16"](5) == pytest.approx(share)


def test_every_kind_states_whether_its_proposals_are_deterministic(tiny_model):
    kinds = _kinds(tiny_model)
    kinds["medusa+lookup"] = draft_kind(Medusa(random_heads(tiny_model, 3), lookup_ngram=2))
    deterministic = {name for name, (kind, _) in kinds.items() if kind.deterministic is True}
    assert deterministic == {"prompt-lookup", "tree"}
    for name, (kind, _) in kinds.items():  # its own statement, not the protocol's default
        assert "deterministic" in vars(type(kind)), name


def test_options_are_one_definition_for_both_calls(tiny_model):
    names = {f.name for f in dataclasses.fields(GenerateOptions)}
    assert names == {"max_new_tokens", "sampling", "eos_id", "seed", "cache", "page_size"} | {
        "num_pages"
    }
    for call in (
        lambda **kw: generate(tiny_model, [[1, 2]], **kw),
        lambda **kw: speculative_generate(tiny_model, PromptLookup(), [[1, 2]], **kw),
    ):
        with pytest.raises(TypeError, match="max_new_token"):
            call(max_new_token=4)  # a misspelt keyword is refused, not ignored
        with pytest.raises(TypeError, match="max_new_tokens"):
            call()
        with pytest.raises(ValueError, match="cache must be one of"):
            call(max_new_tokens=4, cache="ring")
        with pytest.raises(ValueError, match="page_size"):
            call(max_new_tokens=4, page_size=0)


def test_a_greedy_batchs_q_is_its_tokens_one_hot_without_the_drawn_distributions(tiny_model):
    """``drafts.draft_q`` with traced settings (the loops' and the engine's): a batch of greedy
    rows gets the one-hot of its tokens without asking for the distributions (a NaN there never
    shows), a batch with a sampled row gets them. Each kind that draws (a model draft, Medusa,
    EAGLE) proposes, jitted with the loop's traced settings: q is its tokens' one-hot when
    greedy, and when sampled its tokens and q are those the settings give on the host."""
    import numpy as np
    from test_eagle import random_head
    from test_medusa import random_heads

    from decoding import Eagle, SamplingConfig
    from decoding.drafts import Context, autoregressive_proposal, draft_q
    from decoding.sampling import SamplingParams
    from models import KVCache

    greedy = SamplingParams.rows([SamplingConfig()] * 2)
    mixed = SamplingParams.rows([SamplingConfig(), SamplingConfig(temperature=1.0)])
    tokens = jnp.asarray([[1, 2], [3, 0]], jnp.int32)
    nan = lambda: jnp.full((2, 2, 5), jnp.nan)  # noqa: E731
    run = jax.jit(lambda p: draft_q(tokens, 5, nan, p))
    np.testing.assert_array_equal(run(greedy), jax.nn.one_hot(tokens, 5))
    assert np.isnan(run(mixed)).all()

    V = tiny_model.config.vocab_size
    seq = jnp.asarray([[5, 6, 7, 8, 9, 5, 6, 0], [1, 2, 3, 4, 5, 6, 7, 0]], jnp.int32)
    cache = KVCache.contiguous(tiny_model.config, 2, 16).replace(
        lengths=jnp.asarray([6, 6], jnp.int32)
    )
    h = jax.random.normal(jax.random.key(0), (2, tiny_model.config.dim))
    medusa, medusa_params = Medusa(random_heads(tiny_model, 3)).split()
    eagle, eagle_params = Eagle(random_head(tiny_model)).split()
    draft_cache, pend, _ = eagle.empty_state(tiny_model, eagle_params, 2, 16)
    eagle_state = (
        draft_cache.replace(lengths=jnp.asarray([5, 5], jnp.int32)),
        pend,
        jnp.ones(2, jnp.int32),
    )
    table = jax.random.normal(jax.random.key(1), (V, V))  # a toy draft model: next logits by token

    proposals = {
        "model": lambda p, key: autoregressive_proposal(
            lambda t, c: (table[t], c), None, table[seq[:, 6]], 3, p, key
        )[:2],
        "medusa": lambda p, key: medusa.propose(
            Context(tiny_model, cache, seq, medusa_params, h), 3, p, key
        )[:2],
        "eagle": lambda p, key: eagle.propose(
            Context(tiny_model, cache, seq, eagle_params, eagle_state), 3, p, key
        )[:2],
    }
    key = jax.random.key(2)
    t1 = SamplingConfig(temperature=1.0)
    for name, propose in proposals.items():
        fn = jax.jit(propose)  # the settings traced, as the loop passes them
        toks, q = fn(SamplingConfig().params(), key)
        np.testing.assert_array_equal(q, jax.nn.one_hot(toks, V), err_msg=name)
        toks_t, q_t = fn(t1.params(), key)
        toks_h, q_h = propose(t1, key)  # host settings: the distributions, no branch
        np.testing.assert_array_equal(toks_t, toks_h, err_msg=name)
        np.testing.assert_allclose(q_t, q_h, rtol=1e-5, atol=1e-7, err_msg=name)
        assert float(q_t.max()) < 1.0, name  # a spread distribution, not a one-hot
    # The engine's settings, one per row [B] (a model draft there): the greedy row's q is its
    # tokens' one-hot, the sampled row's tokens and q those of an all-sampled batch.
    fn = jax.jit(proposals["model"])
    (toks_m, q_m), (toks_s, q_s) = fn(mixed, key), fn(SamplingParams.rows([t1] * 2), key)
    np.testing.assert_array_equal(q_m[0], jax.nn.one_hot(toks_m[0], V))
    np.testing.assert_array_equal(toks_m[1], toks_s[1])
    np.testing.assert_allclose(q_m[1], q_s[1], rtol=1e-5, atol=1e-7)
