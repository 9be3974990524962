"""EAGLE draft head: the trainer's unrolled passes are the cached drafting's features, save and
load round-trip and refuse what does not fit, training lowers the loss, usage errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import EagleHead, Transformer, TransformerConfig
from models.eagle import load_eagle, save_eagle
from models.eagle_train import main, sequence_features, unrolled_features


def _tiny(seed=0, **overrides):
    config = TransformerConfig.preset("tiny", attn_impl="xla", **overrides)
    return Transformer(config, rngs=nnx.Rngs(seed))


def _head(target, seed=3, vocab=None):
    vocab = list(range(target.config.vocab_size)) if vocab is None else vocab
    return EagleHead(target.config, vocab=vocab, rngs=nnx.Rngs(seed)).init_from(target)


def test_unrolled_passes_are_the_cached_drafting_features():
    """Pass p at index j of the trainer's parallel forward is the feature the cached block
    gives when it drafts the p-th token after anchor j (the target's pairs up to j, then its
    own features fed back): the training-time test trains what drafting runs."""
    target = _tiny()
    head = _head(target)
    depth, L = 3, 20
    seq = np.random.default_rng(0).integers(1, target.config.vocab_size, L).astype(np.int32)
    h = sequence_features(target, [list(seq)], log=lambda s: None)[0]
    T = L - depth
    tokens = np.zeros((1, T + depth + 1), np.int32)
    tokens[0, :L] = seq
    embed = target.embed.embedding[...]
    F = unrolled_features(
        head, jnp.asarray(h[None, : T + depth]), jnp.asarray(tokens), embed, depth
    )
    for j in (0, 5, T - 1):
        cache = head.cache(1, L + depth)
        kv = (cache.k[0], cache.v[0], jnp.zeros((1,), jnp.int32), None)
        pos = jnp.arange(j + 1)[None]
        f, (kc, vc) = head.features(h[None, : j + 1], embed[tokens[:, 1 : j + 2]], pos, kv=kv)
        feat = f[:, j : j + 1]
        np.testing.assert_allclose(F[0][0, j], feat[0, 0], atol=1e-5)
        for p in range(2, depth + 1):
            n = jnp.asarray([j + p - 1])
            e = embed[tokens[:, j + p : j + p + 1]]
            feat, (kc, vc) = head.features(feat, e, n[:, None], kv=(kc, vc, n, None))
            np.testing.assert_allclose(F[p - 1][0, j], feat[0, 0], atol=1e-5)


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 3e-2)])
def test_a_packed_heads_cached_block_is_the_fused_decode_layer(dtype, tol):
    """Packed for few-row products (as the drafts pack it), the head's cached block runs as
    ``models.fused_decode``'s one native call on CPU, and gives the modules' features and
    cache: a draft step's block costs what a target layer's decode step does."""
    from decoding.packing import packed_model, packed_weights
    from models import fused_decode

    # Every projection at least DECODE_MIN_WEIGHTS weights, so packing takes them all.
    config = TransformerConfig(
        vocab_size=512, dim=320, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
        mlp_dim=256, dtype=dtype,
    )  # fmt: skip
    target = Transformer(config, rngs=nnx.Rngs(0))
    head = _head(target)
    packed = packed_model(*nnx.split(head), packed_weights(head))
    rng = np.random.default_rng(1)
    cache = head.cache(2, 32)
    for T in (1, 4):
        h = jnp.asarray(rng.normal(size=(2, T, head.config.dim)), dtype)
        e = jnp.asarray(rng.normal(size=(2, T, head.config.dim)), dtype)
        lengths = jnp.asarray([3, 7], jnp.int32)
        pos = lengths[:, None] + jnp.arange(T)
        kv = (cache.k[0], cache.v[0], lengths, None)
        assert fused_decode.applies(packed.block, h, kv) == fused_decode.enabled()
        assert not fused_decode.applies(head.block, h, kv)  # unpacked: the modules
        step = jax.jit(lambda h, e, pos, kv: packed.features(h, e, pos, kv=kv))
        hlo = step.lower(h, e, pos, kv).as_text()
        assert ("pallas_attn_decode_layer" in hlo) == fused_decode.enabled()
        f, (k, v) = step(h, e, pos, kv)
        f0, (k0, v0) = head.features(h, e, pos, kv=kv)
        for got, want in ((f, f0), (k, k0), (v, v0)):
            np.testing.assert_allclose(
                np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol, rtol=tol
            )


def test_save_load_round_trips_and_refuses_what_does_not_fit(tmp_path):
    target = _tiny()
    head = _head(target, vocab=list(range(0, 264, 2)))
    save_eagle(head, str(tmp_path / "h"))
    back = load_eagle(str(tmp_path / "h"), target.config)
    h = jax.random.normal(jax.random.key(0), (1, 4, target.config.dim))
    e = jax.random.normal(jax.random.key(1), (1, 4, target.config.dim))
    pos = jnp.arange(4)[None]
    want = head.logits(head.features(h, e, pos)[0])
    np.testing.assert_allclose(back.logits(back.features(h, e, pos)[0]), want, atol=1e-6)
    assert np.isneginf(np.asarray(want)[..., 1::2]).all()  # outside the draft vocabulary
    other = _tiny(dim=32, mlp_dim=64).config
    with pytest.raises(ValueError, match="dim"):
        load_eagle(str(tmp_path / "h"), other)
    with pytest.raises(ValueError, match="dim"):
        head.check_target(other)
    import safetensors.numpy

    tensors = safetensors.numpy.load_file(str(tmp_path / "h" / "model.safetensors"))
    del tensors["fc.kernel"]
    safetensors.numpy.save_file(tensors, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensors \\[fc.kernel\\]"):
        load_eagle(str(tmp_path / "h"), target.config)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"medusa_num_heads": 2}')
    with pytest.raises(ValueError, match="no EAGLE head"):
        load_eagle(str(tmp_path / "m"), target.config)


@pytest.mark.parametrize(
    "vocab, error", [([], ValueError), ([1, 1], ValueError), ([999], ValueError), ("ab", TypeError)]
)
def test_bad_vocab(vocab, error):
    with pytest.raises(error, match="vocab"):
        EagleHead(_tiny().config, vocab=vocab, rngs=nnx.Rngs(0))


def test_training_lowers_the_loss_and_raises_acceptance():
    """Two unrolled passes on the tiny target's own greedy answers: the loss falls (its floor
    is the target's entropy, so by a margin, not a ratio) and the trained draft's first token
    agrees with the answers more often than the untrained one's."""
    from decoding import generate
    from models.eagle_train import chain_acceptance, train_eagle
    from models.train_step import TrainConfig

    target = _tiny()
    rng = np.random.default_rng(0)
    prompts = [[int(x) for x in rng.integers(1, 264, 4)] for _ in range(8)]
    out = generate(target, prompts, max_new_tokens=20).tokens
    seqs = [p + o for p, o in zip(prompts, out, strict=True)]
    feats = sequence_features(target, seqs, log=lambda s: None)
    tc = TrainConfig(steps=30, batch=4, lr=3e-3, warmup=2, eval_every=30, seed=0)
    untrained = _head(target, seed=0)

    def first_token(head):
        return np.mean(
            np.concatenate(
                [
                    chain_acceptance(head, target, s, f, 4, 1)
                    for s, f in zip(seqs, feats, strict=True)
                ]
            )
        )

    head, summary = train_eagle(
        target,
        seqs,
        [4] * 8,
        feats,
        tc,
        heldout=None,
        draft_vocab=264,
        feature_weight=1.0,
        noise=0.0,
        depth=2,
        log=lambda s: None,
    )
    assert summary["history"][-1]["train_loss"] < summary["first_loss"] - 0.2
    assert first_token(head) > first_token(untrained) + 0.1


@pytest.mark.parametrize(
    "flag, value",
    [("--noise", "-1"), ("--lr", "0"), ("--heldout", "1"), ("--depth", "0"), ("--steps", "x")],
)
def test_cli_usage_errors_exit_2_before_any_work(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "o"), flag, value])
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_repeated_model_seed_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "o"), "--model-seeds", "1", "2", "1"])
    assert e.value.code == 2
    assert "--model-seeds 1 2 1" in capsys.readouterr().err


def test_model_written_prompts_are_distinct_finished_user_messages(smollm2_gguf):
    """Magpie on the real chat model: the template up to a user's text, continued at T = 1,
    gives distinct messages of at least 3 words, each ended by the model (none cut), and the
    same seed gives the same messages."""
    from models import load_gguf, load_tokenizer
    from models.eagle_train import model_prompts

    target, tok = load_gguf(smollm2_gguf), load_tokenizer(smollm2_gguf)
    msgs = model_prompts(target, tok, 4, seed=3, batch=8, log=lambda s: None)
    assert len(msgs) == 4 and len(set(msgs)) == 4
    assert all(len(m.split()) >= 3 and "<|im_start|>" not in m for m in msgs)
    assert model_prompts(target, tok, 4, seed=3, batch=8, log=lambda s: None) == msgs
    # Another source's prompts (chat-formatted ids) are skipped, the rest come in order.
    seen = {tuple(tok.apply_chat_template([{"role": "user", "content": msgs[0]}]))}
    again = model_prompts(target, tok, 3, seed=3, batch=8, exclude=seen, log=lambda s: None)
    assert again == msgs[1:]
