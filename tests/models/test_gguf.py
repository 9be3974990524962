"""GGUF checkpoints: files written here from random weights for every tensor type, loaded by us and
by transformers' own GGUF loader (the oracle); the real SmolLM2 file; every malformed input."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from model_utils import jit_model

from decoding import generate
from models import Transformer, TransformerConfig
from models.config import RopeScaling
from models.gguf import TENSOR_TYPES, WRITE_TYPES, load_gguf, read_config, save_gguf, unpermute

transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

# Rows of 256 (a K-quant block) in every matrix, so that every type can hold every matrix.
CONFIG = TransformerConfig(
    vocab_size=320,
    dim=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    mlp_dim=512,
    rope_theta=10000.0,
    norm_eps=float(np.float32(1e-5)),
    max_position=256,
    bos_id=1,
    eos_id=2,
)
TOKENS = np.array([[1, 17, 250, 3, 99, 42, 7, 300, 5, 64, 11]], np.int32)


def random_model(config=CONFIG, seed=0) -> Transformer:
    model = Transformer(config, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        shape = var[...].shape
        scale = 0.08 if len(shape) == 2 else 0.2
        var.set_value(jnp.asarray(1.0 * (len(shape) == 1) + scale * rng.standard_normal(shape)))
    return model


# Where each block keeps its float16 scales (byte offsets): random bytes there are set to small
# finite values so that a random block dequantizes to weights of a sane size.
_F16_FIELDS = {
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}


def random_blocks(shape, qtype, rng) -> np.ndarray:
    """Random ``qtype`` blocks for a float matrix of ``shape`` (rows of whole blocks)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        scale = (rng.uniform(0.002, 0.01, raw.shape[:2])).astype(np.float16)
        raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(shape[0], -1)


def requantize(src, dst, qtype) -> None:
    """``src`` with every matrix replaced by random ``qtype`` blocks (types gguf cannot quantize
    to), metadata copied."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    rng = np.random.default_rng(1)
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))
        if len(shape) == 2:
            writer.add_tensor(t.name, random_blocks(shape, qtype, rng), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def transformers_logits(path, tokens) -> np.ndarray:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        return hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def gguf_file(tmp_path, qtype: str, config=CONFIG):
    path = tmp_path / f"model-{qtype}.gguf"
    if qtype in WRITE_TYPES:
        save_gguf(random_model(config), path, tensor_type=qtype)
    else:
        save_gguf(random_model(config), tmp_path / "f32.gguf")
        requantize(tmp_path / "f32.gguf", path, Q[qtype])
    return path


@pytest.mark.parametrize("qtype", [t.name for t in TENSOR_TYPES])
def test_every_tensor_type_matches_transformers(tmp_path, qtype):
    path = gguf_file(tmp_path, qtype)
    ours = np.asarray(jit_model(load_gguf(path, dtype=jnp.float32))(TOKENS))
    ref = transformers_logits(path, TOKENS)
    np.testing.assert_allclose(ours, ref, atol=2e-5 * np.abs(ref).max(), rtol=0)
    assert np.abs(ref).max() > 1.0  # weights of a size that makes the comparison mean something


@pytest.mark.parametrize(
    "overrides",
    [
        dict(qkv_bias=True),  # qwen2: biases, no Q/K permutation
        dict(tie_embeddings=True, num_kv_heads=4),
        dict(num_kv_heads=1, head_dim=128),  # MQA, head_dim != dim / heads
    ],
    ids=["qwen2", "tied-mha", "mqa-head-dim"],
)
def test_architectures_match_transformers(tmp_path, overrides):
    config = CONFIG.replace(**overrides)
    path = gguf_file(tmp_path, "F32", config)
    assert read_config(path).replace(dtype="float32") == config
    ours = np.asarray(jit_model(load_gguf(path))(TOKENS))
    np.testing.assert_allclose(ours, transformers_logits(path, TOKENS), atol=1e-4, rtol=0)


def test_f32_round_trip_is_exact(tmp_path):
    model = random_model()
    save_gguf(model, tmp_path / "m.gguf")
    back = load_gguf(tmp_path / "m.gguf")
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(nnx.state(model, nnx.Param)),
        nnx.to_flat_state(nnx.state(back, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


def test_llama3_rope_scaling_round_trips(tmp_path):
    scaling = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=64
    )
    config = CONFIG.replace(rope_scaling=scaling, rope_theta=500000.0)
    save_gguf(random_model(config), tmp_path / "m.gguf")
    got = read_config(tmp_path / "m.gguf")
    assert got.rope_scaling.factor == 8.0
    assert got.rope_scaling.low_freq_factor == pytest.approx(1.0, abs=1e-3)
    assert got.rope_scaling.high_freq_factor == pytest.approx(4.0, abs=1e-3)


def test_unpermute_inverts_llama_cpp_order():
    D, H = 8, 2
    w = np.arange(H * D * 3).reshape(H * D, 3)
    # llama.cpp's order: per head, rows (0, D/2, 1, D/2 + 1, ...).
    permuted = np.concatenate(
        [
            w[h * D : (h + 1) * D].reshape(2, D // 2, 3).swapaxes(0, 1).reshape(D, 3)
            for h in range(H)
        ]
    )
    np.testing.assert_array_equal(unpermute(permuted, H), w)


def test_bfloat16_load(tmp_path):
    path = gguf_file(tmp_path, "BF16")
    assert load_gguf(path).config.dtype == "bfloat16"  # the file's float type is the default
    assert load_gguf(path, dtype=jnp.float32).config.dtype == "float32"


def test_kv_dtype(tmp_path):
    model = random_model()
    save_gguf(model, tmp_path / "m.gguf")
    for quantized in (False, True):
        m = load_gguf(tmp_path / "m.gguf", quantized=quantized, kv_dtype=jnp.bfloat16)
        assert m.config.kv_dtype == "bfloat16" and m.config.dtype == "float32"
        assert all(layer.attn.config.kv_dtype == "bfloat16" for layer in m.layers)
    for bad in ("int8", "no-such-type"):
        with pytest.raises(ValueError, match="kv_dtype"):
            load_gguf(tmp_path / "m.gguf", kv_dtype=bad)


# ----------------------------------------------------------------------------- bad files


def _write(path, arch="llama", fields=(), tensors=None):
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in fields:
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    for name, (array, qtype) in (
        tensors or {"token_embd.weight": (np.zeros((4, 32), np.float32), Q.F32)}
    ).items():
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LLAMA_FIELDS = (
    ("llama.block_count", 1),
    ("llama.embedding_length", 32),
    ("llama.attention.head_count", 2),
    ("llama.feed_forward_length", 64),
    ("llama.context_length", 128),
)


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="no-such.gguf"):
        load_gguf("no-such.gguf")


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all, just some bytes" * 4)
    with pytest.raises(ValueError, match="x.gguf"):
        load_gguf(tmp_path / "x.gguf")


def test_unknown_architecture_is_named(tmp_path):
    path = _write(tmp_path / "a.gguf", arch="gptj", fields=LLAMA_FIELDS)
    with pytest.raises(ValueError, match="unsupported architecture 'gptj'"):
        load_gguf(path)


def test_unknown_tensor_type_is_named_before_reading(tmp_path):
    raw = np.zeros((4, 66), np.uint8)  # one IQ2_XXS block per row: not a type we read
    tensors = {"token_embd.weight": (raw, Q.IQ2_XXS)}
    path = _write(tmp_path / "t.gguf", fields=LLAMA_FIELDS, tensors=tensors)
    with pytest.raises(ValueError, match="unsupported tensor types \\['IQ2_XXS'\\]"):
        load_gguf(path)


def test_missing_metadata_is_named(tmp_path):
    path = _write(tmp_path / "m.gguf", fields=LLAMA_FIELDS[1:])
    with pytest.raises(ValueError, match="llama.block_count"):
        load_gguf(path)


def test_wrong_metadata_type_is_named(tmp_path):
    fields = (("llama.block_count", "thirty"), *LLAMA_FIELDS[1:])
    path = _write(tmp_path / "m.gguf", fields=fields)
    with pytest.raises(ValueError, match="llama.block_count must be int"):
        load_gguf(path)


def test_zero_heads_is_a_value_error(tmp_path):
    fields = (*LLAMA_FIELDS[:2], ("llama.attention.head_count", 0), *LLAMA_FIELDS[3:])
    with pytest.raises(
        ValueError, match="m.gguf: metadata llama.attention.head_count must be >= 1"
    ):
        load_gguf(_write(tmp_path / "m.gguf", fields=fields))


def test_missing_tensors_are_named(tmp_path):
    path = _write(tmp_path / "m.gguf", fields=LLAMA_FIELDS)
    with pytest.raises(ValueError, match="the config has 1 layers, the tensors 0"):
        load_gguf(path)


def test_unsupported_rope_scaling(tmp_path):
    fields = (*LLAMA_FIELDS, ("llama.rope.scaling.type", "yarn"))
    with pytest.raises(ValueError, match="RoPE scaling type 'yarn'"):
        load_gguf(_write(tmp_path / "m.gguf", fields=fields))


def test_save_rejects_what_gguf_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match="tensor_type"):
        save_gguf(random_model(), tmp_path / "m.gguf", tensor_type="Q4_K")
    with pytest.raises(ValueError, match="sliding window"):
        save_gguf(random_model(CONFIG.replace(sliding_window=8)), tmp_path / "m.gguf")


# ----------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return load_gguf(smollm2_gguf), hf.eval()


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Rename the variable x to count: def f(x): return x + 1",
]


@pytest.fixture(scope="module")
def chat_prompts(smollm2_gguf):
    """Chat prompts as token ids from transformers' tokenizer (the tokenizer has its own tests)."""
    tok = transformers.AutoTokenizer.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name
    )
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for q in QUESTIONS
    ]


def test_smollm2_config(smollm2_gguf):
    c = read_config(smollm2_gguf)
    assert (c.num_layers, c.dim, c.num_heads, c.num_kv_heads, c.resolved_head_dim) == (
        30,
        576,
        9,
        3,
        64,
    )
    assert (c.vocab_size, c.mlp_dim, c.rope_theta, c.max_position) == (49152, 1536, 100000.0, 8192)
    assert c.tie_embeddings and (c.bos_id, c.eos_id) == (1, 2)


def test_smollm2_logits_match_transformers(smollm2, chat_prompts):
    ours, hf = smollm2
    tokens = np.array([chat_prompts[0]], np.int32)
    got = np.asarray(jit_model(ours)(tokens))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()


def test_smollm2_greedy_chat_matches_transformers(smollm2, chat_prompts):
    ours, hf = smollm2
    res = generate(ours, chat_prompts, max_new_tokens=64)
    for prompt, got in zip(chat_prompts, res.tokens, strict=True):
        ids = torch.tensor([prompt])
        with (
            torch.no_grad()
        ):  # an explicit mask: transformers would mask the prompt's pad (= EOS) ids
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=64,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
        assert got == out[0, len(prompt) :].tolist()
