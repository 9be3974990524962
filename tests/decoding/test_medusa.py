"""Medusa drafting: greedy identical to ``generate(target)`` (ragged batch, EOS, both caches),
sampling exactly the target's distribution (chi-square), usage errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_transformer
from flax import nnx
from test_speculative import NEW, PROMPTS, reference  # noqa: F401 (a fixture)
from test_speculative_exact import SMALL, T07_TOPK, T1, check_exact

from decoding import Medusa, SamplingConfig, TreeSpec, generate, speculative_generate, tree
from decoding.tree import cache_slots, compact_path
from models import KVCache, MedusaHeads


def random_heads(
    target, num_heads=4, seed=0, scale=0.3, shared_head=None, vocab=None, root_token=False
):
    """Heads initialised from the target's LM head (shared with a tied target by default),
    their residual layers random (with ``root_token``, the root token's projection too)."""
    heads = MedusaHeads(
        target.config,
        num_heads,
        shared_head=shared_head,
        vocab=vocab,
        root_token=root_token,
        rngs=nnx.Rngs(seed),
    )
    heads.init_from(target)
    for i, head in enumerate(heads.heads):
        shape = head.res.kernel.shape
        head.res.kernel.set_value(scale * jax.random.normal(jax.random.key(seed + i), shape))
        if root_token:
            key = jax.random.key(seed + 100 + i)
            head.root.kernel.set_value(scale * jax.random.normal(key, shape))
    return heads


@pytest.mark.parametrize(
    "k, cache, shared, vocab, root",
    [
        (4, "paged", True, None, False),
        (3, "paged", True, range(0, 264, 3), False),  # a draft vocabulary: a third of the tokens
        (3, "paged", True, range(0, 264, 3), True),  # heads that read the root token
        pytest.param(3, "paged", False, None, True, marks=pytest.mark.slow),
        pytest.param(3, "paged", False, None, False, marks=pytest.mark.slow),
        pytest.param(2, "contiguous", True, None, False, marks=pytest.mark.slow),
    ],
)
def test_chain_greedy_equals_generate(tiny_model, reference, k, cache, shared, vocab, root):  # noqa: F811
    eos, want = reference
    vocab = None if vocab is None else list(vocab)
    heads = random_heads(tiny_model, shared_head=shared, vocab=vocab, root_token=root)
    draft = Medusa(heads)
    res = speculative_generate(
        tiny_model,
        draft,
        PROMPTS,
        num_draft_tokens=k,
        max_new_tokens=NEW,
        eos_id=eos,
        cache=cache,
    )
    assert res.tokens == want
    assert res.stats["num_draft_tokens"] == k
    assert 0 <= res.stats["acceptance_rate"] <= 1


@pytest.fixture(scope="module")
def small_target():
    return random_transformer(10, num_layers=2, **SMALL)


def test_chain_sampling_is_exact_t1(small_target):
    check_exact(small_target, Medusa(random_heads(small_target, 3, seed=5, scale=1.0)), 3, T1)


def test_root_token_chain_sampling_is_exact_t1(small_target):
    heads = random_heads(small_target, 3, seed=5, scale=1.0, root_token=True)
    check_exact(small_target, Medusa(heads), 3, T1)


def test_root_token_heads_draft_from_the_last_known_token(tiny_model):
    """A root-token chain reads each row's last known token (``seq`` at the cache's length),
    the x_{t+1} its hidden state gave: its draft is the heads' argmax with those tokens, and
    another root changes it."""
    from decoding.drafts import Context

    heads = random_heads(tiny_model, 3, scale=1.0, root_token=True)
    kind, params = Medusa(heads).split()
    B, V = 4, tiny_model.config.vocab_size
    h = jax.random.normal(jax.random.key(1), (B, tiny_model.config.dim))
    seq = jax.random.randint(jax.random.key(2), (B, 12), 0, V)
    lengths = jnp.asarray([3, 5, 0, 11])
    cache = KVCache(k=None, v=None, lengths=lengths)
    drafted = kind.greedy_chain(Context(tiny_model, cache, seq, params, h), 3)
    root = seq[jnp.arange(B), lengths]
    want = jnp.argmax(heads(h[:, None], target=tiny_model, tokens=root[:, None])[:, 0], -1)
    np.testing.assert_array_equal(drafted, want)
    other = jnp.argmax(heads(h[:, None], target=tiny_model, tokens=(root + 1)[:, None]), -1)
    assert (np.asarray(other[:, 0]) != np.asarray(want)).any()
    with pytest.raises(ValueError, match="tokens="):
        heads(h[:, None], target=tiny_model)


def test_chain_sampling_with_a_draft_vocabulary_is_exact_t1(small_target):
    """q is zero outside the draft vocabulary: the target's tokens there come only from the
    residual distribution, and the output is still exactly the target's."""
    vocab = list(range(0, small_target.config.vocab_size, 2))
    heads = random_heads(small_target, 3, seed=5, scale=1.0, vocab=vocab)
    check_exact(small_target, Medusa(heads), 3, T1)


SMALL_TREE = TreeSpec(((0,), (1,), (0, 0), (0, 1), (1, 0)))


def test_tree_sampling_is_exact_t1(small_target):
    heads = random_heads(small_target, 2, seed=7, scale=1.0)
    # k = the node count: sizes the test's cache for the tree's verification (5 + 1 slots).
    check_exact(small_target, Medusa(heads, tree=SMALL_TREE), SMALL_TREE.num_nodes, T1)


@pytest.mark.slow
def test_tree_sampling_is_exact_t07_top_k(small_target):
    heads = random_heads(small_target, 2, seed=8, scale=1.0)
    check_exact(small_target, Medusa(heads, tree=SMALL_TREE), SMALL_TREE.num_nodes, T07_TOPK)


@pytest.mark.slow
def test_chain_sampling_is_exact_t07_top_k(small_target):
    check_exact(small_target, Medusa(random_heads(small_target, 2, seed=6, scale=1.0)), 2, T07_TOPK)


def test_bad_arguments(tiny_model):
    heads = random_heads(tiny_model, 2)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_generate(
            tiny_model, Medusa(heads), PROMPTS, num_draft_tokens=3, max_new_tokens=2
        )
    with pytest.raises(TypeError, match="heads"):
        Medusa(tiny_model)
    with pytest.raises(ValueError, match="num_heads"):
        MedusaHeads(tiny_model.config, 0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("cache", ["paged", pytest.param("contiguous", marks=pytest.mark.slow)])
def test_tree_greedy_equals_generate(tiny_model, reference, cache):  # noqa: F811
    eos, want = reference
    heads = random_heads(tiny_model, 3, scale=0.05, root_token=cache == "paged")
    draft = Medusa(heads, tree=TreeSpec.default(3))
    res = speculative_generate(
        tiny_model, draft, PROMPTS, max_new_tokens=NEW, eos_id=eos, cache=cache
    )
    assert res.tokens == want
    assert res.stats["num_draft_tokens"] == 3
    assert res.stats["tokens_per_target_call"] > 1.0, res.stats  # some nodes were accepted


@pytest.mark.parametrize(
    "paths, needle",
    [
        ((), "non-empty"),
        (((0, 0),), "no parent"),
        (((0,), (0,)), "duplicates"),
        (((0,), (-1,)), "ints >= 0"),
        (((),), "non-empty tuple of ints"),
    ],
)
def test_bad_tree_spec(paths, needle):
    with pytest.raises(ValueError, match=needle):
        TreeSpec(paths)


def test_tree_spec_tables():
    spec = TreeSpec(((1,), (0,), (0, 0), (1, 0), (0, 0, 0)))
    assert spec.paths == ((0,), (1,), (0, 0), (1, 0), (0, 0, 0))
    t = spec.tables
    assert t["parent"].tolist() == [-1, 0, 0, 1, 2, 3]
    assert t["depth"].tolist() == [0, 1, 1, 2, 2, 3]
    assert t["path"][5].tolist() == [1, 3, 5] and t["path"][4].tolist() == [2, 4, 4]
    assert t["mask"][5].tolist() == [True, True, False, True, False, True]
    assert TreeSpec.default(4).num_nodes == 18 and TreeSpec.default(4).depth == 4


def test_tree_usage_errors(tiny_model):
    heads = random_heads(tiny_model, 2)
    with pytest.raises(ValueError, match="tree of depth 3"):
        speculative_generate(
            tiny_model, Medusa(heads, tree=TreeSpec.default(3)), PROMPTS, max_new_tokens=2
        )
    with pytest.raises(ValueError, match="tree's depth 2"):
        speculative_generate(
            tiny_model,
            Medusa(heads, tree=TreeSpec.default(2)),
            PROMPTS,
            num_draft_tokens=1,
            max_new_tokens=2,
        )
    with pytest.raises(TypeError, match="tree"):
        Medusa(heads, tree=((0,),))


@pytest.mark.parametrize("paged", [False, True])
def test_compact_path_moves_the_accepted_path(tiny_model, paged):
    """Slot s of every layer holds the value s; after compaction slots start + 1 .. start + d
    hold the accepted path's nodes' slots, the rest is untouched."""
    spec = TreeSpec(((0,), (1,), (0, 0), (1, 0), (1, 1), (1, 0, 0)))
    B, S, P = 2, 16, 4
    c = tiny_model.config
    if paged:
        table = jnp.asarray(np.random.default_rng(0).permutation(B * S // P).reshape(B, S // P))
        cache = KVCache.paged(c, B * S // P, P, table)
    else:
        cache = KVCache.contiguous(c, B, S)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.float32), (B, S))
    i0, i1 = cache_slots(cache, jnp.broadcast_to(jnp.arange(S), (B, S)))
    fill = lambda x: x.at[i0, i1].set(pos[..., None, None] + 0 * x[i0, i1])  # noqa: E731
    cache = cache.replace(k=tuple(map(fill, cache.k)), v=tuple(map(fill, cache.v)))
    start, best = jnp.asarray([3, 7]), jnp.asarray([6, 4])  # node 6 = (1, 0, 0), 4 = (1, 0)
    out = compact_path(spec, cache, start, best)
    got = np.asarray(out.k[-1][i0, i1][..., 0, 0])
    want = np.tile(np.arange(S, dtype=np.float32), (B, 1))
    want[0, 4:7] = [3 + 2, 3 + 4, 3 + 6]  # nodes 2, 4, 6 of row 0 moved after the root
    want[1, 8:10] = [7 + 2, 7 + 4]
    want[1, 10] = 7 + 4  # past the path's depth: node 4 again (rolled back later)
    np.testing.assert_array_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("tree", [None, TreeSpec.default(4)], ids=["chain", "tree"])
def test_shipped_heads_greedy_equals_generate(tree):
    """The shipped heads on the shipped target accept real runs (so the tree's compaction is
    exercised on long accepted paths), and the output is still exactly greedy's."""
    from models import pretrained

    target, tok = pretrained("code-target")
    heads, _ = pretrained("code-target-medusa")
    prompts = [[tok.bos_id] + tok.encode(t) for t in ("    def __init__(self, name):\n", "import")]
    want = generate(target, prompts, max_new_tokens=40).tokens
    res = speculative_generate(target, Medusa(heads, tree=tree), prompts, max_new_tokens=40)
    assert res.tokens == want
    assert res.stats["tokens_per_target_call"] > 1.5, res.stats


def test_greedy_tree_rule_is_the_limit_of_the_sampling_rule():
    """accept_tree_greedy == accept_tree on one-hot p (random node tokens, often equal to the
    argmax so paths of every depth are accepted)."""
    from decoding.sampling import argmax
    from decoding.tree import accept_tree, accept_tree_greedy

    spec = TreeSpec.default(4)
    rng = np.random.default_rng(0)
    B, N1, V = 64, spec.num_nodes + 1, 5
    tokens = jnp.asarray(rng.integers(0, V, (B, N1)), jnp.int32)
    logits = jnp.asarray(rng.normal(size=(B, N1, V)), jnp.float32)
    best = argmax(logits)
    p = jax.nn.one_hot(best, V)
    want = accept_tree(spec, tokens, p, jax.random.key(0))
    got = accept_tree_greedy(spec, tokens, best)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(jnp.max(got[1])) >= 2  # some rows accepted a path of depth >= 2


def test_tree_from_accuracies_takes_the_most_likely_paths():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.3, 0.0], [0.4, 0.1, 0.1]]
    spec = TreeSpec.from_accuracies(acc, 5)
    # path probabilities: (0,) .6, (0,0) .3, (1,) .2, (0,1) .18, (0,0,0) .12, (2,) .1, ...
    assert spec.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    assert spec.expected_tokens(acc) == pytest.approx(1 + 0.6 + 0.2 + 0.3 + 0.18 + 0.12)
    chain = TreeSpec.from_accuracies([[0.9], [0.9], [0.9]], 3)
    assert chain.paths == ((0,), (0, 0), (0, 0, 0))
    assert TreeSpec.from_accuracies(acc, 100).num_nodes == 3 + 9 + 27  # every path
    for bad in ([], [[]], [[1.5]]):
        with pytest.raises(ValueError, match="rank_accuracy"):
            TreeSpec.from_accuracies(bad, 3)
    with pytest.raises(ValueError, match="num_nodes"):
        TreeSpec.from_accuracies(acc, 0)


def test_rank_accuracy_is_a_distribution_over_ranks(tiny_model):
    from decoding.medusa import rank_accuracy

    heads = MedusaHeads(tiny_model.config, 3, rngs=nnx.Rngs(0)).init_from(tiny_model)
    acc = np.asarray(rank_accuracy(tiny_model, heads, [[1, 2, 3], [4, 5]], max_new_tokens=12))
    assert acc.shape == (3, 4)
    assert np.all(acc >= 0) and np.all(acc.sum(1) <= 1 + 1e-9)
    # head logits computed for the first k only equal the full computation's
    h = jnp.ones((1, 2, tiny_model.config.dim))
    full = heads(h, target=tiny_model)
    np.testing.assert_array_equal(heads(h, num=2, target=tiny_model), full[..., :2, :])


@pytest.mark.parametrize("k", [1, 3, 6])  # 6: past the 4 heads
def test_chain_with_lookup_greedy_equals_generate(tiny_model, reference, k):  # noqa: F811
    eos, want = reference
    draft = Medusa(random_heads(tiny_model), lookup_ngram=2)
    res = speculative_generate(
        tiny_model, draft, PROMPTS, num_draft_tokens=k, max_new_tokens=NEW, eos_id=eos
    )
    assert res.tokens == want
    assert res.stats["num_draft_tokens"] == k


def test_chain_with_lookup_proposes_the_continuation_where_the_ngram_matched(tiny_model):
    """Row 0's last 2 tokens occurred before: it proposes what followed them; row 1's did not:
    it proposes the heads' argmax."""
    from decoding.drafts import Context

    heads = random_heads(tiny_model, 3)
    kind, params = Medusa(heads, lookup_ngram=2).split()
    plain_kind, _ = Medusa(heads).split()
    seq = jnp.asarray([[5, 6, 7, 8, 9, 5, 6, 0], [1, 2, 3, 4, 5, 6, 7, 0]], jnp.int32)
    cache = KVCache.contiguous(tiny_model.config, 2, 16).replace(
        lengths=jnp.asarray([6, 6], jnp.int32)  # seq[b, 6] is the last token, not yet fed
    )  # row 0 ends 5, 6, as it starts
    h = jax.random.normal(jax.random.key(0), (2, tiny_model.config.dim))
    ctx = Context(tiny_model, cache, seq, params, h)
    key = jax.random.key(1)
    got = kind.propose(ctx, 3, SamplingConfig(), key).tokens
    heads_only = plain_kind.propose(ctx, 3, SamplingConfig(), key).tokens
    np.testing.assert_array_equal(got[0], [7, 8, 9])
    np.testing.assert_array_equal(got[1], heads_only[1])
    q = kind.propose(ctx, 3, T1, key).q  # sampling: the lookup row's q is one-hot
    np.testing.assert_array_equal(q[0], jax.nn.one_hot(jnp.asarray([7, 8, 9]), q.shape[-1]))
    # past the 3 heads: the lookup row's continuation goes on, the other row's draft takes the
    # last head's guess again (greedy; sampled, its distribution, which q says)
    long = kind.propose(ctx, 5, SamplingConfig(), key).tokens
    np.testing.assert_array_equal(long[0], [7, 8, 9, 5, 6])
    np.testing.assert_array_equal(long[1], [*heads_only[1], heads_only[1, 2], heads_only[1, 2]])
    q = kind.propose(ctx, 5, T1, key).q
    np.testing.assert_array_equal(q[1, 3], q[1, 2])
    # k past the heads: a short verification (the heads' 3 alone) only where no row matched
    m, long = kind.propose(ctx, 5, SamplingConfig(), key).cut
    assert m == 3 and np.asarray(long).tolist() == [True, False]
    alone = Context(tiny_model, cache, seq.at[0, 5].set(1), params, h)  # row 0: no match now
    assert not np.any(kind.propose(alone, 5, SamplingConfig(), key).cut[1])
    assert kind.propose(ctx, 3, SamplingConfig(), key).cut is None
    with pytest.raises(ValueError, match="num_heads=3"):
        plain_kind.check(tiny_model, 4)
    kind.check(tiny_model, 8)


@pytest.mark.parametrize("k", [2, 3])  # 3: past the 2 heads, from the last head's q again
def test_chain_with_lookup_sampling_is_exact_t1(small_target, k):
    # n = 1: most steps find the last token earlier, some do not, so both sources are drawn.
    heads = random_heads(small_target, 2, seed=9, scale=1.0)
    check_exact(small_target, Medusa(heads, lookup_ngram=1), k, T1)


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(lookup_ngram=0), "lookup_ngram"),
        (dict(lookup_ngram=True), "lookup_ngram"),
        (dict(lookup_ngram=2, tree=TreeSpec.default(2)), "tree"),
    ],
)
def test_lookup_bad_arguments(tiny_model, kw, needle):
    with pytest.raises(ValueError, match=needle):
        Medusa(random_heads(tiny_model, 2), **kw)


def test_default_num_draft_tokens_per_backend(monkeypatch):
    from decoding.drafts import DEFAULT_K

    target = random_transformer(seed=0)
    for num_heads in (1, 4):
        heads = random_heads(target, num_heads)
        for backend, table in [("cpu", "cpu"), ("gpu", "gpu")]:
            monkeypatch.setattr(jax, "default_backend", lambda b=backend: b)
            for lookup in (None, 3):
                kind = Medusa(heads, lookup_ngram=lookup).split()[0]
                want = min(DEFAULT_K[table]["medusa"], num_heads)
                assert kind.default_num_draft_tokens == want, (num_heads, backend, lookup)
            tree = Medusa(heads, tree=TreeSpec.default(num_heads)).split()[0]
            assert tree.default_num_draft_tokens == tree.tree.depth


def test_tree_acceptance_program_does_not_grow_with_the_tree_width():
    """Each node's children were unrolled (a 150-node tree with 100 root children compiled
    80 s in 3 GB sampled): now loops, so the traced rule's size does not depend on the width."""

    def size(spec):
        B, V = 2, 16
        tokens = jnp.zeros((B, spec.num_nodes + 1), jnp.int32)
        p = jnp.full((B, spec.num_nodes + 1, V), 1.0 / V)
        fn = jax.make_jaxpr(lambda t, p: tree.accept_tree(spec, t, p, jax.random.key(0)))
        return len(fn(tokens, p).eqns)

    def wide(m):
        return TreeSpec(tuple((c,) for c in range(m)) + ((0, 0), (0, 1)))

    assert size(wide(3)) == size(wide(100))


def test_tree_choices_outside_the_vocabulary_are_rejected_before_work(tiny_model):
    heads = random_heads(tiny_model, 2)
    V = tiny_model.config.vocab_size
    spec = TreeSpec(((0,), (V,)))  # the (V + 1)-th best of V tokens
    with pytest.raises(ValueError, match=f"vocabulary has {V} tokens"):
        speculative_generate(tiny_model, Medusa(heads, tree=spec), PROMPTS, max_new_tokens=2)


def test_numpy_ints_in_trees_and_lookup_ngram(tiny_model):
    assert TreeSpec(((np.int64(0),), (0, np.int32(1)))) == TreeSpec(((0,), (0, 1)))
    assert TreeSpec.default(np.int64(2)) == TreeSpec.default(2)
    heads = random_heads(tiny_model, 2)
    assert Medusa(heads, lookup_ngram=np.int64(2)).lookup_ngram == 2
    with pytest.raises(TypeError, match="lookup_ngram"):
        Medusa(heads, lookup_ngram=True)
    with pytest.raises(ValueError, match="ints >= 0"):
        TreeSpec(((True,),))


def test_shipped_smollm2_heads_load_and_keep_greedy_output(smollm2_gguf):
    """The shipped self-distilled heads are small (residual layers reading the root token and
    the target's head rows for a 4096-token draft vocabulary, float16), fit the real model, and
    their chain's greedy output is the model's own (a short run: the real model's compile
    dominates)."""
    from models import load_gguf, pretrained
    from models.pretrained import shipped_path

    heads, tokenizer = pretrained("smollm2-135m-instruct-medusa")
    target = load_gguf(smollm2_gguf)
    assert heads.shared_head and heads.num_heads >= 3 and heads.vocab[...].size == 4096
    assert heads.root_token
    heads.check_target(target.config)
    size = sum(f.stat().st_size for f in shipped_path("smollm2-135m-instruct-medusa").iterdir())
    assert size < 11 << 20, size
    # the draft vocabulary's rows are the target's own (a float16 copy)
    rows = target.embed.embedding[...][heads.vocab[...]]
    np.testing.assert_allclose(heads.vocab_head.kernel[...].T, rows, atol=2e-3, rtol=1e-2)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    want = generate(target, [ids], max_new_tokens=8).tokens
    res = speculative_generate(target, Medusa(heads), [ids], num_draft_tokens=2, max_new_tokens=8)
    assert res.tokens == want, (tokenizer.decode(res.tokens[0]), tokenizer.decode(want[0]))
