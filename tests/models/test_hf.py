"""Parity with ``transformers`` (torch CPU) on random small models, and exact round trips."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_utils import jit_model

from models import Transformer, TransformerConfig
from models.hf import config_from_hf, config_to_hf, load_hf_checkpoint, save_hf_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

_SMALL = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)

CASES = {
    "llama-gqa-untied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha-tied": (
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    ),
    "llama3-rope-scaling": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    "mistral-window": (
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=7),
    ),
    "qwen2-bias-tied": (
        "Qwen2Config",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ),
}


def _hf_model(case, tmp_path):
    cls_name, extra = CASES[case]
    config = getattr(transformers, cls_name)(**_SMALL, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    arch = {"LlamaConfig": "LlamaForCausalLM", "MistralConfig": "MistralForCausalLM"}
    model_cls = getattr(transformers, arch.get(cls_name, "Qwen2ForCausalLM"))
    model = model_cls(config).eval()
    with torch.no_grad():  # random (not default-initialised) norms and biases
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    hf_model = _hf_model(case, tmp_path)
    model = load_hf_checkpoint(str(tmp_path), attn_impl="xla")
    assert model.config.tie_embeddings == bool(CASES[case][1].get("tie_word_embeddings"))
    T = 40  # longer than the Mistral window (7) and than llama3's original_max_position (32)
    tokens = np.random.default_rng(0).integers(0, 97, size=(2, T))
    with torch.no_grad():
        expected = hf_model(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(jit_model(model)(jnp.asarray(tokens, jnp.int32)))
    err = np.abs(got - expected).max() / np.abs(expected).max()
    assert err < 1e-4, err


def test_sliding_window_is_imported():
    hf = dict(architectures=["MistralForCausalLM"], sliding_window=7, **_SMALL)
    hf.update(num_attention_heads=4)
    from models.hf import config_from_hf

    assert config_from_hf(hf).window_size == (6, 0)


def _random_model(**overrides):
    config = TransformerConfig.preset("tiny", attn_impl="xla", **overrides)
    model = Transformer(config, rngs=nnx.Rngs(3))
    # Perturb every parameter (norm weights start at one, biases at zero).
    state = nnx.state(model, nnx.Param)
    keys = iter(jax.random.split(jax.random.key(4), len(jax.tree.leaves(state))))
    nnx.update(
        model, jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape), state)
    )
    return model


@pytest.mark.parametrize(
    "overrides", [{}, {"tie_embeddings": False, "sliding_window": 5}, {"qkv_bias": True}]
)
def test_round_trip_is_exact(overrides, tmp_path):
    model = _random_model(**overrides)
    save_hf_checkpoint(model, str(tmp_path))
    loaded = load_hf_checkpoint(str(tmp_path), attn_impl="xla")
    assert loaded.config == model.config
    for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)),
        jax.tree.leaves(nnx.state(loaded, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_bf16_export_is_loadable_by_transformers(tmp_path):
    model = _random_model()
    save_hf_checkpoint(model, str(tmp_path), dtype=jnp.bfloat16)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    loaded = load_hf_checkpoint(str(tmp_path), attn_impl="xla")
    tokens = np.random.default_rng(1).integers(0, 259, size=(1, 16))
    with torch.no_grad():
        expected = hf_model(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(jit_model(loaded)(jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(got, expected, atol=1e-4 * np.abs(expected).max())


def test_sharded_checkpoint(tmp_path):
    hf_model = _hf_model("llama-gqa-untied", tmp_path / "one")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    one = load_hf_checkpoint(str(tmp_path / "one"))
    sharded = load_hf_checkpoint(str(tmp_path / "sharded"))
    for a, b in zip(
        jax.tree.leaves(nnx.state(one)), jax.tree.leaves(nnx.state(sharded)), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_hf_checkpoint(str(tmp_path))


def test_softcap_cannot_be_exported(tmp_path):
    model = Transformer(TransformerConfig.preset("tiny", final_softcap=30.0), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="softcap"):
        save_hf_checkpoint(model, str(tmp_path))


@pytest.mark.parametrize(
    "overrides, model_type",
    [({}, "llama"), ({"sliding_window": 5}, "mistral"), ({"qkv_bias": True}, "qwen2")],
)
def test_model_type_stands_in_for_missing_architectures(overrides, model_type):
    config = TransformerConfig.preset("tiny", **overrides)
    hf = config_to_hf(config)
    del hf["architectures"]
    assert hf["model_type"] == model_type
    assert config_from_hf(hf) == config


_LLAMA = config_to_hf(TransformerConfig.preset("tiny"))


@pytest.mark.parametrize(
    "files, error, match",
    [
        (None, FileNotFoundError, "does not exist"),
        ({}, FileNotFoundError, "no config.json"),
        ({"config.json": "{not json"}, ValueError, "config.json is not valid JSON"),
        ({"config.json": "[1, 2]"}, ValueError, "JSON object"),
        ({"config.json": '{"model_type": "gpt2"}'}, ValueError, "model_type 'gpt2'"),
        ({"config.json": '{"architectures": ["LlamaForCausalLM"]}'}, ValueError, "hidden_size"),
        ({"config.json": json.dumps(_LLAMA)}, FileNotFoundError, "no model.safetensors"),
        (
            {"config.json": json.dumps(_LLAMA), "model.safetensors": "junk"},
            ValueError,
            "model.safetensors is not a readable safetensors file",
        ),
    ],
)
def test_unreadable_checkpoints_say_what_is_wrong(files, error, match, tmp_path):
    path = tmp_path / "ckpt"
    if files is not None:
        path.mkdir()
        for name, text in files.items():
            (path / name).write_text(text)
    with pytest.raises(error, match=match):
        load_hf_checkpoint(str(path))
