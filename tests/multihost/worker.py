"""One process of the two-process tests (``tests/multihost/test_multihost.py``), started by
``python -m decoding.launch ... --local-devices 2 -- tests/multihost/worker.py MODE DIR``.

Each process does the work on meshes over all 4 devices of both processes and writes
its results under DIR (``main``); the test compares them with :func:`references`. Modes:
``core`` (the CI test), ``extra`` (the slow test), ``die`` (process 1 exits at once; process 0
waits in a collective, which must fail).
"""

from __future__ import annotations

import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

import decoding
import models
from decoding.distributed import DistributedEngine
from models import Transformer, TransformerConfig, data, train
from models.sharding import mesh_of, to_host

# Hkv = 4 and mlp_dim, V multiples of 4: every mesh of the 4 devices divides them.
CONFIG = TransformerConfig.preset(
    "tiny",
    num_layers=1,
    num_heads=8,
    num_kv_heads=4,
    head_dim=8,
    tie_embeddings=False,
    attn_impl="xla",
)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [3] * 9, [40, 41, 42]]
NEW = 6
# Momentum SGD after clipping: updates linear in the gradients (see tests/models/test_shard.py).
TX = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.5, momentum=0.9))
# The engine's request mix: (prompt, max_new_tokens, sampling, seed, logprobs); request 1 is
# aborted after the first step.
MIX = [
    (PROMPTS[0], 5, None, None, 2),
    (PROMPTS[1], 7, decoding.SamplingConfig(temperature=0.8, top_k=20), 5, 1),
    (PROMPTS[2], 4, None, None, None),
    (PROMPTS[3], 6, decoding.SamplingConfig(temperature=1.0, top_p=0.9), 9, 3),
    (PROMPTS[0][:3], 3, None, None, None),
]
ENGINE = dict(max_batch=2, num_pages=24, page_size=4, max_seq_len=32)


def _model():
    return Transformer(CONFIG, rngs=nnx.Rngs(0))


def _mesh(shape):
    return jax.make_mesh(shape, ("data", "model"))


def _batch():
    stream = np.random.default_rng(0).integers(0, 256, size=2000).astype(np.uint16)
    stream[::29] = 256
    return data.windows(stream, np.arange(4) * 97, 16)


def _train_step(model):
    if mesh_of(model) is None:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return train.make_train_step(graphdef, TX)(params, rest, TX.init(params), _batch())
    step, sh = models.make_sharded_train_step(model, TX)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = jax.jit(TX.init, out_shardings=sh.opt_state)(params)
    return step(params, rest, opt_state, _batch())


def _engine_mix(engine) -> tuple[dict, dict]:
    """-> (tokens, logprob records) of the mix's requests, by request id."""
    rids = [engine.submit(p, n, sampling=s, seed=seed, logprobs=lp) for p, n, s, seed, lp in MIX]
    engine.step()
    engine.abort(rids[1])
    done = engine.run_until_done()
    return {str(k): v for k, v in done.items()}, _records(engine.pop_logprobs())


def _records(popped) -> dict:
    """``Engine.pop_logprobs()`` as JSON: rid -> [[token, logprob, [[id, logprob], ...]]]."""
    return {
        str(rid): [[r.token, r.logprob, [list(t) for t in r.top]] for r in records]
        for rid, records in popped.items()
    }


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def _logits(model, tokens):
    return to_host(_forward(*nnx.split(model), tokens))


def references(mode: str) -> dict:
    """The single-device answers of ``mode`` (the test process computes them on its device)."""
    want = dict(logits=np.asarray(_logits(_model(), _batch()[0])))
    want["tokens"] = decoding.generate(_model(), PROMPTS, max_new_tokens=NEW).tokens
    if mode == "core":
        params, _, loss = jax.device_get(_train_step(_model()))
        want.update(params=jax.tree.leaves(params), loss=np.asarray(loss))
        want["engine"], want["engine_logprobs"] = _engine_mix(decoding.Engine(_model(), **ENGINE))
    return want


def main(mode: str, workdir: str) -> None:
    """Writes ``p{process}.npz`` (arrays) and ``p{process}.json`` (tokens) under ``workdir``."""
    pid = jax.process_index()
    if mode == "die":
        if pid == 1:
            os._exit(3)
        multihost_utils.sync_global_devices("never reached by process 1")
        return
    inputs = _batch()[0]
    arrays, out = {}, dict(process=pid, devices=jax.device_count(), local=jax.local_device_count())
    if mode == "extra":  # the slow test's part: a third mesh, speculation, a checkpoint
        arrays["logits_(4, 1)"] = _logits(models.shard(_model(), _mesh((4, 1))), inputs)
        model = models.shard(_model(), _mesh((2, 2)))
        out["speculative"] = decoding.speculative_generate(
            model, decoding.PromptLookup(), PROMPTS, max_new_tokens=NEW
        ).tokens
        # A checkpoint written once (process 0) and read by every process from the same files.
        path = os.path.join(workdir, "ckpt")
        if pid == 0:
            models.save_hf_checkpoint(_model(), path, dtype=jnp.float32)
        multihost_utils.sync_global_devices("checkpoint written")
        loaded = models.shard(models.load_hf_checkpoint(path, attn_impl="xla"), _mesh((2, 2)))
        arrays["checkpoint_logits"] = _logits(loaded, inputs)
        eng = DistributedEngine(model, draft=decoding.PromptLookup(), num_draft_tokens=2, **ENGINE)
        if eng.is_leader:
            rids = [eng.submit(p, NEW) for p in PROMPTS]
            done = eng.run_until_done()
            out["engine_speculative"] = [done[r] for r in rids]
            eng.shutdown()
        else:
            eng.serve_followers(max_steps=1000)
            done = eng.pop_finished()
            out["engine_speculative"] = [done[r] for r in sorted(done)]
        _save(workdir, pid, arrays, out)
        return
    # "model" over all 4 devices (tensor parallel across the processes); then "data" across
    # the processes and "model" inside each (data + tensor parallel).
    for shape in [(1, 4), (2, 2)]:
        arrays[f"logits_{shape}"] = _logits(models.shard(_model(), _mesh(shape)), inputs)
    model = models.shard(_model(), _mesh((2, 2)))
    out["generate"] = decoding.generate(model, PROMPTS, max_new_tokens=NEW).tokens
    params, _, loss = to_host(_train_step(models.shard(_model(), _mesh((2, 2)))))
    arrays["loss"] = loss
    arrays.update({f"param_{i}": x for i, x in enumerate(jax.tree.leaves(params))})
    eng = DistributedEngine(model, **ENGINE)
    if eng.is_leader:
        out["engine"], out["engine_logprobs"] = _engine_mix(eng)
        eng.shutdown()
    else:
        out["follower_steps"] = eng.serve_followers(max_steps=1000)
        out["engine"] = {str(k): v for k, v in eng.pop_finished().items()}
        out["engine_logprobs"] = _records(eng.pop_logprobs())
    _save(workdir, pid, arrays, out)


def _save(workdir: str, pid: int, arrays: dict, out: dict) -> None:
    np.savez(os.path.join(workdir, f"p{pid}.npz"), **arrays)
    with open(os.path.join(workdir, f"p{pid}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
