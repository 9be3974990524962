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

from decoding import Eagle, generate, speculative_generate
from models import EagleHead
from models.eagle_train import chain_acceptance, sequence_features, train_eagle
from models.train_step import TrainConfig


def random_head(target, seed=0, vocab=None):
    vocab = range(target.config.vocab_size) if vocab is None else vocab
    return EagleHead(target.config, vocab=list(vocab), rngs=nnx.Rngs(seed)).init_from(target)


@pytest.mark.parametrize(
    "k, cache, vocab",
    [
        (1, "paged", None),
        (3, "paged", range(0, 264, 3)),  # a draft vocabulary: a third of the tokens
        pytest.param(8, "contiguous", None, marks=pytest.mark.slow),
    ],
)
def test_greedy_equals_generate(tiny_model, reference, k, cache, vocab):  # noqa: F811
    eos, want = reference
    res = speculative_generate(
        tiny_model,
        Eagle(random_head(tiny_model, vocab=vocab)),
        PROMPTS,
        num_draft_tokens=k,
        max_new_tokens=NEW,
        eos_id=eos,
        cache=cache,
    )
    assert res.tokens == want
    assert res.stats["num_draft_tokens"] == k


def test_sampling_is_exact_t1():
    target = random_transformer(10, num_layers=2, **SMALL)
    check_exact(target, Eagle(random_head(target, seed=5)), 3, T1)


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


def test_the_engine_refuses_eagle_by_name(tiny_model):
    from decoding import Engine

    with pytest.raises(TypeError, match="speculative_generate"):
        Engine(tiny_model, num_pages=8, draft=Eagle(random_head(tiny_model)))


def test_shipped_smollm2_head_loads_and_keeps_greedy_output(smollm2_gguf, capsys):
    """The shipped self-distilled head fits the real model, is small (one block, float16, and
    the target's rows of a 4096-token draft vocabulary), its chain's greedy output is the
    model's own, and the command line drafts with it."""
    from decoding.__main__ import main
    from models import load_gguf, pretrained
    from models.pretrained import shipped_path

    head, tokenizer = pretrained("smollm2-135m-instruct-eagle")
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
    argv = ["Name three colours.", "--chat", "--max-new-tokens", "8", "--speculative", "eagle"]
    assert main(argv) == 0
    assert "eagle, k=" in capsys.readouterr().err
