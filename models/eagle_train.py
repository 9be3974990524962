"""Training an EAGLE draft head (``models.eagle``) by self-distillation on a frozen target
(``python -m models.eagle_train --target smollm2-135m-instruct --out DIR``).

Data: the Medusa trainer's task x subject chat prompts (``models.medusa_train.distill_prompts``)
and, with ``--model-prompts N``, N user messages the model writes itself (:func:`model_prompts`);
the target's own greedy and sampled answers to them (``self_distill_data``), then its hidden
states over each whole sequence (one uncached forward per batch of similar lengths). Each source
is cached under ``$TMPDIR/pallas_attn_eagle/`` (a rerun with the same data arguments skips it).

``--depth D`` trains D drafting passes at once (:func:`unrolled_features`, the cached drafting's
view of its own earlier guesses), each weighed equally; ``--init DIR`` starts from a saved head.

Loss at pair j (the draft reads (h_j, x_{j+1})): cross entropy of the draft's logits over the
draft vocabulary against the target's own distribution at j + 1 (soft labels, from h_{j+1}),
plus ``--feature-weight`` times the smooth-L1 distance of its feature to h_{j+1} (EAGLE's
regression, which keeps the fed-back features close to what the target would give). Pairs in the
prompt weigh ``PROMPT_WEIGHT``: the draft only drafts answers. Gaussian noise of ``--noise``
times each feature's scale is added to the h the draft reads (EAGLE's noise: at drafting time it
reads its own, imperfect, features after the first token).

Evaluation (held-out prompts' greedy continuations): ``chain_acceptance`` drafts k tokens after
every position of an answer exactly as decoding does (the cached block, its own features fed
back) and counts how many the target's greedy answer keeps.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from decoding.generate import generate
from decoding.sampling import SamplingConfig
from models.cli import Interrupted, output_dir, write_summary
from models.eagle import TRAINABLE, EagleHead, load_eagle, save_eagle
from models.interrupts import deferred_interrupts
from models.medusa import head_rows
from models.medusa_train import (
    cache_dir,
    distill_config,
    distill_prompts,
    pos,
    run_distill,
    self_distill_data,
)
from models.pretrained import model_arg, pretrained
from models.train_step import optimizer
from models.transformer import apply_rope, rope_tables

PROMPT_WEIGHT = 0.1


def sequence_features(target, seqs, *, batch: int = 8, bucket: int = 32, log=print):
    """The target's hidden states over each sequence: a list of float32 [len(s), dim] arrays.
    Sequences are batched by length (one uncached forward per batch, right-padded to a multiple
    of ``bucket``: a causal model's earlier positions never see the padding)."""
    graphdef, state = nnx.split(target)

    @jax.jit
    def fwd(state, tokens):
        return nnx.merge(graphdef, state)(tokens, return_hidden=True)[1]

    order = np.argsort([len(s) for s in seqs], kind="stable")
    out = [None] * len(seqs)
    start = time.perf_counter()
    for b in range(0, len(order), batch):
        idx = order[b : b + batch]
        T = -(-max(len(seqs[i]) for i in idx) // bucket) * bucket
        tokens = np.zeros((batch, T), np.int32)
        for r, i in enumerate(idx):
            tokens[r, : len(seqs[i])] = seqs[i]
        h = np.asarray(fwd(state, tokens), np.float32)
        for r, i in enumerate(idx):
            out[i] = h[r, : len(seqs[i])]
        if (b // batch) % 25 == 0:
            log(
                f"hidden states: {b + len(idx)}/{len(seqs)} sequences, "
                f"{time.perf_counter() - start:.0f}s"
            )
    return out


def model_prompts(
    target, tokenizer, count: int, *, seed: int = 0, batch: int = 32, exclude=frozenset(), log=print
):
    """``count`` distinct user messages written by the chat model itself (Magpie, Xu et al.,
    2024): the chat template up to where a user's message starts, continued at T = 1 until the
    turn ends. They follow what the model expects users to ask, far wider than a fixed list of
    tasks and subjects; messages of under 3 words, unfinished ones and repeats are dropped, and
    so are those whose chat-formatted ids (``tokenizer.apply_chat_template``) are in ``exclude``
    (another source's prompts: a message held out there must not be trained on here)."""
    a = tokenizer.apply_chat_template(
        [{"role": "user", "content": "a"}], add_generation_prompt=False
    )
    b = tokenizer.apply_chat_template(
        [{"role": "user", "content": "b"}], add_generation_prompt=False
    )
    n = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    prefix = list(a[:n])  # the template before the user's text
    out, seen, round_ = [], set(), 0
    while len(out) < count and round_ < 8 * (1 + count // batch):
        res = generate(
            target,
            [prefix] * batch,
            max_new_tokens=64,
            sampling=SamplingConfig(temperature=1.0),
            eos_id=tokenizer.eos_id,
            seed=seed + 7919 * round_,
        )
        round_ += 1
        for toks in res.tokens:
            if not toks or toks[-1] != tokenizer.eos_id:
                continue  # cut at 64 tokens: unfinished
            text = tokenizer.decode(toks[:-1]).strip()
            if len(text.split()) < 3 or text in seen:
                continue
            seen.add(text)
            chat = tokenizer.apply_chat_template([{"role": "user", "content": text}])
            if tuple(chat) not in exclude:
                out.append(text)
        log(f"model-written prompts: {min(len(out), count)}/{count}")
    return out[:count]


def draft_vocabulary(seqs, prompt_lengths, size: int) -> np.ndarray:
    """The ``size`` most frequent tokens of the answers (FR-Spec's ranking), sorted ids."""
    toks = np.concatenate([np.asarray(s[p:]) for s, p in zip(seqs, prompt_lengths, strict=True)])
    ids, counts = np.unique(toks, return_counts=True)
    keep = ids[np.argsort(-counts, kind="stable")[:size]]
    return np.sort(keep).astype(np.int32)


def unrolled_features(head: EagleHead, h, tokens, embed, depth: int):
    """The draft's features over whole sequences as it drafts ``depth`` tokens after every
    position at once (EAGLE-3's "training-time test"): pass 1 reads the target's pairs
    (h_j, x_{j+1}); pass p > 1 at index j reads (pass p - 1's feature at j, x_{j+p}) at
    position j + p - 1 and attends to pass 1's keys at positions <= j (the target's pairs up
    to the anchor) and to passes 2 .. p's own keys at index j (the drafted pairs after it), as
    the cached block does when drafting the p-th token after anchor j.

    h [B, T + depth, dim], tokens [B, T + depth + 1] -> features [depth, B, T, dim] (pass p's
    feature at index j predicts h_{j+p}). Padding is on the right: causal attention keeps it
    from every real position."""
    c = head.block.attn.config
    if c.qk_norm or c.sandwich_norm or c.attn_softcap or c.is_sliding(0):
        raise ValueError("unrolled training supports plain pre-norm blocks without a window")
    B = h.shape[0]
    T = h.shape[1] - depth
    D, H, Hkv = c.resolved_head_dim, c.num_heads, c.num_kv_heads
    G = H // Hkv
    scale = c.softmax_scale or D**-0.5
    blk = head.block
    dt = c.jnp_dtype

    def project(x, pos):
        qkv = blk.attn.qkv_proj(blk.input_norm(x)).reshape(B, T, Hkv, G + 2, D)
        cos, sin = rope_tables(c, pos)
        q = apply_rope(qkv[:, :, :, :-2].reshape(B, T, H, D), cos, sin)
        k = apply_rope(qkv[:, :, :, -2], cos, sin)
        return q.reshape(B, T, Hkv, G, D), k, qkv[:, :, :, -1]

    causal = jnp.tril(jnp.ones((T, T), bool))
    k1 = v1 = None
    extra, feats = [], []  # passes 2 ..'s (k, v), each read only at its own index
    x_h = h[:, :T]
    for p in range(1, depth + 1):
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + p - 1, (B, T))
        e = embed[tokens[:, p : T + p]]
        x = head.fc(jnp.concatenate([e.astype(dt), x_h.astype(dt)], -1))
        q, k, v = project(x, pos)
        if p == 1:
            k1, v1 = k, v
        else:
            extra.append((k, v))
        s1 = jnp.einsum("bikgd,bjkd->bkgij", q, k1).astype(jnp.float32) * scale
        s1 = jnp.where(causal, s1, -jnp.inf)
        own = [
            jnp.einsum("bikgd,bikd->bkgi", q, kr).astype(jnp.float32)[..., None] * scale
            for kr, _ in extra
        ]
        w = jax.nn.softmax(jnp.concatenate([s1, *own], -1), -1)  # [B, Hkv, G, T, T + p - 1]
        out = jnp.einsum("bkgij,bjkd->bikgd", w[..., :T].astype(v1.dtype), v1)
        for r, (_, vr) in enumerate(extra):
            wr = w[..., T + r].transpose(0, 3, 1, 2)[..., None]  # [B, T, Hkv, G, 1]
            out = out + wr.astype(vr.dtype) * vr[:, :, :, None, :]
        x = x + blk.attn.o_proj(out.reshape(B, T, H * D))
        x = x + blk.mlp(blk.post_attn_norm(x))
        feats.append(x)
        x_h = x
    return jnp.stack(feats)


def make_step(graphdef, rest, tx, *, depth: int, feature_weight: float, noise: float, softcap):
    """``step(params, opt_state, w, embed, batch, key) -> (params, opt_state, loss)``, jitted.
    ``w`` [V', dim]: the target's LM-head rows of the draft vocabulary; ``embed`` [V, dim]: its
    embedding table; ``batch`` from :func:`_batch`. The loss is the mean over the ``depth``
    passes of :func:`unrolled_features` (pass p at index j against h_{j+p}, the target's
    distribution there and its feature)."""

    def cap(x):
        return softcap * jnp.tanh(x / softcap) if softcap > 0 else x

    def step(params, opt_state, w, embed, batch, key):
        tokens, h, weights = batch
        T = weights.shape[1] - depth + 1
        scale = jnp.sqrt(jnp.mean(jnp.square(h), axis=(0, 1), keepdims=True))
        h_in = h + noise * scale * jax.random.normal(key, h.shape, h.dtype)

        def f(p):
            head = nnx.merge(graphdef, p, rest)
            feats = unrolled_features(head, h_in, tokens, embed, depth)
            total = 0.0
            for i in range(depth):
                target = h[:, i + 1 : i + 1 + T]
                wt = weights[:, i : i + T]
                p_target = jax.nn.softmax(cap(jnp.einsum("btd,vd->btv", target, w)), -1)
                ce = optax.softmax_cross_entropy(head.sub_logits(feats[i]), p_target)
                reg = jnp.mean(optax.huber_loss(feats[i], target), -1)
                loss = jnp.sum((ce + feature_weight * reg) * wt) / jnp.maximum(jnp.sum(wt), 1)
                total = total + loss / depth
            return total

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def _batch(seqs, feats, prompt_lengths, idx, depth: int, bucket: int = 32):
    """(tokens [B, T + depth + 1], h [B, T + depth, dim], weights [B, T + depth - 1]) for the
    sequences ``idx``, T + 1 their longest length rounded up to ``bucket``: pair j reads (h_j,
    tokens_{j+1}); ``weights[j]`` is pair j's weight (0 past the sequence), read shifted by
    p - 1 for pass p."""
    T = -(-max(len(seqs[i]) for i in idx) // bucket) * bucket - 1
    dim = feats[idx[0]].shape[1]
    tokens = np.zeros((len(idx), T + depth + 1), np.int32)
    h = np.zeros((len(idx), T + depth, dim), np.float32)
    weights = np.zeros((len(idx), T + depth - 1), np.float32)
    for r, i in enumerate(idx):
        n, p = len(seqs[i]), prompt_lengths[i]
        tokens[r, :n] = seqs[i]
        h[r, :n] = feats[i]
        weights[r, : n - 1] = PROMPT_WEIGHT
        weights[r, p - 1 : n - 1] = 1.0  # pairs whose answer is an answer token's feature
    return tokens, h, weights


@functools.lru_cache(maxsize=8)
def _chain_fn(graphdef, k: int):
    """The jitted drafting of :func:`chain_acceptance`: (state, embed [V, dim], tokens [n + 1],
    h [n + 1, dim], anchors [A]) -> drafted [A, k]."""

    @jax.jit
    def run(state, embed, tokens, h, anchors):
        head = nnx.merge(graphdef, state)
        n = tokens.shape[0] - 1
        cache = head.cache(1, n + k + 1)
        pos = jnp.arange(n, dtype=jnp.int32)[None]
        kv = (cache.k[0], cache.v[0], cache.lengths, None)
        f, (kc, vc) = head.features(h[None, :n], embed[tokens[None, 1:]], pos, kv=kv)
        A = anchors.shape[0]
        kc = jnp.broadcast_to(kc, (A, *kc.shape[1:]))
        vc = jnp.broadcast_to(vc, (A, *vc.shape[1:]))
        lengths = anchors + 1
        feat = f[0, anchors][:, None]  # [A, 1, dim]
        drafted = []
        for i in range(k):
            tok = head.vocab[...][jnp.argmax(head.sub_logits(feat)[:, 0], -1)]
            drafted.append(tok)
            if i + 1 < k:
                kv = (kc, vc, lengths, None)
                feat, (kc, vc) = head.features(feat, embed[tok][:, None], lengths[:, None], kv=kv)
                lengths = lengths + 1
        return jnp.stack(drafted, 1)

    return run


def chain_acceptance(head: EagleHead, target, seq, feats, prompt_length: int, k: int):
    """Greedy chain drafting after every answer position of one sequence, as decoding drafts:
    the pairs up to (h_t, x_{t+1}) from the target, then k tokens with the draft's own features
    fed back. Returns the number of leading draft tokens equal to the sequence's, per anchor t
    (int [A]); ``seq`` must be the target's greedy answer for this to be the acceptance."""
    seq = np.asarray(seq, np.int32)
    L, P = len(seq), prompt_length
    anchors = np.arange(P - 1, L - 2)  # x_{t+2} exists
    if anchors.size == 0:
        return np.zeros(0, np.int32)
    graphdef, state = nnx.split(head)
    n = -(-L // 32) * 32  # padded (one compile per bucket): the pairs past L - 1 are unread
    tokens = np.zeros(n + 1, np.int32)
    tokens[:L] = seq
    h = np.zeros((n + 1, feats.shape[1]), np.float32)
    h[:L] = feats
    A = -(-anchors.size // 32) * 32
    padded = np.pad(anchors, (0, A - anchors.size), constant_values=anchors[0])
    run = _chain_fn(graphdef, k)
    drafted = np.asarray(run(state, target.embed.embedding[...], tokens, h, padded))
    drafted = drafted[: anchors.size]
    truth = np.stack(
        [
            np.where(anchors + 2 + i < L, seq[np.minimum(anchors + 2 + i, L - 1)], -1)
            for i in range(k)
        ],
        1,
    )
    match = np.cumprod(drafted == truth, axis=1)
    return match.sum(1)


def train_eagle(
    target,
    seqs,
    prompt_lengths,
    feats,
    tc,
    *,
    heldout,
    draft_vocab: int,
    feature_weight: float,
    noise: float,
    depth: int = 1,
    init: EagleHead | None = None,
    k_eval: int = 5,
    log=print,
):
    """Trains an :class:`EagleHead` on ``seqs`` (token lists), their hidden states ``feats``
    and prompt lengths; ``tc`` gives steps, batch (sequences per step), lr, warmup, seed,
    eval_every. ``heldout``: (seqs, prompt_lengths, feats) of the target's greedy answers to
    prompts not trained on. ``depth``: passes of :func:`unrolled_features` (1 = EAGLE-1's
    teacher-forced pairs only). ``init``: a head to start from (its draft vocabulary kept).
    Returns (head, summary)."""
    if init is None:
        vocab = draft_vocabulary(seqs, prompt_lengths, draft_vocab)
        head = EagleHead(target.config, vocab=vocab, rngs=nnx.Rngs(tc.seed)).init_from(target)
    else:
        head, vocab = init, np.asarray(init.vocab[...])
    graphdef, params, rest = nnx.split(head, TRAINABLE, ...)
    tx = optimizer(dataclasses.replace(tc, weight_decay=0.0))
    opt_state = tx.init(params)
    w = head_rows(target)[jnp.asarray(vocab)]
    embed = target.embed.embedding[...]
    step_fn = make_step(
        graphdef,
        rest,
        tx,
        depth=depth,
        feature_weight=feature_weight,
        noise=noise,
        softcap=target.config.final_softcap,
    )
    rng = np.random.default_rng(tc.seed)
    key = jax.random.key(tc.seed)

    def evaluate():
        nnx.update(head, params)
        acc = [
            chain_acceptance(head, target, s, f, p, k_eval)
            for s, p, f in zip(*heldout, strict=True)
        ]
        acc = np.concatenate(acc)
        return dict(
            first_token=float(np.mean(acc >= 1)),
            mean_accepted=float(np.mean(acc)),
            accepted_at_least=[float(np.mean(acc >= i)) for i in range(1, k_eval + 1)],
        )

    history, start, first_loss, done = [], time.perf_counter(), None, 0
    try:
        for i in range(1, tc.steps + 1):
            idx = rng.integers(0, len(seqs), tc.batch)
            batch = _batch(seqs, feats, prompt_lengths, idx, depth)
            key, sub = jax.random.split(key)
            params, opt_state, loss = step_fn(params, opt_state, w, embed, batch, sub)
            done = i
            if first_loss is None:
                first_loss = float(loss)
            if i % tc.eval_every == 0 or i == tc.steps:
                entry = dict(
                    step=i, train_loss=float(loss), seconds=round(time.perf_counter() - start, 1)
                )
                if heldout is not None:
                    entry["heldout"] = evaluate()
                history.append(entry)
                log(
                    f"step {i}: loss {float(loss):.4f} {entry.get('heldout', '')} "
                    f"{entry['seconds']:.0f}s"
                )
    except KeyboardInterrupt:
        raise Interrupted(done, tc.steps) from None
    nnx.update(head, params)
    summary = dict(
        vocab_rows=int(vocab.size),
        feature_weight=feature_weight,
        noise=noise,
        depth=depth,
        first_loss=first_loss,
        train_sequences=len(seqs),
        wall_seconds=round(time.perf_counter() - start, 1),
        heldout=history[-1].get("heldout") if history else None,
        history=history,
        train_config=dataclasses.asdict(tc),
    )
    return head, summary


def main(argv=None) -> int:
    """``python -m models.eagle_train``: a self-distilled EAGLE draft head (module docstring).
    Exit status 2 with a usage error for bad arguments."""

    def nonneg(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            x = float("nan")
        if not math.isfinite(x) or x < 0:
            raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
        return x

    p = argparse.ArgumentParser(prog="python -m models.eagle_train", description=main.__doc__)
    p.add_argument("--target", type=model_arg, default="smollm2-135m-instruct")
    p.add_argument("--out", required=True, type=output_dir)
    p.add_argument("--prompts", type=pos, default=800, help="distinct task x subject prompts")
    p.add_argument(
        "--model-prompts",
        type=int,
        default=0,
        help="also this many user messages the model writes itself (model_prompts), per seed",
    )
    p.add_argument(
        "--model-seeds",
        type=int,
        nargs="+",
        default=None,
        help="one source of --model-prompts messages per seed (default: --seed), each cached "
        "apart, none repeating an earlier source's",
    )
    p.add_argument("--max-new-tokens", type=pos, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--gen-batch", type=pos, default=32, help="capped at --prompts")
    p.add_argument("--steps", type=pos, default=500)
    p.add_argument("--batch", type=pos, default=16, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--draft-vocab", type=pos, default=4096)
    p.add_argument("--feature-weight", type=nonneg, default=1.0)
    p.add_argument("--noise", type=nonneg, default=0.05)
    p.add_argument("--depth", type=pos, default=3, help="unrolled drafting passes per step")
    p.add_argument("--init", default=None, help="a saved head to start from")
    p.add_argument("--heldout", type=float, default=0.05, help="fraction of prompts held out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-dtype", choices=("float16", "float32"), default="float16")
    args = p.parse_args(argv)
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.error(f"--lr must be a finite number > 0, got {args.lr}")
    seeds = args.model_seeds
    if seeds is not None and len(set(seeds)) != len(seeds):
        p.error(f"--model-seeds {' '.join(map(str, seeds))}: each seed once")
    tc = distill_config(p, args, warmup=100)
    return run_distill(
        p, args, lambda log: _distill(p, args, argv, tc, log), lambda s: f"held-out {s['heldout']}"
    )


def _source_data(target, tokenizer, key: dict, messages, args, log):
    """(pairs [[prompt ids, answer ids]], hidden states per sequence) of one prompt source,
    from its cache or made (``messages()`` gives the user messages) and cached."""
    cache = cache_dir(key, "pallas_attn_eagle")
    pairs_file = os.path.join(cache, "pairs.json")
    if os.path.isfile(pairs_file):
        log(f"continuations from the cache {cache}")
        with open(pairs_file) as f:
            pairs = json.load(f)
    else:
        msgs = messages()
        pairs = self_distill_data(
            target,
            tokenizer,
            msgs,
            max_new_tokens=args.max_new_tokens,
            temperatures=args.temperatures,
            batch=min(args.gen_batch, len(msgs)),
            seed=args.seed,
            log=log,
        )
        pairs = [[list(map(int, a)), list(map(int, c))] for a, c in pairs]
        with deferred_interrupts():
            os.makedirs(cache, exist_ok=True)
            with open(pairs_file + ".tmp", "w") as f:
                json.dump(pairs, f)
            os.replace(pairs_file + ".tmp", pairs_file)
    seqs = [a + c for a, c in pairs]
    feat_file = os.path.join(cache, "hidden.npz")
    if os.path.isfile(feat_file):
        with np.load(feat_file) as z:
            flat, offsets = z["h"], z["offsets"]
        return pairs, [flat[offsets[i] : offsets[i + 1]] for i in range(len(seqs))]
    feats = sequence_features(target, seqs, log=log)
    offsets = np.cumsum([0] + [len(x) for x in seqs])
    with deferred_interrupts():
        np.savez(feat_file + ".tmp.npz", h=np.concatenate(feats), offsets=offsets)
        os.replace(feat_file + ".tmp.npz", feat_file)
    return pairs, feats


def _distill(p, args, argv, tc, log) -> dict:
    t0 = time.perf_counter()
    try:
        target, tokenizer = pretrained(args.target)
    except (OSError, ValueError) as e:
        p.error(f"--target {args.target}: {e}")
    if tokenizer.chat_template is None:
        p.error(f"--target {args.target}: the model has no chat template to format prompts with")
    if args.max_new_tokens >= target.config.max_position:
        p.error(
            f"--max-new-tokens {args.max_new_tokens}: the target holds "
            f"{target.config.max_position} tokens, prompt included"
        )
    common = dict(target=args.target, max_new=args.max_new_tokens, temps=args.temperatures)
    common.update(seed=args.seed)
    model_seeds = [args.seed] if args.model_seeds is None else args.model_seeds
    sources = [("tasks", args.prompts, args.seed)] + [
        ("model", args.model_prompts, s) for s in model_seeds if args.model_prompts > 0
    ]
    seqs, plens, feats, train, test = [], [], [], [], []
    for source, count, seed in sources:
        key = dict(common, prompts=count)
        if source == "model":
            key["source"] = "model"  # the task prompts' cache keeps its original key
            if seed != args.seed:
                key["model_seed"] = seed

        earlier = frozenset(tuple(s[:n]) for s, n in zip(seqs, plens, strict=True))

        def messages(source=source, count=count, seed=seed, earlier=earlier):
            if source == "tasks":
                return distill_prompts(count, args.seed)
            return model_prompts(target, tokenizer, count, seed=seed, exclude=earlier, log=log)

        pairs, fs = _source_data(target, tokenizer, key, messages, args, log)
        # Held out by message: the last of each source, every temperature; evaluated on the
        # greedy answers.
        n_held = int(round(args.heldout * count))
        for i, (a, c) in enumerate(pairs):
            j = len(seqs)
            seqs.append(a + c)
            plens.append(len(a))
            feats.append(fs[i])
            if i % count < count - n_held:
                train.append(j)
            elif i < count and args.temperatures[0] == 0:
                test.append(j)
    heldout = ([seqs[i] for i in test], [plens[i] for i in test], [feats[i] for i in test])
    log(
        f"{len(train)} training sequences ({sum(len(seqs[i]) for i in train)} tokens), "
        f"{len(test)} held-out greedy answers"
    )
    head, summary = train_eagle(
        target,
        [seqs[i] for i in train],
        [plens[i] for i in train],
        [feats[i] for i in train],
        tc,
        heldout=heldout if test else None,
        draft_vocab=args.draft_vocab,
        feature_weight=args.feature_weight,
        noise=args.noise,
        depth=args.depth,
        init=None if args.init is None else load_eagle(args.init, target.config),
        log=log,
    )
    command = " ".join(["python -m models.eagle_train", *(sys.argv[1:] if argv is None else argv)])
    summary.update(
        command=command, base_model=args.target, total_seconds=round(time.perf_counter() - t0, 1)
    )
    extra = dict(base_model=args.target)
    write_summary(
        args.out, summary, lambda: save_eagle(head, args.out, extra=extra, dtype=args.save_dtype)
    )
    return summary


if __name__ == "__main__":
    sys.exit(main())
