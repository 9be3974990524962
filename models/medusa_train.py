"""Training Medusa heads on a frozen target's hidden states (``python -m models.train
--medusa-heads N --init code-target --steps S --out DIR``).

The target runs on the same packed stdlib windows as ``models.train`` (``models.data``); head i's
label at position t is x_{t+2+i} (see ``models.medusa``), weighted only while the whole span
t .. t+2+i stays inside one document. The loss is the mean over heads of each head's cross
entropy; only the heads are trained (AdamW + warmup/cosine from ``models.train.optimizer``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models import data
from models.hf import load_hf_checkpoint
from models.medusa import MedusaHeads, save_medusa


def head_labels(targets, weights, num_heads: int):
    """(labels [B, T, N] int32, weights [B, T, N] float32) for the heads from a
    ``data.windows`` batch: ``labels[:, t, i] = targets[:, t + 1 + i]`` (= x_{t+2+i}); weight 0
    past the window or across a document boundary."""
    B, T = targets.shape
    pad = np.zeros((B, num_heads + 1), np.float32)
    w = np.concatenate([np.asarray(weights, np.float32), pad], axis=1)
    tg = np.concatenate([np.asarray(targets), pad.astype(np.int32)], axis=1)
    labels, ws = [], []
    for i in range(num_heads):
        labels.append(tg[:, 1 + i : 1 + i + T])
        span = np.prod(np.stack([w[:, j : j + T] for j in range(i + 2)]), axis=0)
        ws.append(span)
    return np.stack(labels, -1).astype(np.int32), np.stack(ws, -1).astype(np.float32)


def _hidden(target_graphdef, target_state, inputs, segment_ids):
    target = nnx.merge(target_graphdef, target_state)
    _, h = target(inputs, segment_ids=segment_ids, return_hidden=True)
    return jax.lax.stop_gradient(h)


def make_medusa_step(graphdef, target_graphdef, tx):
    """``step(params, opt_state, target_state, inputs, segment_ids, labels, weights) ->
    (params, opt_state, loss)``, jitted: the mean over heads of their weighted cross entropy."""

    def step(params, opt_state, target_state, inputs, segment_ids, labels, weights):
        h = _hidden(target_graphdef, target_state, inputs, segment_ids)

        def f(p):
            logits = nnx.merge(graphdef, p)(h)  # [B, T, N, V]
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
            per_head = jnp.sum(ce * weights, (0, 1)) / jnp.maximum(jnp.sum(weights, (0, 1)), 1)
            return jnp.mean(per_head)

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def head_accuracy(heads: MedusaHeads, target, batches) -> list[float]:
    """Per-head top-1 accuracy [N] of ``heads`` on ``target``'s hidden states over
    ``data.windows`` batches (weighted as in training)."""
    graphdef, state = nnx.split(heads)
    t_graphdef, t_state = nnx.split(target)

    @jax.jit
    def counts(state, t_state, inputs, segment_ids, labels, weights):
        h = _hidden(t_graphdef, t_state, inputs, segment_ids)
        hit = jnp.argmax(nnx.merge(graphdef, state)(h), -1) == labels
        return jnp.sum(hit * weights, (0, 1)), jnp.sum(weights, (0, 1))

    right = np.zeros(heads.num_heads)
    total = np.zeros(heads.num_heads)
    for inputs, targets, seg, w in batches:
        labels, lw = head_labels(targets, w, heads.num_heads)
        r, t = counts(state, t_state, inputs, seg, labels, lw)
        right, total = right + np.asarray(r), total + np.asarray(t)
    return [float(x) for x in right / np.maximum(total, 1)]


def train_medusa(target, corpus: data.Corpus, tc, num_heads: int, *, log=print):
    """Trains ``num_heads`` heads (initialised from ``target``'s LM head) on the frozen
    ``target``; ``tc`` is a ``models.train.TrainConfig``. Returns (heads, summary dict)."""
    from models.train import optimizer

    heads = MedusaHeads(target.config, num_heads, rngs=nnx.Rngs(tc.seed)).init_from(target)
    graphdef, params = nnx.split(heads)
    t_graphdef, t_state = nnx.split(target)
    tx = optimizer(dataclasses.replace(tc, weight_decay=0.0))
    opt_state = tx.init(params)
    step_fn = make_medusa_step(graphdef, t_graphdef, tx)
    rng = np.random.default_rng(tc.seed)
    held = data.heldout_batches(corpus.heldout, tc.batch, tc.seq_len, tc.eval_batches)
    history, start = [], time.perf_counter()
    for i in range(1, tc.steps + 1):
        inputs, targets, seg, w = data.random_batch(corpus.train, rng, tc.batch, tc.seq_len)
        labels, lw = head_labels(targets, w, num_heads)
        params, opt_state, loss = step_fn(params, opt_state, t_state, inputs, seg, labels, lw)
        if i % tc.eval_every == 0 or i == tc.steps:
            nnx.update(heads, params)
            acc = head_accuracy(heads, target, held)
            elapsed = time.perf_counter() - start
            history.append(dict(step=i, train_loss=float(loss), head_top1=acc, seconds=elapsed))
            accs = " ".join(f"{a:.3f}" for a in acc)
            log(
                f"step {i}: loss {float(loss):.4f}, held-out top-1 per head [{accs}], {elapsed:.0f}s"
            )
    nnx.update(heads, params)
    summary = dict(
        num_heads=num_heads,
        tokens_seen=tc.steps * tc.batch * tc.seq_len,
        wall_seconds=round(time.perf_counter() - start, 1),
        heldout_head_top1=history[-1]["head_top1"] if history else None,
        history=history,
        train_config=dataclasses.asdict(tc),
    )
    return heads, summary


def main_medusa(args, tc, argv=None) -> None:
    """``models.train``'s ``--medusa-heads`` mode: trains, saves with :func:`save_medusa` and
    writes ``training.json`` (per-head held-out top-1 accuracy included)."""
    from models.pretrained import SHIPPED, shipped_path

    if args.init is None:
        raise ValueError("--medusa-heads needs --init (the frozen target: shipped name or path)")
    if args.medusa_heads < 1:
        raise ValueError(f"--medusa-heads must be >= 1, got {args.medusa_heads}")
    path = str(shipped_path(args.init)) if args.init in SHIPPED else args.init
    target = load_hf_checkpoint(path, attn_impl=args.attn_impl)
    corpus = data.Corpus.from_stdlib(max_bytes=args.max_corpus_bytes)
    print(
        f"{args.medusa_heads} Medusa heads on {args.init}; corpus {corpus.train.size:,} train / "
        f"{corpus.heldout.size:,} held-out tokens; {jax.devices()[0].platform}",
        flush=True,
    )
    heads, summary = train_medusa(
        target, corpus, tc, args.medusa_heads, log=lambda s: print(s, flush=True)
    )
    command = " ".join(["python -m models.train", *(sys.argv[1:] if argv is None else argv)])
    summary.update(command=command, init=args.init)
    save_medusa(heads, args.out, extra=dict(base_model=args.init))
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    accs = ", ".join(f"{a:.3f}" for a in summary["heldout_head_top1"])
    print(f"saved {args.out}: held-out top-1 per head [{accs}]", flush=True)
