"""Held-out bits per byte of shipped models or checkpoints on one fixed evaluation set.

    python -m models.evaluate code-target code-draft path/to/checkpoint

The set: 128 evenly spaced 256-byte windows of the held-out standard-library files (see
``models.data``), byte targets only, packed documents separated by segment ids. One line per
model, printed as each is measured; Ctrl-C stops quietly (exit 130) with those lines kept.
"""

from __future__ import annotations

import argparse
import sys

from flax import nnx

from models import data
from models.cli import report_interrupt
from models.pretrained import SHIPPED, checkpoint_arg, load_model
from models.train import bits_per_byte, make_eval
from models.transformer import Transformer
from pallas_attn import IMPLS

WINDOWS, SEQ_LEN, BATCH = 128, 256, 16


def heldout_bits_per_byte(model: Transformer, corpus: data.Corpus) -> float:
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batches = data.heldout_batches(corpus.heldout, BATCH, SEQ_LEN, WINDOWS // BATCH)
    return bits_per_byte(make_eval(graphdef), params, rest, batches)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "models",
        nargs="+",
        type=checkpoint_arg,
        help=f"shipped names {SHIPPED} or checkpoint directories",
    )
    p.add_argument("--attn-impl", default="auto", choices=IMPLS)
    args = p.parse_args(argv)
    try:
        print(f"held-out bits per byte of {len(args.models)} model(s)", flush=True)
        corpus = data.Corpus.from_stdlib()
        for name in args.models:
            try:
                model = load_model(name, attn_impl=args.attn_impl)
            except ValueError as e:  # a checkpoint that lies (models.hf): a usage error, exit 2
                p.error(f"models: {e}")
            bpb = heldout_bits_per_byte(model, corpus)
            print(f"{name}: {model.config.num_params():,} params, {bpb:.4f} bits/byte", flush=True)
    except KeyboardInterrupt as e:
        return report_interrupt(e, "the lines above are complete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
