"""What the training and evaluation command lines (``models.train``, ``models.medusa_train``,
``models.evaluate``) share: an output directory checked before any work, and a Ctrl-C that
stops them quietly, exit 130, never a traceback and never a half-written checkpoint."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from models.interrupts import deferred_interrupts

if TYPE_CHECKING:  # annotations only
    from models.data import Corpus
    from models.train_step import TrainConfig

# The shell's status for a process stopped by SIGINT (128 + 2).
EXIT_INTERRUPTED = 130


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C inside a training loop after ``step`` of ``steps`` steps had been run."""

    def __init__(self, step: int, steps: int):
        super().__init__(f"interrupted at step {step} of {steps}")
        self.step, self.steps = step, steps


def output_dir(text: str) -> str:
    """An ``argparse`` type: a directory that exists and is writable, or can be created (its
    nearest existing parent is a writable directory). Nothing is created here."""
    if not text:
        raise argparse.ArgumentTypeError("expected a directory, got ''")
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not writable ({parent!r} is not)")
    return text


def write_summary(out: str, summary: dict, save=None) -> None:
    """``save()`` (the checkpoint into ``out``; None: already saved) and then
    ``out/training.json`` holding ``summary``, Ctrl-C deferred across both: never half a
    checkpoint, nor one without its summary."""
    with deferred_interrupts():
        if save is not None:
            save()
        with open(os.path.join(out, "training.json"), "w") as f:
            json.dump(summary, f, indent=2)
            f.write("\n")


def windows_problem(corpus: Corpus, tc: TrainConfig) -> str | None:
    """``None`` when ``corpus`` holds the windows of a run of ``tc``, else a message naming
    the flags: each split needs one window of ``seq_len + 1`` tokens and a start
    (``models.data.random_batch``), and the ``eval_batches * batch`` evenly spaced held-out
    windows must not exceed the held-out stream (past it they only repeat it, and fill memory:
    ``models.data.heldout_batches`` builds them all at once)."""
    train, heldout = corpus.train.size, corpus.heldout.size
    batch, seq_len, eval_batches = tc.batch, tc.seq_len, tc.eval_batches
    if min(train, heldout) < seq_len + 2:
        return f"--seq-len {seq_len}: the corpus has {train:,} train / {heldout:,} held-out tokens"
    if batch * eval_batches * seq_len > heldout:
        return (
            f"--eval-batches {eval_batches} x --batch {batch} x --seq-len {seq_len} tokens "
            f"exceed the {heldout:,} held-out tokens"
        )
    return None


def report_interrupt(error: KeyboardInterrupt, saved: str) -> int:
    """Prints one line to stderr: where a Ctrl-C stopped the run (the step, for
    :class:`Interrupted`) and ``saved``, what was written (e.g. "nothing saved to DIR");
    returns :data:`EXIT_INTERRUPTED`."""
    where = str(error) if isinstance(error, Interrupted) else "interrupted"
    print(f"\n{where}: {saved}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED
