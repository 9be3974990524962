"""Distillation (``python -m models.train --distill-from``): the KL loss and its train step;
self-distilled Medusa heads (``models.medusa_train``) end to end on a tiny model."""

import jax
import numpy as np
import pytest
from flax import nnx
from model_utils import TINY_TRAINING_ARGS

from models import MedusaHeads, Transformer, TransformerConfig, data, save_hf_checkpoint, train


def _batch(B=2, T=32, seed=0):
    stream = np.random.default_rng(seed).integers(0, 256, size=4000).astype(np.uint16)
    stream[::37] = 256
    return data.windows(stream, np.array([5, 900][:B]), T)


def _tiny(seed, **overrides):
    config = TransformerConfig.preset("tiny", attn_impl="xla", **overrides)
    return Transformer(config, rngs=nnx.Rngs(seed))


def test_distill_loss_is_zero_for_the_teacher_itself_and_positive_otherwise():
    teacher, student = _tiny(0, num_layers=1), _tiny(1, num_layers=1)
    graphdef, _ = nnx.split(teacher)
    batch = _batch()

    @jax.jit
    def kl(teacher_state, student_state, temperature):
        t_logits = nnx.merge(graphdef, teacher_state)(batch[0], segment_ids=batch[2])
        model = nnx.merge(graphdef, student_state)
        return train.distill_loss_fn(model, t_logits, batch, temperature)

    t_state, s_state = nnx.state(teacher), nnx.state(student)
    assert abs(float(kl(t_state, t_state, 1.0))) < 1e-5
    assert float(kl(t_state, s_state, 2.0)) > 1e-4


def test_distill_steps_move_the_student_towards_the_teacher():
    teacher, student = _tiny(0, num_layers=1), _tiny(1, num_layers=1)
    t_graphdef, t_state = nnx.split(teacher)
    graphdef, params, rest = nnx.split(student, nnx.Param, ...)
    tc = train.TrainConfig(steps=10, lr=1e-2, warmup=1)
    tx = train.optimizer(tc)
    opt_state = tx.init(params)
    step = train.make_train_step(graphdef, tx, teacher_graphdef=t_graphdef)
    batch = _batch()
    losses = []
    for _ in range(tc.steps):
        params, opt_state, loss = step(params, rest, opt_state, batch, t_state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0], losses
    logits = teacher(batch[0], segment_ids=batch[2])
    kl = train.distill_loss_fn(nnx.merge(graphdef, params, rest), logits, batch)
    np.testing.assert_allclose(float(kl), losses[-1], rtol=0.5)
    assert jax.tree.leaves(t_state)  # the teacher's state is only read


@pytest.mark.slow
def test_cli_distill_from_a_checkpoint(tmp_path, capsys):
    args = ["--preset", "tiny", *TINY_TRAINING_ARGS]
    teacher = tmp_path / "teacher"
    train.main([*args, "--steps", "1", "--out", str(teacher)])
    student = tmp_path / "student"
    train.main([*args, "--steps", "2", "--distill-from", str(teacher), "--out", str(student)])
    assert (student / "training.json").exists()
    other_vocab = tmp_path / "other-vocab"
    save_hf_checkpoint(_tiny(0, vocab_size=64), str(other_vocab))
    with pytest.raises(SystemExit) as e:  # a usage error before training, naming the flag
        out = str(tmp_path / "unused")
        train.main([*args, "--steps", "1", "--out", out, "--distill-from", str(other_vocab)])
    assert e.value.code == 2 and "--distill-from" in capsys.readouterr().err
    assert not (tmp_path / "unused").exists()


class _ChatTokens:
    """A stand-in for a chat tokenizer: the message's bytes as ids, no special tokens."""

    eos_id = None

    def apply_chat_template(self, messages):
        return [b % 250 for b in messages[-1]["content"].encode()][:12]


def test_self_distilled_shared_heads_end_to_end_lower_the_loss():
    from models.medusa_train import (
        distill_prompts,
        hidden_accuracy,
        hidden_dataset,
        self_distill_data,
        train_shared_heads,
    )

    target = _tiny(0, num_layers=1)
    graphdef, params = nnx.split(target)  # larger weights: varied continuations, not one token
    params = jax.tree.map(lambda x: x * 8 if x.ndim == 2 else x, params)
    target = nnx.merge(graphdef, params)
    messages = distill_prompts(4, seed=1)
    assert messages == distill_prompts(4, seed=1) and len(set(messages)) == 4
    pairs = self_distill_data(
        target,
        _ChatTokens(),
        messages,
        max_new_tokens=20,
        temperatures=(0.0, 1.0),
        batch=4,
        log=lambda s: None,
    )
    assert len(pairs) == 8 and all(len(c) == 20 for _, c in pairs)
    assert pairs[0][1] != pairs[4][1]  # the sampled continuation differs from the greedy one
    h, labels = hidden_dataset(target, pairs, 2, batch=8, bucket=16)
    assert h.shape == (8 * 21, target.config.dim) and labels.shape == (8 * 21, 2)
    c = pairs[0][1]
    assert labels[0].tolist() == [c[1], c[2]]  # at the prompt's last token: x_{t+2}, x_{t+3}
    assert labels[20].tolist() == [-1, -1]  # the last continuation token has no label
    fresh = MedusaHeads(target.config, 2, shared_head=True, rngs=nnx.Rngs(0))
    before = hidden_accuracy(fresh, target, h, labels, chunk=len(h))
    tc = train.TrainConfig(steps=60, batch=64, lr=1e-2, warmup=2, eval_every=60)
    heads, summary = train_shared_heads(target, h, labels, 2, tc, log=lambda s: None)
    assert heads.shared_head and summary["vocab_rows"] < target.config.vocab_size
    # the heads draft from the data's tokens: the rows the softmax was trained over
    assert heads.vocab[...].tolist() == np.unique(labels[labels >= 0]).tolist()
    assert summary["vocab_rows"] == heads.vocab[...].size
    assert summary["history"][-1]["train_loss"] < 0.5 * summary["first_loss"], summary
    after = hidden_accuracy(heads, target, h, labels, chunk=len(h))
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    # soft labels: the target's own distribution at t + 1 + i
    tc = train.TrainConfig(steps=30, batch=64, lr=1e-2, warmup=2, eval_every=30)
    soft_heads, soft = train_shared_heads(target, h, labels, 2, tc, soft=True, log=lambda s: None)
    assert soft["soft_labels"]
    # the cross entropy to a distribution has the target's entropy as its floor
    assert soft["history"][-1]["train_loss"] < soft["first_loss"] - 0.3, soft
    assert soft_heads.shared_head


def test_root_token_heads_learn_what_the_sampled_token_decides():
    """On sampled continuations x_{t+1} is a draw the hidden state h_t cannot know, and the
    target's x_{t+2} depends on it: heads that read the root token (``--root-token``) reach a
    higher first-head accuracy than plain heads trained the same way."""
    from models.medusa_train import (
        distill_prompts,
        hidden_accuracy,
        hidden_dataset,
        root_tokens,
        self_distill_data,
        train_shared_heads,
    )

    target = _tiny(0, num_layers=1)
    graphdef, params = nnx.split(target)
    params = jax.tree.map(lambda x: x * 8 if x.ndim == 2 else x, params)
    target = nnx.merge(graphdef, params)
    pairs = self_distill_data(
        target,
        _ChatTokens(),
        distill_prompts(8, seed=2),
        max_new_tokens=24,
        temperatures=(1.5,),
        batch=8,
        log=lambda s: None,
    )
    h, labels = hidden_dataset(target, pairs, 2, batch=8, bucket=16)
    roots = root_tokens(pairs)
    assert roots.shape == (len(h),)
    s = list(pairs[0][0]) + list(pairs[0][1])
    p = len(pairs[0][0])
    assert roots[:3].tolist() == s[p : p + 3] and roots[24] == 0  # x_{t+1}; the last row: 0
    tc = train.TrainConfig(steps=80, batch=64, lr=1e-2, warmup=2, eval_every=80)
    quiet = lambda s: None  # noqa: E731
    plain, _ = train_shared_heads(target, h, labels, 2, tc, vocab="full", log=quiet)
    rooted, summary = train_shared_heads(
        target, h, labels, 2, tc, vocab="full", roots=roots, log=quiet
    )
    assert rooted.root_token and summary["root_token"]
    a_plain = hidden_accuracy(plain, target, h, labels, chunk=len(h))
    a_root = hidden_accuracy(rooted, target, h, labels, roots, chunk=len(h))
    assert a_root[0] > a_plain[0] + 0.1, (a_plain, a_root)


def test_cli_root_token_heads_from_generated_then_cached_data(tmp_path, monkeypatch):
    """``python -m models.medusa_train --root-token`` on a stand-in target: the first run
    generates and caches the data (with the continuations' tokens), the second reads the cache;
    both save heads that read the root token, and a cache without the tokens is remade."""
    import json

    from models import medusa_train
    from models.medusa import load_medusa

    target = _tiny(0, num_layers=1)
    tokens = _ChatTokens()
    tokens.chat_template = "stand-in"
    monkeypatch.setattr(medusa_train, "pretrained", lambda name: (target, tokens))
    monkeypatch.setattr(medusa_train, "cache_dir", lambda key: str(tmp_path / "cache"))
    argv = ["--target", "code-target", "--prompts", "10", "--gen-batch", "10"]  # 1 held out
    argv += ["--max-new-tokens", "8", "--steps", "4", "--batch", "16", "--root-token"]
    logs = []
    monkeypatch.setattr("builtins.print", lambda *a, **k: logs.append(" ".join(map(str, a))))
    for run in ("generated", "cached", "remade"):
        if run == "remade":
            (tmp_path / "cache" / "pairs.json").unlink()  # a cache from before the tokens
        logs.clear()
        out = str(tmp_path / run)
        assert medusa_train.main([*argv, "--out", out]) == 0
        assert any("from the cache" in line for line in logs) == (run == "cached"), logs
        heads = load_medusa(out, target.config)
        assert heads.root_token
        summary = json.loads((tmp_path / run / "training.json").read_text())
        assert summary["root_token"] and "--root-token" in summary["command"]
        assert len(summary["heldout_head_top1"]) == 4  # scored with the held-out rows' roots
    assert (tmp_path / "cache" / "pairs.json").exists()
