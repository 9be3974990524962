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
