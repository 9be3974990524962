import json

import jax
import numpy as np
import pytest
from flax import nnx
from model_utils import TINY_TRAINING_ARGS

from models import Transformer, TransformerConfig, data, train
from models.hf import load_hf_checkpoint


def _batch(B=2, T=32, seed=0):
    tok_stream = np.random.default_rng(seed).integers(0, 256, size=4000).astype(np.uint16)
    tok_stream[::37] = 256  # document starts, so batches are packed with several segments
    return data.windows(tok_stream, np.array([5, 900][:B]), T)


def test_a_few_steps_reduce_the_loss():
    config = TransformerConfig.preset("tiny", attn_impl="xla")
    tc = train.TrainConfig(steps=12, lr=1e-2, warmup=2)
    model = Transformer(config, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = train.optimizer(tc)
    opt_state = tx.init(params)
    step = train.make_train_step(graphdef, tx)
    batch = _batch()
    losses = []
    for _ in range(tc.steps):
        params, opt_state, loss = step(params, rest, opt_state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 1.0, losses


def test_gradients_interpret_equal_reference():
    """One step's gradients through the Pallas kernels (interpreted) equal the reference's."""
    pytest.importorskip("pallas_attn.flash")
    config = TransformerConfig.preset("tiny", num_layers=1, attn_impl="reference")
    model = Transformer(config, rngs=nnx.Rngs(1))
    batch = _batch(B=1, T=24, seed=1)

    def grads(impl):
        m = Transformer(config.replace(attn_impl=impl), rngs=nnx.Rngs(1))
        nnx.update(m, nnx.state(model))
        graphdef, params, rest = nnx.split(m, nnx.Param, ...)

        def f(p):
            return train.loss_fn(nnx.merge(graphdef, p, rest), batch)

        return jax.jit(jax.grad(f))(params)

    ref, interp = grads("reference"), grads("interpret")
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(interp), strict=True):
        np.testing.assert_allclose(b, a, atol=2e-5, rtol=1e-4)


def test_schedule_warms_up_then_decays():
    sched = train.schedule(train.TrainConfig(steps=100, lr=2.0, warmup=10, end_lr_fraction=0.1))
    assert float(sched(0)) == 0.0
    np.testing.assert_allclose(float(sched(5)), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(sched(10)), 2.0, rtol=1e-6)
    np.testing.assert_allclose(float(sched(100)), 0.2, rtol=1e-6)
    mid = float(sched(55))  # halfway through the cosine: (peak + end) / 2
    np.testing.assert_allclose(mid, 1.1, rtol=1e-5)


@pytest.mark.slow
def test_cli_writes_a_loadable_checkpoint_and_resumes_from_it(tmp_path, capsys):
    args = ["--preset", "tiny", *TINY_TRAINING_ARGS]
    out = tmp_path / "ckpt"
    train.main([*args, "--steps", "2", "--out", str(out)])
    summary = json.loads((out / "training.json").read_text())
    assert len(summary["history"]) == 2 and summary["shipped_heldout_bpb"] > 0
    model = load_hf_checkpoint(str(out))
    assert model.config.num_params() == TransformerConfig.preset("tiny").num_params()
    resumed = tmp_path / "resumed"
    train.main([*args, "--steps", "1", "--init", str(out), "--out", str(resumed)])
    summary2 = json.loads((resumed / "training.json").read_text())
    assert summary2["init"] == str(out)
    with pytest.raises(SystemExit) as exit_info:  # a usage error, before the corpus is read
        train.main(
            [
                *args,
                "--preset",
                "code-draft",
                "--steps",
                "1",
                "--init",
                str(out),
                "--out",
                str(tmp_path / "bad"),
            ]
        )
    assert exit_info.value.code == 2 and "does not match" in capsys.readouterr().err


def _no_work(*args, **kwargs):
    raise AssertionError("a bad flag reached the corpus: the check came after work started")


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--steps", "0"], "--steps"),
        (["--steps", "2", "--lr", "nan"], "--lr"),
        (["--steps", "2", "--lr", "0"], "--lr"),
        (["--steps", "2", "--warmup", "-1"], "--warmup"),
        (["--steps", "2", "--end-lr-fraction", "1.5"], "--end-lr-fraction"),
        (["--steps", "2", "--clip-norm", "inf"], "--clip-norm"),
        (["--steps", "2", "--max-corpus-bytes", "0"], "--max-corpus-bytes"),
        (["--steps", "2", "--preset", "no-such-preset"], "--preset"),
        (["--steps", "2", "--attn-impl", "fast"], "--attn-impl"),
        (["--steps", "2", "--out", "{file}/ckpt"], "--out"),
        (["--steps", "2", "--out", "{file}"], "--out"),
        (["--steps", "2", "--mesh", "64,64"], "--mesh"),  # more devices than there are
        (["--steps", "2", "--mesh", "2"], "--mesh"),
    ],
)
def test_cli_bad_flags_exit_2_naming_the_flag_before_any_work(
    flags, named, tmp_path, monkeypatch, capsys
):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setattr(data.Corpus, "from_stdlib", _no_work)
    argv = ["--preset", "tiny", "--out", str(tmp_path / "out")]
    argv += [f.format(file=tmp_path / "file") for f in flags]
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_train_config_refuses_values_no_run_can_use():
    for bad in [dict(steps=0), dict(lr=float("nan")), dict(batch=True), dict(steps=2.0)]:
        with pytest.raises(ValueError, match=next(iter(bad))):
            train.TrainConfig(**bad)
    assert train.TrainConfig(steps=np.int64(3), lr=np.float32(0.5)).steps == 3
