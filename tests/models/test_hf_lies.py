"""Checkpoints that lie: every malformed ``config.json`` value, index or tensor is a ValueError
naming the checkpoint and the field, raised before a model is built."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from models import Transformer, TransformerConfig, load_hf_checkpoint
from models.hf import save_hf_checkpoint


@pytest.fixture()
def checkpoint(tmp_path):
    save_hf_checkpoint(
        Transformer(TransformerConfig.preset("tiny"), rngs=nnx.Rngs(0)), str(tmp_path)
    )
    return tmp_path


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(tie_word_embeddings="false"), "tie_word_embeddings must be true or false"),
        (dict(rms_norm_eps=None), "rms_norm_eps must be a positive number"),
        (dict(rms_norm_eps=-1e-6), "rms_norm_eps must be a positive number"),
        (dict(rope_parameters={"rope_theta": "10000"}), "rope_theta must be a positive number"),
        (dict(num_attention_heads=0), "num_attention_heads must be a positive int"),
        (dict(hidden_size=64.0), "hidden_size must be a positive int"),
        (dict(max_position_embeddings=True), "max_position_embeddings must be a positive int"),
        (dict(bos_token_id=[]), "bos_token_id must be an int or a non-empty list"),
        (dict(eos_token_id="2"), "eos_token_id must be a non-negative int"),
        (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "llama3 lacks"),
    ],
)
def test_malformed_config_values_are_named(checkpoint, changes, match):
    _edit_config(checkpoint, **changes)
    with pytest.raises(ValueError, match=f"checkpoint {checkpoint}: .*{match}"):
        load_hf_checkpoint(str(checkpoint))


def test_a_config_claiming_10000_layers_fails_before_building(checkpoint):
    _edit_config(checkpoint, num_hidden_layers=10_000)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="the config has 10000 layers, the tensors 2"):
        load_hf_checkpoint(str(checkpoint))
    assert time.perf_counter() - t0 < 30


def _tensors(path):
    return safetensors.numpy.load_file(str(path / "model.safetensors"))


def test_a_sharded_index_without_its_map(checkpoint):
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match="no weight_map"):
        load_hf_checkpoint(str(checkpoint))


def test_an_index_cannot_name_files_outside_the_checkpoint(checkpoint):
    index = {"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        load_hf_checkpoint(str(checkpoint))


@pytest.mark.parametrize(
    "value, match",
    [(np.int32, "is int32, not floating point"), (np.nan, "NaN or infinite")],
    ids=["int", "nan"],
)
def test_bad_tensors_are_refused(checkpoint, value, match):
    tensors = _tensors(checkpoint)
    w = tensors["model.norm.weight"]
    tensors["model.norm.weight"] = w.astype(value) if value is np.int32 else np.full_like(w, value)
    safetensors.numpy.save_file(tensors, str(checkpoint / "model.safetensors"))
    with pytest.raises(ValueError, match=f"model.norm.weight.*{match}|{match}"):
        load_hf_checkpoint(str(checkpoint))


def test_a_checkpoint_of_another_model_gets_a_short_message(checkpoint):
    tensors = {f"transformer.h.{i}.w": np.zeros(4, np.float32) for i in range(300)}
    tensors.update({k: v for k, v in _tensors(checkpoint).items() if "layers" in k})
    safetensors.numpy.save_file(tensors, str(checkpoint / "model.safetensors"))
    with pytest.raises(ValueError, match="and 29[0-9] more") as err:
        load_hf_checkpoint(str(checkpoint))
    assert len(str(err.value)) < 600
