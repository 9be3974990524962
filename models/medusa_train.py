"""Training Medusa heads on a frozen target's hidden states (``python -m models.train
--medusa-heads N --init code-target --steps S --out DIR``).

The target runs on the same packed stdlib windows as ``models.train`` (``models.data``); head i's
label at position t is x_{t+2+i} (see ``models.medusa``), weighted only while the whole span
t .. t+2+i stays inside one document. The loss is the mean over heads of each head's cross
entropy; only the heads are trained (AdamW + warmup/cosine from ``models.train.optimizer``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from decoding.generate import generate
from decoding.sampling import SamplingConfig
from models import data
from models.cli import (
    Interrupted,
    output_dir,
    report_interrupt,
    windows_problem,
    write_summary,
)
from models.hf import load_hf_checkpoint
from models.interrupts import deferred_interrupts
from models.medusa import MedusaHeads, head_rows, save_medusa
from models.pretrained import SHIPPED, model_arg, pretrained, shipped_path
from models.train_step import TrainConfig, optimizer


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
    """(the target, its hidden states [B, T, dim], not differentiated)."""
    target = nnx.merge(target_graphdef, target_state)
    _, h = target(inputs, segment_ids=segment_ids, return_hidden=True)
    return target, jax.lax.stop_gradient(h)


def make_medusa_step(graphdef, target_graphdef, tx):
    """``step(params, opt_state, target_state, inputs, segment_ids, labels, weights) ->
    (params, opt_state, loss)``, jitted: the mean over heads of their weighted cross entropy."""

    def step(params, opt_state, target_state, inputs, segment_ids, labels, weights):
        target, h = _hidden(target_graphdef, target_state, inputs, segment_ids)

        def f(p):
            logits = nnx.merge(graphdef, p)(h, target=target)  # [B, T, N, V]
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
        target, h = _hidden(t_graphdef, t_state, inputs, segment_ids)
        hit = jnp.argmax(nnx.merge(graphdef, state)(h, target=target), -1) == labels
        return jnp.sum(hit * weights, (0, 1)), jnp.sum(weights, (0, 1))

    right = np.zeros(heads.num_heads)
    total = np.zeros(heads.num_heads)
    for inputs, targets, seg, w in batches:
        labels, lw = head_labels(targets, w, heads.num_heads)
        r, t = counts(state, t_state, inputs, seg, labels, lw)
        right, total = right + np.asarray(r), total + np.asarray(t)
    return [float(x) for x in right / np.maximum(total, 1)]


def train_medusa(target, corpus: data.Corpus, tc, num_heads: int, *, log=print):
    """Trains ``num_heads`` heads (sharing a tied ``target``'s LM head, else initialised from
    it: ``MedusaHeads``' default) on the frozen ``target``; ``tc`` is a
    ``models.train.TrainConfig``. Returns (heads, summary dict)."""

    heads = MedusaHeads(target.config, num_heads, rngs=nnx.Rngs(tc.seed)).init_from(target)
    graphdef, params = nnx.split(heads)
    t_graphdef, t_state = nnx.split(target)
    tx = optimizer(dataclasses.replace(tc, weight_decay=0.0))
    opt_state = tx.init(params)
    step_fn = make_medusa_step(graphdef, t_graphdef, tx)
    rng = np.random.default_rng(tc.seed)
    held = data.heldout_batches(corpus.heldout, tc.batch, tc.seq_len, tc.eval_batches)
    history, start, done = [], time.perf_counter(), 0
    try:
        for i in range(1, tc.steps + 1):
            inputs, targets, seg, w = data.random_batch(corpus.train, rng, tc.batch, tc.seq_len)
            labels, lw = head_labels(targets, w, num_heads)
            params, opt_state, loss = step_fn(params, opt_state, t_state, inputs, seg, labels, lw)
            done = i
            if i % tc.eval_every == 0 or i == tc.steps:
                nnx.update(heads, params)
                acc = head_accuracy(heads, target, held)
                elapsed = time.perf_counter() - start
                history.append(dict(step=i, train_loss=float(loss), head_top1=acc, seconds=elapsed))
                accs = " ".join(f"{a:.3f}" for a in acc)
                log(
                    f"step {i}: loss {float(loss):.4f}, held-out top-1 per head [{accs}], "
                    f"{elapsed:.0f}s"
                )
    except KeyboardInterrupt:  # the caller gets no heads: a run cut short is not saved
        raise Interrupted(done, tc.steps) from None
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


def main_medusa(args, tc, argv=None, error=None) -> int:
    """``models.train``'s ``--medusa-heads`` mode: trains, saves with :func:`save_medusa` and
    writes ``training.json`` (per-head held-out top-1 accuracy included) -> exit status (130
    after Ctrl-C, which saves nothing unless it comes after the heads were written).
    ``error(message)``: how a flag that does not fit the target or the corpus is reported
    before training (``models.train`` passes its parser's usage error); default ValueError."""

    def fail(message: str):
        if error is not None:
            error(message)
        raise ValueError(message)

    if args.init is None:
        fail("--medusa-heads needs --init (the frozen target: shipped name or path)")
    if args.medusa_heads < 1:
        fail(f"--medusa-heads must be >= 1, got {args.medusa_heads}")
    path = str(shipped_path(args.init)) if args.init in SHIPPED else args.init
    saved = f"nothing saved to {args.out}"
    try:
        try:
            target = load_hf_checkpoint(path, attn_impl=args.attn_impl)
        except (OSError, ValueError) as e:  # a checkpoint that lies
            fail(f"--init {args.init}: {e}")
        if tc.seq_len > target.config.max_position:
            fail(f"--seq-len {tc.seq_len} is longer than the target's {target.config.max_position}")
        corpus = data.Corpus.from_stdlib(max_bytes=args.max_corpus_bytes)
        problem = windows_problem(corpus, tc)
        if problem is not None:
            fail(problem)
        print(
            f"{args.medusa_heads} Medusa heads on {args.init}; corpus {corpus.train.size:,} "
            f"train / {corpus.heldout.size:,} held-out tokens; {jax.devices()[0].platform}",
            flush=True,
        )
        heads, summary = train_medusa(
            target, corpus, tc, args.medusa_heads, log=lambda s: print(s, flush=True)
        )
        command = " ".join(["python -m models.train", *(sys.argv[1:] if argv is None else argv)])
        summary.update(command=command, init=args.init)
        write_summary(
            args.out,
            summary,
            lambda: save_medusa(heads, args.out, extra=dict(base_model=args.init)),
        )
        saved = f"{args.out} saved"
    except KeyboardInterrupt as e:
        return report_interrupt(e, saved)
    accs = ", ".join(f"{a:.3f}" for a in summary["heldout_head_top1"])
    print(f"saved {args.out}: held-out top-1 per head [{accs}]", flush=True)
    return 0


# --- Self-distillation: heads trained on the frozen target's own continuations of chat prompts.
#
# ``python -m models.medusa_train --target smollm2-135m-instruct --out DIR`` generates the data
# (greedy and sampled continuations of DISTILL_TASKS x DISTILL_SUBJECTS, chat-formatted with the
# target's template, batched ``decoding.generate``), computes the target's hidden states once
# (cached as .npy under a temp dir), trains shared-head heads on them and saves them.

# Varied tasks ({s} is a subject); the open-chat prompts of benchmarks/medusa_real.py are
# written apart from these, so the benchmark measures the heads on prompts they never saw.
DISTILL_TASKS = (
    "Explain {s} to a curious ten-year-old.",
    "Write a short paragraph about {s}.",
    "Give three practical tips related to {s}.",
    "What are the main advantages and disadvantages of {s}?",
    "Write a haiku about {s}, then explain it in one sentence.",
    "Summarize the history of {s} in a few sentences.",
    "Write a Python function related to {s} and explain what it does.",
    "List five interesting facts about {s}.",
    "Compose a friendly email inviting a colleague to a talk on {s}.",
    "What questions would a beginner ask about {s}? Answer two of them.",
    "Describe a typical day of someone whose job involves {s}.",
    "Compare {s} with something similar and say which you prefer and why.",
    "I want to get started with {s}. Where should I begin?",
    "Why does {s} matter to ordinary people?",
    "Write a short, friendly message to a friend about {s}.",
    "What are common misconceptions about {s}?",
    "Can you give me a step-by-step guide related to {s}?",
    "Tell me a fun story that involves {s}.",
    "How would you explain {s} in one paragraph to a busy manager?",
    "What are some good questions to ask an expert on {s}?",
)
DISTILL_SUBJECTS = (
    "photosynthesis",
    "the water cycle",
    "volcanoes",
    "black holes",
    "the human heart",
    "machine learning",
    "sorting algorithms",
    "the internet",
    "electric cars",
    "solar panels",
    "honey bees",
    "the Roman Empire",
    "chess",
    "jazz music",
    "baking bread",
    "coffee",
    "recycling",
    "rainforests",
    "the moon landing",
    "vaccines",
    "earthquakes",
    "democracy",
    "budgeting money",
    "learning a language",
    "running a marathon",
    "sleep",
    "meditation",
    "gardening",
    "the printing press",
    "bicycles",
    "databases",
    "cryptography",
    "dinosaurs",
    "ocean tides",
    "climate change",
    "public libraries",
    "video games",
    "3D printing",
    "the stock market",
    "penguins",
)


def distill_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """``num_prompts`` distinct user messages, task x subject pairs in a seeded random order
    (deterministic: the same ``seed``, the same list)."""
    pairs = [(t, s) for s in DISTILL_SUBJECTS for t in DISTILL_TASKS]
    if not 1 <= num_prompts <= len(pairs):
        raise ValueError(f"num_prompts must be in [1, {len(pairs)}], got {num_prompts}")
    order = np.random.default_rng(seed).permutation(len(pairs))[:num_prompts]
    return [pairs[i][0].format(s=pairs[i][1]) for i in order]


def self_distill_data(
    target,
    tokenizer,
    messages,
    *,
    max_new_tokens: int,
    temperatures=(0.0, 0.7),
    batch: int = 16,
    seed: int = 0,
    log=print,
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, continuation ids) pairs: for each temperature (0 = greedy) the target's own
    continuation of every message (chat-formatted, ``tokenizer.apply_chat_template``), made by
    batched ``decoding.generate`` in batches of ``batch``, stopping at EOS."""

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": m}]) for m in messages]
    out = []
    for ti, temp in enumerate(temperatures):
        sampling = SamplingConfig(temperature=float(temp))
        for b in range(0, len(prompts), batch):
            chunk = prompts[b : b + batch]
            chunk = chunk + [chunk[-1]] * (batch - len(chunk))  # one shape: no recompiles
            start = time.perf_counter()
            res = generate(
                target,
                chunk,
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                eos_id=tokenizer.eos_id,
                seed=seed + 1000 * ti + b,
            )
            n = min(batch, len(prompts) - b)
            out += list(zip(chunk[:n], res.tokens[:n], strict=True))
            new = sum(len(t) for t in res.tokens[:n])
            log(
                f"T={temp}: prompts {b + n}/{len(prompts)}, {new} tokens in "
                f"{time.perf_counter() - start:.0f}s"
            )
    return out


def hidden_dataset(target, pairs, num_heads: int, *, batch: int = 8, bucket: int = 64):
    """The target's hidden states and the heads' labels over ``pairs`` (prompt, continuation):
    (h [N, dim] float32, labels [N, num_heads] int32, -1 where the sequence ends first).

    One uncached forward per batch (right-padded to a multiple of ``bucket``: a causal model's
    earlier positions do not see the padding). Rows are the positions t from the prompt's last
    token to the last continuation token; head i's label at t is token t + 2 + i."""
    graphdef, state = nnx.split(target)

    @jax.jit
    def fwd(state, tokens):
        return nnx.merge(graphdef, state)(tokens, return_hidden=True)[1]

    hs, labels = [], []
    for b in range(0, len(pairs), batch):
        seqs = [list(p) + list(c) for p, c in pairs[b : b + batch]]
        T = -(-max(map(len, seqs)) // bucket) * bucket
        tokens = np.zeros((batch, T), np.int32)
        for r, s in enumerate(seqs):
            tokens[r, : len(s)] = s
        h = np.asarray(fwd(state, tokens))
        for r, (p, _) in enumerate(pairs[b : b + batch]):
            s = np.asarray(seqs[r])
            t = np.arange(len(p) - 1, len(s))
            lab = np.full((t.size, num_heads), -1, np.int32)
            for i in range(num_heads):
                ok = t + 2 + i < len(s)
                lab[ok, i] = s[t[ok] + 2 + i]
            hs.append(h[r, t])
            labels.append(lab)
    return np.concatenate(hs).astype(np.float32), np.concatenate(labels)


def root_tokens(pairs) -> np.ndarray:
    """The root token x_{t+1} [N] int32 of each of :func:`hidden_dataset`'s rows over ``pairs``
    (the same row order; 0 at each sequence's last position, which has no labels)."""
    out = []
    for p, c in pairs:
        s = np.asarray(list(p) + list(c), np.int32)
        nxt = np.append(s[len(p) :], 0)  # s[t + 1] for t = len(p) - 1 .. len(s) - 1
        out.append(nxt)
    return np.concatenate(out).astype(np.int32)


def root_embeddings(target, roots, *, chunk: int = 4096) -> np.ndarray:
    """The target's embeddings [N, dim] float32 of root tokens [N] (what heads with
    ``root_token`` read), computed in chunks."""
    embed = jax.jit(lambda graphdef, state, t: nnx.merge(graphdef, state)(t))
    graphdef, state = nnx.split(target.embed)
    parts = []
    for b in range(0, len(roots), chunk):
        part = np.asarray(roots[b : b + chunk], np.int32)
        pad = chunk - len(part)
        e = embed(graphdef, state, np.pad(part, (0, pad)))
        parts.append(np.asarray(e, np.float32)[: len(part)])
    return np.concatenate(parts) if parts else np.zeros((0, target.config.dim), np.float32)


def make_shared_step(graphdef, tx, softcap: float = 0.0):
    """``step(params, opt_state, w, h, labels, ht, e) -> (params, opt_state, loss)``, jitted, for
    shared-head heads: h [M, dim] cached hidden states (and e [M, dim] their root tokens'
    embeddings, for heads with ``root_token``), w [V', dim] the target's head rows over
    the training vocabulary, labels [M, N] indices into those rows (-1: no label). The loss is
    the mean over heads of each head's cross entropy over the V' rows: against the label, or,
    with ht [M, N, dim] (the target's hidden state at t + 1 + i, whose LM head predicted the
    label), against the target's own distribution there (self-distillation's soft labels: the
    whole distribution, not one sample of it)."""

    def cap(logits):
        return softcap * jnp.tanh(logits / softcap) if softcap > 0 else logits

    def step(params, opt_state, w, h, labels, ht=None, e=None):
        def f(p):
            ee = None if e is None else e[:, None]
            r = nnx.merge(graphdef, p).residuals(h[:, None], None, ee)[:, 0]  # [M, N, dim]
            logits = cap(jnp.einsum("mnd,vd->mnv", r.astype(w.dtype), w).astype(jnp.float32))
            ok = labels >= 0
            if ht is None:
                ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(labels, 0))
            else:
                t_logits = cap(jnp.einsum("mnd,vd->mnv", ht.astype(w.dtype), w))
                ce = optax.softmax_cross_entropy(logits, jax.nn.softmax(t_logits, -1))
            per_head = jnp.sum(ce * ok, 0) / jnp.maximum(jnp.sum(ok, 0), 1)
            return jnp.mean(per_head)

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def hidden_accuracy(
    heads: MedusaHeads, target, h, labels, roots=None, *, chunk: int = 256
) -> list[float]:
    """Per-head top-1 accuracy [N] on cached hidden states h [M, dim] with labels [M, N] (-1
    ignored), over the tokens the heads draft from (their draft vocabulary, else all); ``roots``
    [M], each row's root token (:func:`root_tokens`), for heads with ``root_token``."""
    graphdef, state = nnx.split(heads)
    t_graphdef, t_state = nnx.split(target)
    if roots is None:
        roots = np.zeros(len(h), np.int32)  # read only by heads with a root token

    @jax.jit
    def pred(state, t_state, h, r):
        heads = nnx.merge(graphdef, state)
        target = nnx.merge(t_graphdef, t_state)
        return jnp.argmax(heads(h[None], target=target, tokens=r[None])[0], -1)

    right = np.zeros(heads.num_heads)
    total = np.zeros(heads.num_heads)
    for b in range(0, len(h), chunk):
        hb, lb = h[b : b + chunk], labels[b : b + chunk]
        pad = chunk - len(hb)
        rb = np.pad(np.asarray(roots[b : b + chunk], np.int32), (0, pad))
        p = np.asarray(pred(state, t_state, np.pad(hb, ((0, pad), (0, 0))), rb))[: len(hb)]
        right += np.sum((p == lb) & (lb >= 0), 0)
        total += np.sum(lb >= 0, 0)
    return [float(x) for x in right / np.maximum(total, 1)]


def train_shared_heads(
    target,
    h,
    labels,
    num_heads: int,
    tc,
    *,
    heldout=None,
    vocab: str = "data",
    draft_vocab: int | None = None,
    soft: bool = False,
    roots=None,
    log=print,
):
    """Trains ``num_heads`` shared-head heads on cached hidden states h [M, dim] and labels
    [M, >= num_heads] of the frozen ``target``; ``tc`` a ``models.train.TrainConfig`` (steps,
    batch = rows per step, lr, warmup, seed, eval_every). Returns (heads, summary dict).

    ``vocab``: "data" computes each step's softmax over the tokens that occur as labels (the
    target's own outputs: the other rows of the head are never the answer, and a full-vocabulary
    softmax would cost ~8x more per step on SmolLM2), and the heads keep those tokens as their
    draft vocabulary (``MedusaHeads(vocab=)``: a drafting step then computes V' logits, not V);
    "full" over all V rows, no draft vocabulary. ``draft_vocab``: with "data", keep only the
    that many most frequent label tokens (FR-Spec's frequency ranking: on SmolLM2's chat data the
    4096 most frequent of 8198 cover 93% of held-out tokens, at half a draft step's bytes); labels
    outside them are ignored, soft labels renormalise over them. Held-out accuracy (``heldout``
    = (h, labels)) is what drafting sees: over the draft vocabulary where there is one.

    ``soft``: the target's own distribution at t + 1 + i as each label (``make_shared_step``);
    h must then be :func:`hidden_dataset`'s consecutive rows (row j + 1 + i is position
    t + 1 + i of the same sequence wherever row j has head i's label).

    ``roots``: None, or each row's root token [M] (:func:`root_tokens`): the heads then read it
    (``MedusaHeads(root_token=True)``); ``heldout`` is then (h, labels, roots)."""

    labels = np.asarray(labels)[:, :num_heads]
    w_full = head_rows(target)
    rows = None
    if vocab == "data":
        rows, counts = np.unique(labels[labels >= 0], return_counts=True)
        if draft_vocab is not None and draft_vocab < rows.size:
            rows = np.sort(rows[np.argsort(-counts, kind="stable")[:draft_vocab]])
        remap = np.full(target.config.vocab_size, -1, np.int32)
        remap[rows] = np.arange(rows.size, dtype=np.int32)
        w = jnp.asarray(w_full)[jnp.asarray(rows)]
        lab = np.where(labels >= 0, remap[np.maximum(labels, 0)], -1)
    elif vocab == "full":
        w, lab = jnp.asarray(w_full), labels
    else:
        raise ValueError(f"vocab must be 'data' or 'full', got {vocab!r}")
    # The draft vocabulary's rows stay the target's (a frozen copy): only the residual layers
    # train, so the vocabulary is attached to a second instance that shares nothing trainable.
    root = roots is not None
    e = root_embeddings(target, np.asarray(roots)) if root else None
    heads = MedusaHeads(
        target.config, num_heads, shared_head=True, root_token=root, rngs=nnx.Rngs(tc.seed)
    )
    drafting = heads
    if rows is not None:
        drafting = MedusaHeads(
            target.config,
            num_heads,
            shared_head=True,
            vocab=rows,
            root_token=root,
            rngs=nnx.Rngs(tc.seed),
        ).init_from(target)
    graphdef, params = nnx.split(heads)
    tx = optimizer(dataclasses.replace(tc, weight_decay=0.0))
    opt_state = tx.init(params)
    step_fn = make_shared_step(graphdef, tx, target.config.final_softcap)

    def trained():
        nnx.update(heads, params)
        nnx.update(drafting.heads, nnx.state(heads.heads))
        return drafting

    rng = np.random.default_rng(tc.seed)
    history, start, first_loss, done = [], time.perf_counter(), None, 0
    try:
        for i in range(1, tc.steps + 1):
            idx = rng.integers(0, len(h), tc.batch)
            ht = None
            if soft:
                tidx = idx[:, None] + 1 + np.arange(num_heads)[None]  # [M, N]
                ht = h[np.where(lab[idx] >= 0, tidx, idx[:, None])]
            eb = None if e is None else e[idx]
            params, opt_state, loss = step_fn(params, opt_state, w, h[idx], lab[idx], ht, eb)
            done = i
            if first_loss is None:
                first_loss = float(loss)  # the untrained heads' loss (computed before the update)
            if i % tc.eval_every == 0 or i == tc.steps:
                entry = dict(step=i, train_loss=float(loss), seconds=time.perf_counter() - start)
                if heldout is not None:
                    entry["head_top1"] = hidden_accuracy(trained(), target, *heldout)
                history.append(entry)
                acc = " ".join(f"{a:.3f}" for a in entry.get("head_top1", []))
                seconds = entry["seconds"]
                log(f"step {i}: loss {float(loss):.4f}, held-out top-1 [{acc}], {seconds:.0f}s")
    except KeyboardInterrupt:  # the caller gets no heads: a run cut short is not saved
        raise Interrupted(done, tc.steps) from None
    heads = trained()
    summary = dict(
        num_heads=num_heads,
        vocab=vocab,
        soft_labels=soft,
        root_token=root,
        vocab_rows=int(w.shape[0]),
        rows_seen=tc.steps * tc.batch,
        first_loss=first_loss,
        train_rows=int(len(h)),
        wall_seconds=round(time.perf_counter() - start, 1),
        heldout_head_top1=history[-1].get("head_top1") if history else None,
        history=history,
        train_config=dataclasses.asdict(tc),
    )
    return heads, summary


def cache_dir(key: dict, name: str = "pallas_attn_medusa") -> str:
    """``$TMPDIR/<name>/<hash of key>``: where a trainer caches the data its arguments made."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), name, digest)


def main(argv=None) -> int:
    """``python -m models.medusa_train``: self-distilled shared-head Medusa heads (see the
    section comment above). Exit status 2 with a usage error for bad arguments."""

    p = argparse.ArgumentParser(prog="python -m models.medusa_train", description=main.__doc__)
    p.add_argument("--target", type=model_arg, default="smollm2-135m-instruct")
    p.add_argument("--out", required=True, type=output_dir)
    p.add_argument("--num-heads", type=pos, default=4)
    p.add_argument("--prompts", type=pos, default=96, help="distinct training prompts")
    p.add_argument("--max-new-tokens", type=pos, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--gen-batch", type=pos, default=16, help="capped at --prompts")
    p.add_argument("--steps", type=pos, default=600)
    p.add_argument("--batch", type=pos, default=256, help="hidden-state rows per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--vocab", choices=("data", "full"), default="data")
    p.add_argument(
        "--draft-vocab",
        type=pos,
        default=4096,
        help="with --vocab data: the heads draft from this many most frequent tokens of the data",
    )
    p.add_argument(
        "--hard-labels",
        action="store_true",
        help="train on the sampled tokens, not the target's distributions",
    )
    p.add_argument(
        "--root-token",
        action="store_true",
        help="heads also read the embedding of the token the target just produced",
    )
    p.add_argument("--heldout", type=float, default=0.1, help="fraction of pairs held out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dtype", choices=("float16", "float32"), default="float16")
    args = p.parse_args(argv)
    tc = distill_config(p, args, warmup=50)
    return run_distill(
        p,
        args,
        lambda log: _distill(p, args, argv, tc, log),
        lambda s: f"held-out top-1 per head {s['heldout_head_top1']}",
    )


def pos(text: str) -> int:
    """An ``argparse`` type: an int >= 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return int(text)


def distill_config(p: argparse.ArgumentParser, args, *, warmup: int) -> TrainConfig:
    """The self-distillation trainers' shared flag checks (every flag is checked before the
    target loads: generating the data takes minutes) -> their ``TrainConfig``; usage errors
    (exit 2) naming the flag."""
    if not all(math.isfinite(t) and t >= 0 for t in args.temperatures):
        p.error(f"--temperatures must be finite and >= 0, got {args.temperatures}")
    if not 0 <= args.heldout < 1:
        p.error(f"--heldout must be in [0, 1), got {args.heldout}")
    if args.prompts > len(DISTILL_TASKS) * len(DISTILL_SUBJECTS):
        p.error(f"--prompts must be <= {len(DISTILL_TASKS) * len(DISTILL_SUBJECTS)}")
    try:
        return TrainConfig(
            steps=args.steps,
            batch=args.batch,
            lr=args.lr,
            warmup=min(warmup, args.steps),
            eval_every=max(args.steps // 4, 1),
            seed=args.seed,
        )
    except ValueError as e:
        p.error(f"--{str(e).replace('_', '-')}")


def run_distill(p, args, distill, describe) -> int:
    """Runs ``distill(log) -> summary`` with the trainers' Ctrl-C handling (exit 130, one line
    saying nothing was saved) and final line (``describe(summary)``) -> exit status."""
    log = lambda s: print(s, flush=True)  # noqa: E731
    saved = f"nothing saved to {args.out}"
    try:
        summary = distill(log)
        saved = f"{args.out} saved"
    except KeyboardInterrupt as e:
        return report_interrupt(e, saved)
    log(f"saved {args.out}: {describe(summary)}, {summary['total_seconds']:.0f}s in all")
    return 0


def _distill(p: argparse.ArgumentParser, args, argv, tc: TrainConfig, log) -> dict:
    """:func:`main`'s work: the data (or its cache), the heads, the saved directory ->
    the summary written to its ``training.json``."""
    t0 = time.perf_counter()
    try:
        target, tokenizer = pretrained(args.target)
    except (OSError, ValueError) as e:  # a checkpoint that lies
        p.error(f"--target {args.target}: {e}")
    if tokenizer.chat_template is None:
        p.error(f"--target {args.target}: the model has no chat template to format prompts with")
    if args.max_new_tokens >= target.config.max_position:
        p.error(
            f"--max-new-tokens {args.max_new_tokens}: the target holds "
            f"{target.config.max_position} tokens, prompt included"
        )
    log(f"{args.target}: {args.prompts} prompts x temperatures {args.temperatures}")
    key = dict(
        target=args.target,
        prompts=args.prompts,
        max_new=args.max_new_tokens,
        temps=args.temperatures,
        seed=args.seed,
        heads=args.num_heads,
    )
    cache = cache_dir(key)
    cached = os.path.isfile(os.path.join(cache, "data.json"))  # written last
    if cached and args.root_token and not os.path.isfile(os.path.join(cache, "pairs.json")):
        cached = False  # a cache from before the pairs were kept: no root tokens
    if cached:
        log(f"hidden states from the cache {cache}")
        with open(os.path.join(cache, "data.json")) as f:
            data_meta = json.load(f)
    else:
        messages = distill_prompts(args.prompts, args.seed)
        pairs = self_distill_data(
            target,
            tokenizer,
            messages,
            max_new_tokens=args.max_new_tokens,
            temperatures=args.temperatures,
            batch=min(args.gen_batch, args.prompts),
            seed=args.seed,
            log=log,
        )
        gen_s = time.perf_counter() - t0
        h, labels = hidden_dataset(target, pairs, args.num_heads)
        # Held-out split by prompt (both temperatures of a prompt on the same side).
        n_held = int(round(args.heldout * args.prompts))
        held_ids = set(range(args.prompts - n_held, args.prompts))
        split = np.concatenate(
            [np.full(len(c) + 1, (i % args.prompts) in held_ids) for i, (_, c) in enumerate(pairs)]
        )
        data_meta = dict(
            pairs=len(pairs),
            new_tokens=int(sum(len(c) for _, c in pairs)),
            rows=int(len(h)),
            generate_seconds=round(gen_s, 1),
            hidden_seconds=round(time.perf_counter() - t0 - gen_s, 1),
        )
        with deferred_interrupts():  # a cache is whole or absent
            os.makedirs(cache, exist_ok=True)
            np.save(os.path.join(cache, "hidden.npy"), h)
            np.save(os.path.join(cache, "labels.npy"), labels)
            np.save(os.path.join(cache, "heldout.npy"), split)
            with open(os.path.join(cache, "pairs.json"), "w") as f:
                json.dump([[list(map(int, a)), list(map(int, c))] for a, c in pairs], f)
            with open(os.path.join(cache, "data.json"), "w") as f:
                json.dump(data_meta, f)
        log(f"data: {data_meta} cached in {cache}")
    h = np.load(os.path.join(cache, "hidden.npy"))
    labels = np.load(os.path.join(cache, "labels.npy"))
    split = np.load(os.path.join(cache, "heldout.npy"))
    roots = None
    if args.root_token:
        with open(os.path.join(cache, "pairs.json")) as f:
            roots = root_tokens(json.load(f))
    heldout = None
    if split.any():
        heldout = (h[split], labels[split]) + (() if roots is None else (roots[split],))
    heads, summary = train_shared_heads(
        target,
        h[~split],
        labels[~split],
        args.num_heads,
        tc,
        heldout=heldout,
        vocab=args.vocab,
        draft_vocab=args.draft_vocab,
        soft=not args.hard_labels,
        roots=None if roots is None else roots[~split],
        log=log,
    )
    command = " ".join(["python -m models.medusa_train", *(sys.argv[1:] if argv is None else argv)])
    summary.update(
        command=command,
        base_model=args.target,
        data=data_meta,
        total_seconds=round(time.perf_counter() - t0, 1),
    )
    extra = dict(base_model=args.target)
    write_summary(
        args.out, summary, lambda: save_medusa(heads, args.out, extra=extra, dtype=args.save_dtype)
    )
    return summary


if __name__ == "__main__":
    sys.exit(main())
