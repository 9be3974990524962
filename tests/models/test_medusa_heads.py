"""Medusa heads: offsets of the labels, initialisation from the target, save/load, training
(steps lower the loss; the CLI writes loadable heads and per-head accuracy), the shipped heads."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_utils import TINY_TRAINING_ARGS

from models import MedusaHeads, Transformer, TransformerConfig, data, pretrained, train
from models.medusa import load_medusa, save_medusa
from models.medusa_train import head_accuracy, head_labels, train_medusa
from models.pretrained import shipped_path


def _tiny(seed=0, **overrides):
    config = TransformerConfig.preset("tiny", attn_impl="xla", **overrides)
    return Transformer(config, rngs=nnx.Rngs(seed))


def test_head_labels_are_two_plus_i_ahead_within_a_document():
    inputs = np.array([[10, 11, 12, 13, 14, 15]])
    targets = np.array([[11, 12, 13, 14, 15, 16]])
    weights = np.array([[1, 1, 1, 0, 1, 1]], np.float32)  # 14 starts a new document
    labels, w = head_labels(targets, weights, 2)
    assert labels[0, :4, 0].tolist() == [12, 13, 14, 15]  # head 0 at t: x_{t+2}
    assert labels[0, :3, 1].tolist() == [13, 14, 15]  # head 1 at t: x_{t+3}
    assert w[0, :, 0].tolist() == [1, 1, 0, 0, 1, 0]  # x_t .. x_{t+2} in one document
    assert w[0, :, 1].tolist() == [1, 0, 0, 0, 0, 0]
    assert inputs.shape == labels.shape[:2]


def test_init_from_copies_the_targets_lm_head_and_save_load_round_trips(tmp_path):
    for tie in (True, False):
        target = _tiny(tie_embeddings=tie)
        heads = MedusaHeads(target.config, 3, shared_head=False, rngs=nnx.Rngs(1))
        heads.init_from(target)
        logits, h = target(jnp.asarray([[1, 2, 3]]), return_hidden=True)
        out = heads(h)
        assert out.shape == (1, 3, 3, target.config.vocab_size)
        np.testing.assert_allclose(out[:, :, 2], logits, atol=1e-5)  # residual starts at 0
    save_medusa(heads, str(tmp_path))
    again = load_medusa(str(tmp_path), target.config)
    assert not again.shared_head
    np.testing.assert_array_equal(again(h), out)
    with pytest.raises(ValueError, match="dim"):
        load_medusa(str(tmp_path), target.config.replace(dim=32))


def _randomize(heads, seed=0):
    for i, head in enumerate(heads.heads):
        k = jax.random.split(jax.random.key(seed + i))
        head.res.kernel.set_value(0.3 * jax.random.normal(k[0], head.res.kernel.shape))
        head.res.bias.set_value(0.3 * jax.random.normal(k[1], head.res.bias.shape))
    return heads


@pytest.mark.parametrize("tie", [True, False])
def test_shared_head_logits_are_the_targets_head_on_the_residual_output(tie):
    target = _tiny(tie_embeddings=tie)
    heads = _randomize(MedusaHeads(target.config, 3, shared_head=True, rngs=nnx.Rngs(0)))
    d = target.config.dim
    # a head is only its residual layer: no [dim, V] matrix of its own
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(heads, nnx.Param)))
    assert n_params == 3 * (d * d + d)
    _, h = target(jnp.asarray([[1, 2, 3, 4]]), return_hidden=True)
    out = heads(h, target=target)
    assert out.shape == (1, 4, 3, target.config.vocab_size)
    for i, head in enumerate(heads.heads):
        r = h + jax.nn.silu(h @ head.res.kernel[...] + head.res.bias[...])
        np.testing.assert_allclose(out[:, :, i], target.logits(r), rtol=1e-5, atol=1e-5)
    assert not np.allclose(out[:, :, 0], out[:, :, 1])  # the heads differ
    np.testing.assert_array_equal(heads(h, num=2, target=target), out[:, :, :2])
    with pytest.raises(ValueError, match="target="):
        heads(h)
    with pytest.raises(ValueError, match="num_layers"):
        heads(h, target=_tiny(tie_embeddings=tie, num_layers=1))


@pytest.mark.parametrize("tie", [True, False])
def test_draft_vocabulary_logits_are_the_shared_heads_on_its_tokens_only(tie, tmp_path):
    target = _tiny(tie_embeddings=tie)
    full = _randomize(MedusaHeads(target.config, 3, shared_head=True, rngs=nnx.Rngs(0)))
    vocab = [200, 3, 17, 42, 5]  # any order: kept sorted
    heads = MedusaHeads(target.config, 3, shared_head=True, vocab=vocab, rngs=nnx.Rngs(0))
    assert heads.vocab[...].tolist() == sorted(vocab)
    heads.init_from(target)
    nnx.update(heads.heads, nnx.state(full.heads))
    _, h = target(jnp.asarray([[1, 2, 3, 4]]), return_hidden=True)
    want = full(h, target=target)
    out = heads(h)  # the vocabulary's rows are the heads' own copy: no target needed
    assert out.shape == want.shape
    ids = np.asarray(sorted(vocab))
    np.testing.assert_allclose(out[..., ids], want[..., ids], rtol=1e-5, atol=1e-5)
    rest = np.setdiff1d(np.arange(target.config.vocab_size), ids)
    assert np.all(np.isneginf(np.asarray(out[..., rest])))
    assert set(np.asarray(jnp.argmax(out, -1)).ravel()) <= set(vocab)
    np.testing.assert_array_equal(heads(h, target=target), out)
    save_medusa(heads, str(tmp_path / "v"), dtype="float16")
    again = load_medusa(str(tmp_path / "v"), target.config)
    assert again.vocab[...].tolist() == sorted(vocab)
    np.testing.assert_allclose(again(h)[..., ids], out[..., ids], atol=2e-2)


@pytest.mark.parametrize(
    "vocab, err, needle",
    [
        ([], ValueError, "non-empty"),
        ([[1, 2]], ValueError, "1-D"),
        ([1, 1, 2], ValueError, "repeated"),
        ([0, 264], ValueError, r"\[0, 264\)"),
        ([-1], ValueError, r"\[0, 264\)"),
        ([1.5], TypeError, "integer"),
        ("abc", TypeError, "vocab"),
        (7, TypeError, "vocab"),
    ],
)
def test_bad_draft_vocabulary(vocab, err, needle):
    config = _tiny().config
    with pytest.raises(err, match=needle):
        MedusaHeads(config, 2, shared_head=True, vocab=vocab, rngs=nnx.Rngs(0))


def test_draft_vocabulary_needs_a_shared_head_and_a_checkpoint_that_holds_it(tmp_path):
    import safetensors.numpy

    target = _tiny()
    with pytest.raises(ValueError, match="shared_head"):
        MedusaHeads(target.config, 2, shared_head=False, vocab=[1, 2], rngs=nnx.Rngs(0))
    heads = MedusaHeads(target.config, 2, shared_head=True, vocab=[1, 2], rngs=nnx.Rngs(0))
    save_medusa(heads.init_from(target), str(tmp_path))
    path = tmp_path / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(path))
    tensors["vocab"] = np.array([1, 1], np.int32)
    safetensors.numpy.save_file(tensors, str(path))
    with pytest.raises(ValueError, match="repeated"):
        load_medusa(str(tmp_path), target.config)
    tensors["vocab"] = np.array([1, 2, 3], np.int32)  # 3 ids, a 2-row head
    safetensors.numpy.save_file(tensors, str(path))
    with pytest.raises(ValueError, match="vocab_head.kernel has shape"):
        load_medusa(str(tmp_path), target.config)


def test_shared_head_is_the_default_for_a_tied_target_only():
    assert MedusaHeads(_tiny(tie_embeddings=True).config, 2, rngs=nnx.Rngs(0)).shared_head
    assert not MedusaHeads(_tiny(tie_embeddings=False).config, 2, rngs=nnx.Rngs(0)).shared_head
    with pytest.raises(TypeError, match="shared_head"):
        MedusaHeads(_tiny().config, 2, shared_head="yes", rngs=nnx.Rngs(0))


def test_shared_checkpoint_round_trip_and_mismatches(tmp_path):
    import safetensors.numpy

    target = _tiny()
    heads = _randomize(MedusaHeads(target.config, 2, rngs=nnx.Rngs(0)))
    save_medusa(heads, str(tmp_path / "h"), extra=dict(base_model="tiny"))
    meta = json.loads((tmp_path / "h" / "config.json").read_text())
    assert meta["shared_head"] and meta["base_model"] == "tiny"
    tensors = safetensors.numpy.load_file(str(tmp_path / "h" / "model.safetensors"))
    assert sorted(tensors) == [f"heads.{i}.res.{n}" for i in range(2) for n in ("bias", "kernel")]
    again = load_medusa(str(tmp_path / "h"), target.config)
    assert again.shared_head and again.num_heads == 2
    _, h = target(jnp.asarray([[5, 6, 7]]), return_hidden=True)
    np.testing.assert_array_equal(again(h, target=target), heads(h, target=target))
    save_medusa(heads, str(tmp_path / "half"), dtype="float16")  # shipping size
    half = load_medusa(str(tmp_path / "half"), target.config)
    np.testing.assert_allclose(half(h, target=target), heads(h, target=target), atol=2e-2)
    with pytest.raises(ValueError, match="dtype"):
        save_medusa(heads, str(tmp_path / "bad"), dtype="int8")
    for field, value in (("num_layers", 3), ("vocab_size", 300), ("mlp_dim", 64)):
        with pytest.raises(ValueError, match=f"{field}={value}"):
            load_medusa(str(tmp_path / "h"), target.config.replace(**{field: value}))

    def rewrite(name, change):
        bad = dict(tensors)
        change(bad)
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(meta))
        safetensors.numpy.save_file(bad, str(tmp_path / name / "model.safetensors"))
        return str(tmp_path / name)

    path = rewrite("missing", lambda t: t.pop("heads.1.res.bias"))
    with pytest.raises(ValueError, match=r"missing tensors \[heads.1.res.bias\]"):
        load_medusa(path, target.config)
    extra = np.zeros((64, 264), np.float32)
    path = rewrite("unexpected", lambda t: t.update({"heads.0.lm_head.kernel": extra}))
    with pytest.raises(ValueError, match=r"unexpected \[heads.0.lm_head.kernel\]"):
        load_medusa(path, target.config)
    path = rewrite("shape", lambda t: t.update({"heads.0.res.bias": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"heads.0.res.bias has shape \(3,\)"):
        load_medusa(path, target.config)


def test_training_improves_head_accuracy():
    target = _tiny(num_layers=1)
    stream = np.tile(np.arange(40, dtype=np.uint16), 100)  # periodic: heads can learn it
    corpus = data.Corpus(train=stream, heldout=stream[:1000])
    tc = train.TrainConfig(
        steps=30, batch=4, seq_len=32, lr=1e-2, warmup=2, eval_every=30, eval_batches=1
    )
    held = data.heldout_batches(corpus.heldout, 4, 32, 1)
    heads = MedusaHeads(target.config, 2, rngs=nnx.Rngs(0)).init_from(target)
    before = head_accuracy(heads, target, held)
    trained, summary = train_medusa(target, corpus, tc, 2, log=lambda s: None)
    after = head_accuracy(trained, target, held)
    assert summary["heldout_head_top1"] == after
    assert all(a > b + 0.2 for a, b in zip(after, before, strict=True)), (before, after)


@pytest.mark.slow
def test_cli_trains_heads_on_a_checkpoint(tmp_path):
    from models import save_hf_checkpoint

    save_hf_checkpoint(_tiny(num_layers=1), str(tmp_path / "target"))
    out = tmp_path / "heads"
    train.main(
        [
            "--medusa-heads",
            "2",
            "--init",
            str(tmp_path / "target"),
            "--steps",
            "2",
            *TINY_TRAINING_ARGS,
            "--out",
            str(out),
        ]
    )
    summary = json.loads((out / "training.json").read_text())
    assert len(summary["heldout_head_top1"]) == 2
    assert load_medusa(str(out), _tiny(num_layers=1).config).num_heads == 2


def test_shipped_heads_load():
    heads, _ = pretrained("code-target-medusa")
    target, _ = pretrained("code-target", attn_impl="xla")
    assert isinstance(heads, MedusaHeads) and heads.config.dim == target.config.dim
    summary = json.loads((shipped_path("code-target-medusa") / "training.json").read_text())
    assert len(summary["heldout_head_top1"]) == heads.num_heads


def test_root_token_heads_read_the_token_and_round_trip(tmp_path):
    """Heads with ``root_token`` add U e(x_{t+1}) inside the residual: untrained (U = 0) they are
    the plain heads; trained, the root changes their logits; calls without the tokens or the
    target are refused; checkpoints keep the flag and U."""
    target = _tiny()
    plain = _randomize(MedusaHeads(target.config, 2, rngs=nnx.Rngs(0)))
    heads = _randomize(MedusaHeads(target.config, 2, root_token=True, rngs=nnx.Rngs(0)))
    _, h = target(jnp.asarray([[5, 6, 7]]), return_hidden=True)
    tokens = jnp.asarray([[6, 7, 9]])
    np.testing.assert_array_equal(heads(h, target=target, tokens=tokens), plain(h, target=target))
    for i, head in enumerate(heads.heads):
        key = jax.random.key(50 + i)
        head.root.kernel.set_value(0.5 * jax.random.normal(key, head.root.kernel.shape))
    out = heads(h, target=target, tokens=tokens)
    assert not np.allclose(out, heads(h, target=target, tokens=tokens + 1))
    # the same as the residual layer written out with the target's own embedding
    e = target.embed(tokens)
    head = heads.heads[0]
    r = h + jax.nn.silu(h @ head.res.kernel[...] + head.res.bias[...] + e @ head.root.kernel[...])
    np.testing.assert_allclose(out[:, :, 0], target.logits(r), rtol=1e-5, atol=1e-5)
    for kw in (dict(target=target), dict(tokens=tokens)):
        with pytest.raises(ValueError, match="root_token"):
            heads(h, **kw)
    with pytest.raises(TypeError, match="root_token"):
        MedusaHeads(target.config, 2, root_token=1, rngs=nnx.Rngs(0))
    save_medusa(heads, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["root_token"] is True
    again = load_medusa(str(tmp_path), target.config)
    assert again.root_token
    np.testing.assert_array_equal(again(h, target=target, tokens=tokens), out)
