import json
import math

import numpy as np
import pytest
from flax import nnx

from models import Transformer, TransformerConfig, data, evaluate
from models.evaluate import SEQ_LEN, WINDOWS, heldout_bits_per_byte


def test_untrained_model_scores_about_uniform():
    """A fresh model (logits ~ 0) predicts ~uniformly over V ids: log2(V) bits per byte."""
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 256, size=WINDOWS * SEQ_LEN).astype(np.uint16)
    corpus = data.Corpus(train=stream, heldout=stream)
    config = TransformerConfig.preset("tiny", attn_impl="xla")
    bpb = heldout_bits_per_byte(Transformer(config, rngs=nnx.Rngs(0)), corpus)
    assert abs(bpb - math.log2(config.vocab_size)) < 0.05, bpb


def test_cli_bad_flags_and_lying_checkpoints_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(["code-draft", "--attn-impl", "fast"])
    assert exit_info.value.code == 2 and "--attn-impl" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main([str(tmp_path / "missing")])
    assert exit_info.value.code == 2 and "models" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"num_attention_heads": 0}))
    (bad / "model.safetensors").write_bytes(b"")
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main([str(bad)])
    assert exit_info.value.code == 2 and "bad" in capsys.readouterr().err
