import math

import numpy as np
from flax import nnx

from models import Transformer, TransformerConfig, data
from models.evaluate import SEQ_LEN, WINDOWS, heldout_bits_per_byte


def test_untrained_model_scores_about_uniform():
    """A fresh model (logits ~ 0) predicts ~uniformly over V ids: log2(V) bits per byte."""
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 256, size=WINDOWS * SEQ_LEN).astype(np.uint16)
    corpus = data.Corpus(train=stream, heldout=stream)
    config = TransformerConfig.preset("tiny", attn_impl="xla")
    bpb = heldout_bits_per_byte(Transformer(config, rngs=nnx.Rngs(0)), corpus)
    assert abs(bpb - math.log2(config.vocab_size)) < 0.05, bpb
