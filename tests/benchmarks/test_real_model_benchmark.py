"""benchmarks/real_model.py: its rows, goals, the held-out perplexity, and the llama.cpp B = 8
worker (slow; needs .venv-bench)."""

from __future__ import annotations

import json
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from benchmarks import real_model
from models import Transformer, TransformerConfig


def _args(*argv):
    p = real_model.common.parser(real_model.__doc__)
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--only", default="")
    return p.parse_args(list(argv))


def test_jobs_have_the_llama_cpp_batch_peers():
    jobs = real_model._jobs(_args("--no-hf"))
    for q in real_model.QUANT:
        assert ("ours", q, real_model.BATCH) in jobs
        assert ("llama.cpp", q.upper(), real_model.BATCH) in jobs
    assert not [j for j in real_model._jobs(_args("--quick", "--no-hf")) if j[2] > 1]
    only = real_model._jobs(_args("--only", "llama.cpp:Q4_0:8"))
    assert only == [("ours", "float32", 1), ("llama.cpp", "Q4_0", 8)]
    with pytest.raises(ValueError, match="unknown rows"):
        real_model._jobs(_args("--only", "llama.cpp:F16:8"))


def test_goals_pair_rows_at_their_batch():
    rows = [
        dict(system="ours", weights="q8_0", batch=1, decode_tok_s=120.0),
        dict(system="llama.cpp", weights="Q8_0", batch=1, decode_tok_s=100.0),
        dict(system="ours", weights="q8_0", batch=8, decode_tok_s=300.0),
        dict(system="llama.cpp", weights="Q8_0", batch=8, decode_tok_s=200.0),
    ]
    got = {(g["ours"], g["batch"]): g for g in real_model.goals(rows)}
    assert got[("ours q8_0", 1)]["ratio"] == pytest.approx(1.2) and got[("ours q8_0", 1)]["met"]
    assert got[("ours q8_0", 8)]["ratio"] == pytest.approx(1.5)
    assert not got[("ours q8_0", 8)]["met"]  # the B = 8 goal is 2x


def _tiny():
    config = TransformerConfig(
        vocab_size=128, dim=64, num_layers=1, num_heads=4, num_kv_heads=2, mlp_dim=128
    )
    m = Transformer(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(m)
    keys = iter(jax.random.split(jax.random.key(3), 64))
    params = jax.tree.map(lambda p: 0.3 * jax.random.normal(next(keys), p.shape, p.dtype), params)
    return nnx.merge(graphdef, params)


def test_perplexity_is_the_exp_mean_nll_of_its_windows():
    model = _tiny()
    ids = list(np.random.default_rng(0).integers(0, 128, 50))
    got = real_model.perplexity(model, ids, window=16)  # 3 windows, the last 2 tokens dropped
    graphdef, state = nnx.split(model)
    windows = jnp.asarray(ids[:48]).reshape(3, 16)
    logits = jax.jit(lambda s, w: nnx.merge(graphdef, s)(w))(state, windows)
    logp = np.asarray(jax.nn.log_softmax(logits[:, :-1], axis=-1))
    nll = -np.take_along_axis(logp, np.asarray(windows[:, 1:, None]), -1)[..., 0]  # [3, 15]
    assert got == pytest.approx(float(np.exp(nll.mean())), rel=1e-5)
    with pytest.raises(ValueError, match="at least 16 tokens"):
        real_model.perplexity(model, ids[:10], window=16)


@pytest.mark.slow
@pytest.mark.skipif(
    not (real_model.BENCH_VENV / "bin" / "python").exists(), reason="no .venv-bench"
)
def test_llama_cpp_batch_worker_decodes_every_sequence_as_one(smollm2_gguf):
    """Two sequences of the same prompt in one context decode llama.cpp's B = 1 tokens."""
    req = dict(
        path=str(smollm2_gguf),
        prompt=[1, 4093, 198, 20997, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
        new_tokens=6,
        runs=1,
        warmup=0,
        threads=1,
    )
    out = {}
    for batch, worker in (
        (1, real_model._LLAMA_CPP_WORKER),
        (2, real_model._LLAMA_CPP_BATCH_WORKER),
    ):
        res = subprocess.run(
            [
                str(real_model.BENCH_VENV / "bin" / "python"),
                "-c",
                worker,
                json.dumps({**req, "batch": batch}),
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        out[batch] = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(out[1]["tokens"]) == 6 and out[2]["decode_s"] > 0
    assert out[2]["rows"] == [out[1]["tokens"]] * 2
