"""EAGLE drafting: greedy identical to ``generate(target)`` (ragged batch, EOS, both caches),
sampling exactly the target's distribution (chi-square), the draft's cache bookkeeping against
an offline replay of the same chain, usage errors."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_transformer
from flax import nnx
from test_speculative import NEW, PROMPTS, reference  # noqa: F401 (a fixture)
from test_speculative_exact import SMALL, T1, check_exact

from decoding import Eagle, Engine, generate, speculative_generate
from models import EagleHead
from models.eagle_train import chain_acceptance, sequence_features, train_eagle
from models.train_step import TrainConfig


def random_head(target, seed=0, vocab=None):
    vocab = range(target.config.vocab_size) if vocab is None else vocab
    return EagleHead(target.config, vocab=list(vocab), rngs=nnx.Rngs(seed)).init_from(target)


@pytest.mark.parametrize(
    "k, cache, vocab, lookup",
    [
        (1, "paged", None, None),
        (3, "paged", range(0, 264, 3), None),  # a draft vocabulary: a third of the tokens
        (5, "paged", None, (2, 2)),  # with prompt lookup; the head drafts 2 of 5
        pytest.param(8, "contiguous", None, None, marks=pytest.mark.slow),
    ],
)
def test_greedy_equals_generate(tiny_model, reference, k, cache, vocab, lookup):  # noqa: F811
    eos, want = reference
    ngram, most = lookup or (None, None)
    res = speculative_generate(
        tiny_model,
        Eagle(random_head(tiny_model, vocab=vocab), lookup_ngram=ngram, head_tokens=most),
        PROMPTS,
        num_draft_tokens=k,
        max_new_tokens=NEW,
        eos_id=eos,
        cache=cache,
    )
    assert res.tokens == want
    assert res.stats["num_draft_tokens"] == k
    if lookup is not None:  # the head drafts at most `most` of the k
        assert res.stats["draft_calls"] <= 1 + res.stats["target_calls"] * most


def test_lookup_copies_where_the_answer_repeats_itself():
    """The shipped code model on code that repeats its own identifiers: lookup's copied runs
    are kept (more tokens per call than the untrained head alone) and the output stays the
    target's."""
    import models

    target, tok = models.pretrained("code-target")
    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul("
    prompt = [tok.bos_id] + tok.encode(text)
    want = generate(target, [prompt], max_new_tokens=32).tokens
    head = random_head(target)
    run = lambda d: speculative_generate(  # noqa: E731
        target, d, [prompt], num_draft_tokens=4, max_new_tokens=32
    )
    alone, both = run(Eagle(head)), run(Eagle(head, lookup_ngram=2))
    one = run(Eagle(head, lookup_ngram=2, head_tokens=1))  # a step without a match: Tq = 2
    assert alone.tokens == both.tokens == one.tokens == want
    assert both.stats["tokens_per_target_call"] > alone.stats["tokens_per_target_call"]
    # A step where the row matched made only the feed call, not the head's 3 (the default cap).
    assert both.stats["draft_calls"] < 1 + 3 * both.stats["target_calls"]


def test_a_step_without_a_match_verifies_the_head_tokens_alone(tiny_model):
    """k past ``head_tokens``: the proposal's cut is short (Tq = m + 1) exactly where no row's
    n-gram matched; a row's long lookup draft is verified whole."""
    import jax
    import jax.numpy as jnp

    from decoding import SamplingConfig
    from decoding.drafts import Context
    from models import KVCache

    kind, params = Eagle(random_head(tiny_model), lookup_ngram=2, head_tokens=2).split()
    cache = KVCache.contiguous(tiny_model.config, 2, 16).replace(
        lengths=jnp.asarray([6, 6], jnp.int32)
    )
    cache0, pend, _ = kind.empty_state(tiny_model, params, 2, 16)
    state = (cache0.replace(lengths=jnp.asarray([5, 5], jnp.int32)), pend, jnp.ones(2, jnp.int32))
    seq = jnp.asarray([[5, 6, 7, 8, 9, 5, 6, 0], [1, 2, 3, 4, 5, 6, 7, 0]], jnp.int32)

    def cut(seq, k=5):
        prop = kind.propose(Context(tiny_model, cache, seq, params, state), k, SamplingConfig(),
                            jax.random.key(0))  # fmt: skip
        return prop.cut if prop.cut is None else (prop.cut[0], np.asarray(prop.cut[1]).tolist())

    assert cut(seq) == (2, [True, False])  # row 0's last 2 tokens occurred before
    assert cut(seq.at[0, 5].set(1)) == (2, [False, False])
    assert cut(seq, k=2) is None


def test_the_chain_picks_over_the_draft_vocabulary_as_over_the_whole(tiny_model):
    """``eagle.chain`` takes the argmax over the head's sub-vocabulary logits: the same token
    as over the whole -inf-padded row, ties included (all-equal logits: the smallest id)."""
    import jax
    import jax.numpy as jnp

    from decoding.eagle import chain
    from decoding.sampling import argmax

    head = random_head(tiny_model, vocab=range(3, 264, 5))
    x = jax.random.normal(jax.random.key(0), (3, 1, tiny_model.config.dim))
    kc, vc = head.cache(3, 8).k[0], head.cache(3, 8).v[0]
    lengths = jnp.zeros((3,), jnp.int32)

    def first(h):
        pick = lambda logits, i: argmax(logits)  # noqa: E731
        return chain(h, tiny_model.embed, x, kc, vc, lengths, None, 2, 1, pick)[0][:, 0]

    np.testing.assert_array_equal(first(head), argmax(head.logits(x)[:, 0]))
    head.vocab_head.kernel.set_value(jnp.zeros_like(head.vocab_head.kernel[...]))
    np.testing.assert_array_equal(first(head), [3, 3, 3])
    np.testing.assert_array_equal(argmax(head.logits(x)[:, 0]), [3, 3, 3])


@pytest.mark.parametrize("lookup", [None, (1, 1)])
def test_sampling_is_exact_t1(lookup):
    """With lookup (n = 1 on 16 tokens: most steps match) and the head drafting 1 of 3: the
    copied tokens' and the fillers' one-hot q keep the output exact."""
    target = random_transformer(10, num_layers=2, **SMALL)
    ngram, most = lookup or (None, None)
    check_exact(
        target, Eagle(random_head(target, seed=5), lookup_ngram=ngram, head_tokens=most), 3, T1
    )


@pytest.fixture(scope="module")
def trained(tiny_model):
    """A head trained for a few steps on the tiny target's own greedy answers (repetitive
    enough for the draft to learn), and those answers."""
    prompts = [[int(x) for x in np.random.default_rng(i).integers(1, 264, 6)] for i in range(16)]
    out = generate(tiny_model, prompts, max_new_tokens=40).tokens
    seqs = [p + o for p, o in zip(prompts, out, strict=True)]
    feats = sequence_features(tiny_model, seqs, log=lambda s: None)
    tc = TrainConfig(steps=60, batch=8, lr=3e-3, warmup=5, eval_every=60, seed=0)
    plens = [len(p) for p in prompts]
    head, summary = train_eagle(
        tiny_model,
        seqs,
        plens,
        feats,
        tc,
        heldout=None,
        draft_vocab=264,
        feature_weight=1.0,
        noise=0.0,
        log=lambda s: None,
    )
    return head, prompts, summary


@pytest.mark.parametrize("k", [1, 4])
def test_acceptance_replays_the_offline_chain(tiny_model, trained, k):
    """One row, greedy: the verifications accept exactly what ``chain_acceptance`` (the draft
    run over the whole answer's hidden states, then k tokens after each anchor) says they
    accept from the anchors the run visits. A draft cache that lost or misplaced a pair, or a
    feature from the wrong position, changes the drafts and so the counts."""
    head, prompts, _ = trained
    prompt, new = prompts[0], 24
    longer = prompt + generate(tiny_model, [prompt], max_new_tokens=new + k + 2).tokens[0]
    feats = sequence_features(tiny_model, [longer], log=lambda s: None)[0]
    per_anchor = chain_acceptance(head, tiny_model, longer, feats, len(prompt), k)
    t, emitted, accepted = len(prompt) - 1, 1, 0
    while emitted < new:
        n = int(min(per_anchor[t - (len(prompt) - 1)], k))
        accepted += n
        emitted += n + 1
        t += n + 1
    res = speculative_generate(
        tiny_model, Eagle(head), [prompt], num_draft_tokens=k, max_new_tokens=new
    )
    assert res.tokens[0] == longer[len(prompt) : len(prompt) + new]
    got = round(res.stats["acceptance_rate"] * res.stats["draft_proposed"])
    assert got == accepted
    assert accepted >= new // 4  # the trained draft is kept: the bookkeeping is exercised


def test_bad_arguments(tiny_model):
    with pytest.raises(TypeError, match="head"):
        Eagle(tiny_model)
    head = random_head(tiny_model)
    with pytest.raises(ValueError, match="lookup_ngram"):
        Eagle(head, lookup_ngram=0)
    with pytest.raises(ValueError, match="head_tokens"):
        Eagle(head, head_tokens=9)
    with pytest.raises(TypeError, match="head_tokens"):
        Eagle(head, head_tokens=2.5)
    with pytest.raises(ValueError, match="MAX_K"):
        speculative_generate(
            tiny_model,
            Eagle(random_head(tiny_model)),
            PROMPTS,
            num_draft_tokens=9,
            max_new_tokens=2,
        )
    other = random_transformer(dim=32, mlp_dim=64)
    with pytest.raises(ValueError, match="dim"):
        speculative_generate(
            other, Eagle(random_head(tiny_model)), PROMPTS, num_draft_tokens=2, max_new_tokens=2
        )


def test_shipped_smollm2_head_loads_and_keeps_greedy_output(smollm2_gguf, capsys):
    """The shipped self-distilled head fits the real model, is small (one block, float16, and
    the target's rows of a 4096-token draft vocabulary), loads in bfloat16 by default, its
    chain's greedy output is the float32 model's own (in the engine too), and the command line
    drafts with it."""
    from decoding.__main__ import main
    from models import load_gguf, pretrained
    from models.pretrained import shipped_path

    head, tokenizer = pretrained("smollm2-135m-instruct-eagle")
    assert head.fc.kernel[...].dtype == "bfloat16"  # by default: half the bytes per draft
    target = load_gguf(smollm2_gguf)
    head.check_target(target.config)
    assert head.vocab[...].size == 4096
    size = sum(f.stat().st_size for f in shipped_path("smollm2-135m-instruct-eagle").iterdir())
    assert size < 14 << 20, size
    rows = target.embed.embedding[...][head.vocab[...]]
    np.testing.assert_allclose(head.vocab_head.kernel[...].T, rows, atol=2e-3, rtol=1e-2)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    want = generate(target, [ids], max_new_tokens=12).tokens
    res = speculative_generate(target, Eagle(head), [ids], num_draft_tokens=3, max_new_tokens=12)
    assert res.tokens == want, (tokenizer.decode(res.tokens[0]), tokenizer.decode(want[0]))
    assert res.stats["acceptance_rate"] > 0  # the real head drafts what the model says
    eng = Engine(target, max_batch=2, num_pages=16, page_size=16, max_seq_len=128,
                 draft=Eagle(head, lookup_ngram=3), num_draft_tokens=3)  # fmt: skip
    rid = eng.submit(ids, 12)
    assert eng.run_until_done()[rid] == want[0]  # and in the engine
    assert eng.stats()["draft_accepted"] > 0
    for spec in ("eagle", "eagle+lookup"):
        argv = ["Name three colours.", "--chat", "--max-new-tokens", "8", "--speculative", spec]
        assert main(argv) == 0
        assert f"{spec}, k=" in capsys.readouterr().err
