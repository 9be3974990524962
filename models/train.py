"""Training with optax: AdamW, linear warmup + cosine decay, global-norm clipping, packed sequences.

The train step (``models.train_step``) is one ``jax.jit`` over (params, optimizer state, batch)
with the buffers donated; attention goes through ``pallas_attn.flash_attention`` (its custom
VJP) with segment ids, so packed documents never attend to each other. Every ``eval_every``
steps the held-out loss is measured on fixed windows and reported as bits per byte. The result
is written as a Hugging Face checkpoint.

    python -m models.train --preset code-draft --steps 600 --out models/shipped/code-draft
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from models import data
from models.cli import (
    Interrupted,
    output_dir,
    report_interrupt,
    windows_problem,
    write_summary,
)
from models.config import TransformerConfig
from models.hf import load_hf_checkpoint, save_hf_checkpoint
from models.interrupts import deferred_interrupts
from models.medusa_train import main_medusa
from models.pretrained import checkpoint_arg, load_model
from models.sharding import make_train_step as make_sharded_step
from models.sharding import mesh_shape, put_global, to_host
from models.sharding import shard as shard_model
from models.tokenizer import ByteTokenizer
from models.train_step import (
    TrainConfig,
    distill_loss_fn,
    loss_fn,
    make_train_step,
    optimizer,
    schedule,
    token_losses,
)
from models.transformer import Transformer
from pallas_attn import IMPLS

__all__ = [  # the step's pieces are re-exported from models.train_step: users look for them here
    "TrainConfig",
    "bits_per_byte",
    "distill_loss_fn",
    "loss_fn",
    "main",
    "make_eval",
    "make_train_step",
    "optimizer",
    "schedule",
    "token_losses",
    "train",
]


def make_eval(graphdef):
    """``evaluate(params, rest, batch) -> (nll_sum, byte_count)`` over byte targets (< 256)."""

    @jax.jit
    def evaluate(params, rest, batch):
        inputs, targets, segment_ids, weights = batch
        model = nnx.merge(graphdef, params, rest)
        w = weights * (targets < 256)
        return jnp.sum(token_losses(model, inputs, targets, segment_ids) * w), jnp.sum(w)

    return evaluate


def bits_per_byte(evaluate, params, rest, batches) -> float:
    nll, count = 0.0, 0.0
    for batch in batches:
        n, c = to_host(evaluate(params, rest, batch))  # on every process
        nll, count = nll + float(n), count + float(c)
    return nll / count / math.log(2)


def train(
    config: TransformerConfig,
    corpus: data.Corpus,
    tc: TrainConfig,
    *,
    log=print,
    progress: bool = True,
    init: Transformer | None = None,
    teacher: Transformer | None = None,
    mesh: jax.sharding.Mesh | None = None,
) -> tuple[Transformer, dict]:
    """Trains ``init`` (or a fresh ``Transformer(config)``) on ``corpus``; returns the trained
    model and a summary dict. With ``teacher`` (same vocabulary) the loss is the KL to the
    teacher's distributions (:func:`distill_loss_fn`) instead of the cross entropy.

    With ``mesh`` the model is sharded over it (``models.shard``; data + tensor parallel, the
    batch a multiple of its "data" axis) and trained by the sharded step; the mesh may span
    processes, each running this same call (``python -m decoding.launch``). Not with a teacher.
    """
    model = init if init is not None else Transformer(config, rngs=nnx.Rngs(tc.seed))
    tx = optimizer(tc)
    t_graphdef, t_state = nnx.split(teacher) if teacher is not None else (None, None)
    held = data.heldout_batches(corpus.heldout, tc.batch, tc.seq_len, tc.eval_batches)
    if mesh is None:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        opt_state = tx.init(params)
        step_fn = make_train_step(graphdef, tx, teacher_graphdef=t_graphdef)
    else:
        if teacher is not None:
            raise ValueError("mesh: distillation (teacher) is not sharded; train without mesh")
        model = shard_model(model, mesh)
        sharded_step, sh = make_sharded_step(model, tx)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        opt_state = jax.jit(tx.init, out_shardings=sh.opt_state)(params)

        def step_fn(params, rest, opt_state, batch, teacher, temperature):
            return sharded_step(params, rest, opt_state, batch)

        held = [tuple(put_global(x, sh.batch) for x in b) for b in held]
    evaluate = make_eval(graphdef)
    rng = np.random.default_rng(tc.seed)
    history = []
    start = time.perf_counter()
    bar = tqdm(range(1, tc.steps + 1), disable=not progress, mininterval=5.0)
    done = 0
    try:
        for i in bar:
            batch = data.random_batch(corpus.train, rng, tc.batch, tc.seq_len)
            params, opt_state, loss = step_fn(
                params, rest, opt_state, batch, t_state, temperature=tc.distill_temperature
            )
            done = i
            if i % tc.eval_every == 0 or i == tc.steps:
                bpb = bits_per_byte(evaluate, params, rest, held)
                loss = float(loss)
                elapsed = time.perf_counter() - start
                history.append(dict(step=i, train_loss=loss, heldout_bpb=bpb, seconds=elapsed))
                bar.set_postfix(loss=f"{loss:.3f}", bpb=f"{bpb:.3f}")
                log(
                    f"step {i}: train loss {loss:.4f} nats, held-out {bpb:.4f} bits/byte, "
                    f"{elapsed:.0f}s"
                )
    except KeyboardInterrupt:  # the caller gets no model: a run cut short is not saved
        bar.close()
        raise Interrupted(done, tc.steps) from None
    nnx.update(model, params)
    summary = dict(
        params=config.num_params(),
        tokens_seen=tc.steps * tc.batch * tc.seq_len,
        wall_seconds=round(time.perf_counter() - start, 1),
        heldout_bpb=history[-1]["heldout_bpb"] if history else None,
        history=history,
        train_config=dataclasses.asdict(tc),
        corpus_bytes=dict(train=int(corpus.train.size), heldout=int(corpus.heldout.size)),
    )
    return model, summary


def _starting_models(args, config: TransformerConfig):
    """(``--init`` model or None, ``--distill-from`` teacher or None), checked against config."""
    init = teacher = None
    if args.init is not None:
        init = load_model(args.init, attn_impl=args.attn_impl)
        if init.config.replace(attn_impl=config.attn_impl) != config:
            raise ValueError(f"--init {args.init} does not match preset {args.preset!r}")
    if args.distill_from is not None:
        teacher = load_model(args.distill_from, attn_impl=args.attn_impl)
        if teacher.config.vocab_size != config.vocab_size:
            raise ValueError(
                f"--distill-from {args.distill_from} has vocab_size {teacher.config.vocab_size}, "
                f"preset {args.preset!r} has {config.vocab_size}"
            )
    return init, teacher


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=None, help="TransformerConfig preset name (required)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument(
        "--out", required=True, type=output_dir, help="output directory (Hugging Face format)"
    )
    defaults = TrainConfig()
    for field in dataclasses.fields(TrainConfig):
        if field.name != "steps":
            flag = "--" + field.name.replace("_", "-")
            p.add_argument(flag, type=type(getattr(defaults, field.name)), default=None)
    p.add_argument("--attn-impl", default="auto", choices=IMPLS)
    p.add_argument(
        "--init",
        default=None,
        type=checkpoint_arg,
        help="start from this shipped model or HF checkpoint directory (same preset)",
    )
    p.add_argument(
        "--distill-from",
        default=None,
        type=checkpoint_arg,
        help="a shipped model or HF checkpoint: train on the KL to its distributions",
    )
    p.add_argument(
        "--medusa-heads",
        type=int,
        default=None,
        help="train this many Medusa heads on the frozen --init model (a shipped name or HF "
        "checkpoint) instead of a model; --preset not needed",
    )
    p.add_argument(
        "--mesh",
        type=mesh_shape,
        default=None,
        metavar="DATA,MODEL",
        help="shard over a (data, model) mesh of all devices (all processes under "
        "python -m decoding.launch); process 0 writes --out",
    )
    p.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--max-corpus-bytes", type=int, default=None)
    args = p.parse_args(argv)
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TrainConfig)
        if getattr(args, f.name, None) is not None
    }
    # Every flag is checked here, before the corpus, a model or a step: a run that cannot
    # finish (or save) fails at once with a usage error (exit 2) naming the flag.
    try:
        tc = TrainConfig(**overrides)
    except ValueError as e:
        p.error(f"--{str(e).replace('_', '-')}")
    for flag in ("max_corpus_bytes", "medusa_heads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.mesh is not None:
        if math.prod(args.mesh) != jax.device_count():
            p.error(f"--mesh {args.mesh} must hold all {jax.device_count()} devices")
        if args.medusa_heads is not None or args.distill_from is not None:
            p.error("--mesh trains a model: not with --medusa-heads or --distill-from")
        if tc.batch % args.mesh[0]:
            p.error(f"--batch ({tc.batch}) must be a multiple of the --mesh data axis")
    if args.medusa_heads is not None:
        if args.init is None:
            p.error("--medusa-heads needs --init (the frozen target: a shipped name or a path)")
        return main_medusa(args, tc, argv, error=p.error)
    if args.preset is None:
        p.error("--preset is required (unless --medusa-heads)")
    try:
        config = TransformerConfig.preset(args.preset, attn_impl=args.attn_impl)
    except ValueError as e:
        p.error(f"--preset: {e}")
    if tc.seq_len > config.max_position:
        p.error(f"--seq-len {tc.seq_len} is longer than {args.preset}'s {config.max_position}")
    saved = f"nothing saved to {args.out}"
    try:
        try:
            init, teacher = _starting_models(args, config)
        except ValueError as e:  # a checkpoint that lies, or one of another preset
            p.error(str(e))
        corpus = data.Corpus.from_stdlib(max_bytes=args.max_corpus_bytes)
        problem = windows_problem(corpus, tc)
        if problem is not None:
            p.error(problem)
        print(
            f"{args.preset}: {config.num_params():,} params; corpus {corpus.train.size:,} train "
            f"/ {corpus.heldout.size:,} held-out tokens; {jax.devices()[0].platform}",
            flush=True,
        )
        mesh = None if args.mesh is None else jax.make_mesh(args.mesh, ("data", "model"))
        model, summary = train(
            config,
            corpus,
            tc,
            log=lambda s: print(s, flush=True),
            init=init,
            teacher=teacher,
            mesh=mesh,
        )
        if mesh is not None:
            nnx.update(model, to_host(nnx.state(model)))  # whole, on every process
            if jax.process_index() != 0:
                return 0  # process 0 writes the checkpoint
        with deferred_interrupts():  # never half a checkpoint
            save_hf_checkpoint(model, args.out, dtype=jnp.dtype(args.save_dtype))
        saved = f"{args.out} holds the trained weights, not yet its training.json"
        _write_summary(args, argv, corpus, tc, summary)
    except KeyboardInterrupt as e:
        return report_interrupt(e, saved)
    print(
        f"saved {args.out}: held-out {summary['shipped_heldout_bpb']:.4f} bits/byte "
        f"({args.save_dtype} weights), {summary['wall_seconds']:.0f}s",
        flush=True,
    )
    return 0


def _write_summary(args, argv, corpus: data.Corpus, tc: TrainConfig, summary: dict) -> None:
    """Measures the saved checkpoint and writes ``training.json`` beside it."""
    shipped = load_hf_checkpoint(args.out, attn_impl=args.attn_impl)
    graphdef, params, rest = nnx.split(shipped, nnx.Param, ...)
    held = data.heldout_batches(corpus.heldout, tc.batch, tc.seq_len, tc.eval_batches)
    summary["shipped_heldout_bpb"] = bits_per_byte(make_eval(graphdef), params, rest, held)
    summary.update(
        command=" ".join(["python -m models.train", *(sys.argv[1:] if argv is None else argv)]),
        preset=args.preset,
        init=args.init,
        distill_from=args.distill_from,
        save_dtype=args.save_dtype,
        tokenizer=repr(ByteTokenizer()),
    )
    write_summary(args.out, summary)


if __name__ == "__main__":
    sys.exit(main())
