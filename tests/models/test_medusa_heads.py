"""Medusa heads: offsets of the labels, initialisation from the target, save/load, training
(steps lower the loss; the CLI writes loadable heads and per-head accuracy), the shipped heads."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

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
        heads = MedusaHeads(target.config, 3, rngs=nnx.Rngs(1)).init_from(target)
        logits, h = target(jnp.asarray([[1, 2, 3]]), return_hidden=True)
        out = heads(h)
        assert out.shape == (1, 3, 3, target.config.vocab_size)
        np.testing.assert_allclose(out[:, :, 2], logits, atol=1e-5)  # residual starts at 0
    save_medusa(heads, str(tmp_path))
    again = load_medusa(str(tmp_path), target.config)
    np.testing.assert_array_equal(again(h), out)
    with pytest.raises(ValueError, match="dim"):
        load_medusa(str(tmp_path), target.config.replace(dim=32))


def test_training_improves_head_accuracy():
    target = _tiny(num_layers=1)
    stream = np.tile(np.arange(40, dtype=np.uint16), 100)  # periodic: heads can learn it
    corpus = data.Corpus(train=stream, heldout=stream[:1000])
    tc = train.TrainConfig(steps=30, batch=4, seq_len=32, lr=1e-2, warmup=2, eval_every=30,
                           eval_batches=1)  # fmt: skip
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
    train.main([
        "--medusa-heads", "2", "--init", str(tmp_path / "target"), "--steps", "2", "--batch", "2",
        "--seq-len", "32", "--eval-every", "1", "--eval-batches", "1",
        "--max-corpus-bytes", "40000", "--attn-impl", "xla", "--out", str(out),
    ])  # fmt: skip
    summary = json.loads((out / "training.json").read_text())
    assert len(summary["heldout_head_top1"]) == 2
    assert load_medusa(str(out), _tiny(num_layers=1).config).num_heads == 2


def test_shipped_heads_load():
    heads, _ = pretrained("code-target-medusa")
    target, _ = pretrained("code-target", attn_impl="xla")
    assert isinstance(heads, MedusaHeads) and heads.config.dim == target.config.dim
    summary = json.loads((shipped_path("code-target-medusa") /
                          "training.json").read_text())  # fmt: skip
    assert len(summary["heldout_head_top1"]) == heads.num_heads
