"""GGUF checkpoints (llama.cpp's format) for the ``llama``, ``qwen2``, ``qwen3`` and ``gemma3``
architectures.

The file's header is parsed by :func:`models.gguf_metadata.read_gguf` (its tensors memory-mapped)
and its tensors are dequantized with ``gguf.quants`` (llama.cpp's own reference dequantizers)
into the requested dtype; files are written with ``gguf.GGUFWriter``. The file's metadata is
turned into the Hugging Face ``config.json`` dict that the same model would have, and the tensors
are renamed to Hugging Face's names, so :func:`models.hf.config_from_hf` and
:func:`models.hf.build_model` (one description per family) build the model for both formats.

The metadata becomes the ``config.json`` dict through one table of keys (:data:`_KEYS`) and the
family's entry in :data:`models.hf.FAMILIES`, which also says what llama.cpp's loader assumes
where its converter writes nothing (Gemma 3: the sliding / global layer pattern, the local RoPE
base, the attention scale) and how the converter changed the tensors:

* it permutes the rows of each ``llama`` Q and K projection so that RoPE pairs adjacent
  dimensions (``(2i, 2i + 1)``, GPT-J style) where Hugging Face pairs ``(i, i + D/2)`` (GPT-NeoX
  style); :func:`unpermute` undoes it. ``qwen2``, ``qwen3`` and ``gemma3`` files keep Hugging
  Face's order (llama.cpp runs them with NeoX RoPE);
* it stores Gemma's norm weights ``w`` (applied as ``1 + w``) as ``1 + w``; 1 is taken off again;
* Llama-3 RoPE scaling is stored as a ``rope_freqs`` tensor of per-frequency divisors; the
  :class:`~models.config.RopeScaling` that reproduces it is recovered from it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping

import gguf
import jax.numpy as jnp
import numpy as np

from models.config import RopeScaling, TransformerConfig, kv_dtype_name
from models.gguf_metadata import read_gguf
from models.hf import (
    FAMILIES,
    Family,
    build_model,
    config_from_hf,
    config_to_hf,
    family_of,
    hf_tensors,
)
from models.transformer import Transformer, configure, rope_frequencies

_Q = gguf.GGMLQuantizationType
# Tensor types read (each tested with a file written by the tests); the others are refused.
TENSOR_TYPES = tuple(
    _Q[name]
    for name in (
        "F32",
        "F16",
        "BF16",
        "Q8_0",
        "Q4_0",
        "Q4_1",
        "Q5_0",
        "Q5_1",
        "Q2_K",
        "Q3_K",
        "Q4_K",
        "Q5_K",
        "Q6_K",
        "IQ4_NL",
        "IQ4_XS",
    )
)
ARCHITECTURES = {f.gguf: f.architecture for f in FAMILIES.values() if f.gguf is not None}
_FAMILY = {f.gguf: f for f in FAMILIES.values() if f.gguf is not None}

# The one table of metadata keys: ``{arch}.KEY`` -> the config.json key it is (read and write).
_KEYS = {
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
    "attention.sliding_window": "sliding_window",
    "vocab_size": "vocab_size",
}

# GGUF tensor name (``blk.N.`` stripped) -> Hugging Face name (``model.layers.N.`` stripped).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's four norms: llama.cpp's ``ffn_norm`` is the pre-MLP norm everywhere, which Hugging Face
# Gemma calls ``pre_feedforward_layernorm`` (and Llama ``post_attention_layernorm``).
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"


def _layer_names(arch: str) -> dict[str, str]:
    return _GEMMA_LAYER_NAMES if arch == "gemma3" else _LAYER_NAMES


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of GGUF tensor ``name`` in a file of architecture ``arch``, or None
    for one the model has no use for."""
    if name in _NAMES:
        return _NAMES[name]
    blk, _, rest = name.partition(".")
    index, _, rest = rest.partition(".")
    names = _layer_names(arch)
    if blk == "blk" and index.isdigit() and rest in names:
        return f"model.layers.{index}.{names[rest]}"
    return None


def unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undoes llama.cpp's Q/K row permutation: w [H D, ...] with each head's rows ordered
    ``(D/2, 2)`` -> ``(2, D/2)`` (Hugging Face's rotate-half order)."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _open(path) -> gguf.GGUFReader:
    """``gguf``'s own reader, for the value types of fields to copy (slower than read_gguf)."""
    read_gguf(path)  # FileNotFoundError / ValueError naming the path for a bad file
    return gguf.GGUFReader(os.fspath(path))


class _Metadata:
    """Typed access to a GGUF file's key/value fields; ValueError naming the file and key."""

    def __init__(self, fields: dict, path: str):
        self.fields, self.path = fields, path

    def get(self, key: str, kind: type, default=None):
        if key not in self.fields:
            return default
        value = self.fields[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ValueError(f"{self.path}: metadata {key} must be {kind.__name__}, got {value!r}")
        return value

    def require(self, key: str, kind: type):
        value = self.get(key, kind)
        if value is None:
            raise ValueError(f"{self.path}: metadata lacks {key}")
        return value

    def count(self, key: str, default=None) -> int:
        """A positive int field (``default`` when absent, or required when that is None)."""
        value = self.require(key, int) if default is None else self.get(key, int, default)
        if value < 1:
            raise ValueError(f"{self.path}: metadata {key} must be >= 1, got {value}")
        return value


def _hf_config(meta: _Metadata, tensors: dict, vocab_rows: int) -> dict:
    """The Hugging Face ``config.json`` dict of a GGUF file, through :data:`_KEYS` and the
    family's :attr:`~models.hf.Family.gguf_defaults`."""
    arch = meta.require("general.architecture", str)
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{meta.path}: unsupported architecture {arch!r}; supported: {tuple(ARCHITECTURES)}"
        )
    family = _FAMILY[arch]
    a = lambda key: f"{arch}.{key}"  # noqa: E731
    heads = meta.count(a("attention.head_count"))
    dim = meta.count(a("embedding_length"))
    tokens = meta.fields.get("tokenizer.ggml.tokens")
    defaults = {
        "attention.head_count_kv": heads,
        "attention.key_length": max(dim // heads, 1),
        "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.freq_base": 10000.0,
        "context_length": 2048,
        "vocab_size": len(tokens) if tokens else max(vocab_rows, 1),
    }
    counts = {
        "embedding_length",
        "block_count",
        "feed_forward_length",
        "attention.head_count",
        "attention.head_count_kv",
        "attention.key_length",
        "vocab_size",
        "attention.sliding_window",
    }
    hf = {"architectures": [family.architecture], "model_type": family.model_type}
    for key, hf_key in _KEYS.items():
        if key in counts:
            if key == "attention.sliding_window" and arch != "gemma3":
                continue  # llama.cpp reads no window for the other architectures
            hf[hf_key] = meta.count(a(key), defaults.get(key))
        elif key == "context_length":
            hf[hf_key] = meta.get(a(key), int, defaults[key])
        else:
            hf[hf_key] = meta.get(a(key), float, defaults[key])
    head_dim = hf["head_dim"]
    value_dim = meta.count(a("attention.value_length"), head_dim)
    rope_dim = meta.count(a("rope.dimension_count"), head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise ValueError(
            f"{meta.path}: key length {head_dim}, value length {value_dim} and RoPE dimensions "
            f"{rope_dim} must be equal (partial rotary and distinct value heads are unsupported)"
        )
    scaling = meta.get(a("rope.scaling.type"), str, "none")
    if scaling == "linear":
        factor = meta.get(a("rope.scaling.factor"), float)
        if factor is None:
            raise ValueError(f"{meta.path}: linear RoPE scaling without {a('rope.scaling.factor')}")
        hf["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif scaling != "none":
        raise ValueError(f"{meta.path}: unsupported RoPE scaling type {scaling!r}")
    hf.update(
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id", int),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id", int),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id", int),
    )
    if arch == "gemma3":
        hf.update(_gemma3_defaults(hf, family, meta))
    if ROPE_FREQS in tensors:
        original = meta.get(a("rope.scaling.original_context_length"), int, 8192)
        divisors = gguf.quants.dequantize(tensors[ROPE_FREQS].data, tensors[ROPE_FREQS].tensor_type)
        hf["rope_scaling"] = _llama3_scaling(np.ravel(divisors), hf, original, meta.path)
    return hf


def _gemma3_defaults(hf: dict, family: Family, meta: _Metadata) -> dict:
    """What llama.cpp's loader assumes for a ``gemma3`` file (its converter writes none of it):
    every 6th layer global, the others sliding (``set_swa_pattern(6)``), a local RoPE base of
    10000 unscaled (``rope_freq_base_train_swa``), and an attention scale of ``1 / sqrt(D)``,
    except ``1 / sqrt(dim / heads)`` for the 62-layer 27B model (``f_attention_scale``). The
    window itself is required, as llama.cpp requires it."""
    if "sliding_window" not in hf:
        raise ValueError(f"{meta.path}: metadata lacks gemma3.attention.sliding_window")
    n_layers = hf["num_hidden_layers"]
    scalar = hf["hidden_size"] // hf["num_attention_heads"] if n_layers == 62 else hf["head_dim"]
    return {**family.gguf_defaults, "query_pre_attn_scalar": scalar}


def _llama3_scaling(divisors: np.ndarray, hf: dict, original: int, path: str) -> dict:
    """The Llama-3 ``rope_scaling`` dict whose frequencies are ``inv_freq / divisors``.

    Llama-3 divides each inverse frequency by ``factor`` past the low-frequency wavelength,
    by 1 below the high-frequency one, and by ``1 / ((1 - s) / factor + s)`` in between, with
    ``s`` linear in ``original / wavelength``: two points of that band fix the two factors.
    """
    factor = float(divisors.max())
    theta, D = hf["rope_theta"], hf["head_dim"]
    inv_freq = 1.0 / theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
    band = (divisors > 1 + 1e-6) & (divisors < factor - 1e-6)
    low, high = 1.0, 4.0  # Llama 3's, when the band holds no frequency to fit them to
    if factor > 1 and band.sum() >= 2:
        s = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)
        x = original * inv_freq[band] / (2 * np.pi)  # original / wavelength
        slope, intercept = np.polyfit(x, s, 1)  # s = (x - low) / (high - low)
        low = -intercept / slope
        high = low + 1 / slope
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": round(float(low), 4),
        "high_freq_factor": round(float(high), 4),
        "original_max_position_embeddings": original,
    }
    config = TransformerConfig(
        vocab_size=1,
        dim=D,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        mlp_dim=1,
        rope_theta=theta,
        rope_scaling=RopeScaling(
            factor=factor,
            low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            original_max_position=original,
        ),
    )
    expected = inv_freq / divisors
    if not np.allclose(np.asarray(rope_frequencies(config)), expected, rtol=1e-4):
        raise ValueError(f"{path}: rope_freqs is not a Llama-3 RoPE scaling this model supports")
    return scaling


class _Tensors(Mapping):
    """The file's tensors under their Hugging Face names, dequantized (float32) on access."""

    def __init__(self, by_name: dict, hf: dict):
        family = FAMILIES[hf["model_type"]]
        names = {n: hf_name(n, family.gguf) for n in by_name}
        self._gguf = {h: by_name[n] for n, h in names.items() if h is not None}
        self._permute = family.permute_qk
        self._norm_shift = family.gguf_norm_shift
        self._heads = {"q_proj": hf["num_attention_heads"], "k_proj": hf["num_key_value_heads"]}

    def __getitem__(self, name: str) -> np.ndarray:
        t = self._gguf[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = w.reshape(t.shape)
        proj = name.split(".")[-2]
        if self._permute and proj in self._heads:
            w = unpermute(w, self._heads[proj])
        if self._norm_shift and name.endswith("norm.weight"):
            w = w - np.float32(self._norm_shift)
        return w

    def __iter__(self) -> Iterator[str]:
        return iter(self._gguf)

    def __len__(self) -> int:
        return len(self._gguf)


def read_config(path, *, dtype=None) -> TransformerConfig:
    """The :class:`TransformerConfig` of a GGUF file (see :func:`load_gguf`), no weight read."""
    return _prepare(path, dtype)[0]


def _default_dtype(by_name: dict):
    types = {t.tensor_type for t in by_name.values() if hf_name(t.name, "gemma3")}
    return jnp.bfloat16 if _Q.BF16 in types else jnp.float32


def _prepare(path, dtype):
    path = os.fspath(path)
    fields, by_name = read_gguf(path)
    bad = sorted(
        {t.tensor_type.name for t in by_name.values() if t.tensor_type not in TENSOR_TYPES}
    )
    if bad:
        supported = ", ".join(t.name for t in TENSOR_TYPES)
        raise ValueError(f"{path}: unsupported tensor types {bad}; supported: {supported}")
    meta = _Metadata(fields, path)
    embed = by_name.get("token_embd.weight")
    hf = _hf_config(meta, by_name, int(embed.shape[0]) if embed is not None else 0)
    dtype = _default_dtype(by_name) if dtype is None else dtype
    try:
        config = config_from_hf(hf, dtype=dtype)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
    return config, hf, by_name


def load_gguf(
    path, *, dtype=None, attn_impl: str = "auto", quantized: bool = False, kv_dtype=None
) -> Transformer:
    """A :class:`Transformer` from a GGUF file (``llama``, ``qwen2``, ``qwen3`` or ``gemma3``).

    Args:
      path: the ``.gguf`` file.
      dtype: the parameters' dtype. Default: bfloat16 for a file whose weights are BF16, else
        float32 (quantized and F16 weights are dequantized into it).
      attn_impl: the ``pallas_attn`` implementation of every attention call.
      quantized: keep the linear layers (and a tied LM head) block-quantized
        (:mod:`models.quant`): Q8_0, Q4_0 and Q4_1 tensors as the file's blocks, other types
        requantized to the nearest of those with a warning; ``dtype`` is then the activations'.
      kv_dtype: the KV cache's dtype (:class:`TransformerConfig`'s ``kv_dtype``; None = the
        activations'): "bfloat16" halves the cache a float32 or quantized model reads.

    The config comes from the file's metadata: layers, heads, KV heads, head dim, MLP width,
    vocabulary, RoPE base (and Llama-3 scaling from ``rope_freqs``, linear scaling), norm
    epsilon, context length, tied or separate output, special token ids, Gemma 3's window
    (and llama.cpp's defaults for what its files omit, see :func:`_gemma3_defaults`). Raises FileNotFoundError for a missing
    file and ValueError for an unreadable one, an unsupported architecture or tensor type (both
    named, before any weight is read), or tensors that do not match the metadata.
    """
    config, hf, by_name = _prepare(path, dtype)
    config = config.replace(attn_impl=attn_impl, kv_dtype=kv_dtype_name(kv_dtype))
    if quantized:  # blocks from the float32 weights: the file's blocks again (models.quant)
        from models import quant

        types = {name: t.tensor_type.name for name, t in by_name.items()}
        formats = quant.formats_from_gguf(types, tied=config.tie_embeddings)
        name = f"GGUF file {os.fspath(path)}"
        f32 = build_model(
            config.replace(dtype="float32", kv_dtype=None), _Tensors(by_name, hf), name
        )
        model = quant.quantize(f32, formats, dtype=config.jnp_dtype)
        return configure(model, kv_dtype=config.kv_dtype)
    return build_model(config, _Tensors(by_name, hf), f"GGUF file {os.fspath(path)}")


# Tensor types :func:`save_gguf` writes (those ``gguf.quants`` can quantize).
WRITE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
_GGUF_NAMES = {hf: g for g, hf in _NAMES.items()}


def gguf_name(name: str, arch: str = "llama") -> str:
    """Inverse of :func:`hf_name`."""
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    _, _, index, rest = name.split(".", 3)  # model.layers.N.rest
    inverse = {hf: g for g, hf in _layer_names(arch).items()}
    return f"blk.{index}.{inverse[rest]}"


def _copy_fields(writer: gguf.GGUFWriter, source: gguf.GGUFReader, prefix: str) -> None:
    """Copies the ``prefix*`` key/value fields of ``source`` (e.g. its tokenizer) into ``writer``."""
    for key, field in source.fields.items():
        if key.startswith(prefix):
            vtype = gguf.GGUFValueType(field.types[0])
            sub = gguf.GGUFValueType(field.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub)


def _gguf_family(c: TransformerConfig) -> Family:
    """The family ``c`` is written as; ValueError for what its GGUF architecture cannot hold."""
    family = family_of(c)
    if family.gguf is None or c.attn_softcap or c.final_softcap:
        raise ValueError(
            "a sliding window or softcap has no llama/qwen2/qwen3 GGUF equivalent (gemma3 "
            "files hold a window, in llama.cpp's fixed layer pattern)"
        )
    if (
        c.rope_scaling is not None
        and c.rope_scaling.rope_type == "linear"
        and family.gguf != "gemma3"
    ):
        raise ValueError("linear RoPE scaling is written for gemma3 files only")
    if family.gguf == "gemma3":
        # The file cannot say otherwise: what llama.cpp's loader assumes must be the model's.
        hf = config_to_hf(c)
        assumed = _gemma3_defaults(hf, family, _Metadata({}, "<model>"))
        pattern = family.gguf_defaults["sliding_window_pattern"]
        kinds = [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(c.num_layers)
        ]
        if (
            hf["layer_types"] != kinds
            or c.local_rope_theta != assumed["rope_local_base_freq"]
            or hf["query_pre_attn_scalar"] != assumed["query_pre_attn_scalar"]
        ):
            raise ValueError(
                "a gemma3 GGUF file cannot hold this model: llama.cpp assumes every "
                f"{pattern}th layer global, a local RoPE base of "
                f"{assumed['rope_local_base_freq']} and query_pre_attn_scalar "
                f"{assumed['query_pre_attn_scalar']}; the model has {hf['layer_types']}, "
                f"{c.local_rope_theta} and {hf['query_pre_attn_scalar']}"
            )
    return family


def save_gguf(model: Transformer, path, *, tensor_type: str = "F32", tokenizer_from=None) -> None:
    """Writes ``model`` as a GGUF file that :func:`load_gguf` and llama.cpp read.

    Args:
      tensor_type: the type of the matrices, one of :data:`WRITE_TYPES` (norms and biases are
        F32, as llama.cpp's converter writes them; a matrix whose rows are not a whole number of
        blocks is F16).
      tokenizer_from: a GGUF file whose ``tokenizer.*`` fields (vocabulary, merges, special
        ids, chat template) are copied, so that llama.cpp can run the file.

    The architecture is the model's family's (``llama``, ``qwen2``, ``qwen3``, ``gemma3``);
    written as llama.cpp's converter writes it (Q/K rows permuted for ``llama``, Gemma's norms as
    ``1 + w``, Llama-3 RoPE scaling as ``rope_freqs``). ValueError for a model its architecture
    cannot express (a sliding window outside gemma3, softcaps, a Gemma 3 whose layer pattern,
    local RoPE base or attention scale differ from what llama.cpp assumes) or an unknown type.
    """
    c = model.config
    if tensor_type not in WRITE_TYPES:
        raise ValueError(f"tensor_type must be one of {WRITE_TYPES}, got {tensor_type!r}")
    family = _gguf_family(c)
    arch = family.gguf
    hf = {**config_to_hf(c), "rope_theta": c.rope_theta}  # Gemma's dict nests its theta
    writer = gguf.GGUFWriter(os.fspath(path), arch)
    for key, hf_key in _KEYS.items():
        value = hf.get(hf_key)
        if value is None or (key == "attention.sliding_window" and arch != "gemma3"):
            continue
        if isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)
    D = c.resolved_head_dim
    writer.add_value_length(D)
    writer.add_rope_dimension_count(D)
    if c.rope_scaling is not None and c.rope_scaling.rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(c.rope_scaling.factor)
    elif c.rope_scaling is not None:
        writer.add_rope_scaling_orig_ctx_len(c.rope_scaling.original_max_position)
    if tokenizer_from is not None:
        _copy_fields(writer, _open(tokenizer_from), "tokenizer.")
    for key, value in (("bos", c.bos_id), ("eos", c.eos_id), ("padding", c.pad_id)):
        if value is not None and f"tokenizer.ggml.{key}_token_id" not in writer.kv_data[0]:
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
    qtype = _Q[tensor_type]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if c.rope_scaling is not None and c.rope_scaling.rope_type == "llama3":
        plain = rope_frequencies(c.replace(rope_scaling=None))
        divisors = np.asarray(plain / rope_frequencies(c), np.float32)
        writer.add_tensor(ROPE_FREQS, divisors, raw_dtype=_Q.F32)
    heads = {"q_proj": c.num_heads, "k_proj": c.num_kv_heads}
    for name, w in hf_tensors(model, jnp.float32).items():
        w = np.asarray(w, np.float32)
        if family.permute_qk and name.split(".")[-2] in heads:
            w = _permute(w, heads[name.split(".")[-2]])
        if family.gguf_norm_shift and name.endswith("norm.weight"):
            w = w + np.float32(family.gguf_norm_shift)
        kind = qtype if w.ndim == 2 else _Q.F32
        if kind != _Q.F32 and w.shape[-1] % block:
            kind = _Q.F16
        data = w if kind == _Q.F32 else gguf.quants.quantize(w, kind)
        writer.add_tensor(gguf_name(name, arch), data, raw_dtype=kind)  # shape from the bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order, the inverse of :func:`unpermute`."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )
