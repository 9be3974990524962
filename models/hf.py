"""Hugging Face checkpoints: ``config.json`` + ``model.safetensors`` (or sharded with
``model.safetensors.index.json``) for ``LlamaForCausalLM``, ``MistralForCausalLM`` and
``Qwen2ForCausalLM``, read and written without torch.

Hugging Face stores a linear layer's weight as ``[out, in]``; NNX ``Linear.kernel`` is ``[in, out]``,
so those tensors are transposed on the way in and out. The model's fused ``qkv_proj`` and
``gate_up_proj`` are assembled from (and split back into) HF's separate q/k/v and gate/up
tensors. Everything else maps one to one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.flax
from flax import nnx

from models.config import RopeScaling, TransformerConfig
from models.transformer import Transformer, fuse_gate_up, fuse_qkv, split_gate_up, split_qkv

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)


def _architecture(hf: dict) -> str:
    """``architectures[0]``, or when that list is absent the architecture ``model_type`` names
    (older and hand-written configs give only ``model_type``)."""
    archs = hf.get("architectures")
    if archs:
        arch = archs if isinstance(archs, str) else archs[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {ARCHITECTURES}")
        return arch
    by_type = {model_type: arch for arch, model_type in _MODEL_TYPE.items()}
    model_type = hf.get("model_type")
    if model_type not in by_type:
        raise ValueError(
            f"unsupported model: no architectures and model_type {model_type!r}; supported: "
            f"{ARCHITECTURES} or model_type in {tuple(by_type)}"
        )
    return by_type[model_type]


def _check_supported(hf: dict, arch: str) -> None:
    """ValueError for a missing required key or a feature the model does not have."""
    missing = [key for key in _REQUIRED if key not in hf]
    if missing:
        raise ValueError(f"config lacks required keys {missing}")
    for key in (*_REQUIRED, "num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = hf.get(key, 1)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{key} must be a positive int, got {value!r}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r} (only silu)")
    if hf.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=True")
    if arch != "Qwen2ForCausalLM" and hf.get("attention_bias"):
        raise ValueError("unsupported attention_bias=True (bias on o_proj)")


def _number(hf: dict, key: str, default: float) -> float:
    """``hf[key]`` as a positive finite float (``default`` when absent); ValueError naming it."""
    value = hf.get(key, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 0 < value < float("inf")
    ):
        raise ValueError(f"{key} must be a positive number, got {value!r}")
    return float(value)


def _flag(hf: dict, key: str) -> bool:
    value = hf.get(key, False)
    if not isinstance(value, bool):  # "false" is truthy: never guess
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def _token_id(hf: dict, key: str) -> int | None:
    """A special token id: an int, the first of a non-empty list of ints, or absent / null."""
    value = hf.get(key)
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{key} must be an int or a non-empty list of ints, got []")
        value = value[0]
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{key} must be a non-negative int, got {value!r}")
    return value


def _rope(hf: dict) -> tuple[float, RopeScaling | None]:
    """(theta, Llama-3 scaling or None) from ``rope_parameters`` or the legacy ``rope_scaling``."""
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = _number({"rope_theta": rope.get("rope_theta", hf.get("rope_theta", 10000.0))},
                    "rope_theta", 10000.0)  # fmt: skip
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r} (default or llama3)")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in rope]
    if missing:
        raise ValueError(f"rope_scaling of type llama3 lacks {missing}")
    f = {k: _number(rope, k, 1.0) for k in keys}
    return theta, RopeScaling(
        factor=f["factor"],
        low_freq_factor=f["low_freq_factor"],
        high_freq_factor=f["high_freq_factor"],
        original_max_position=int(f["original_max_position_embeddings"]),
    )


def _sliding_window(hf: dict, arch: str) -> int | None:
    if arch == "MistralForCausalLM":
        return hf.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
        kinds = set(hf.get("layer_types") or ["sliding_attention"])
        if kinds != {"sliding_attention"}:
            raise ValueError(f"unsupported mix of layer_types {sorted(kinds)} (one kind only)")
        return hf.get("sliding_window")
    return None


def config_from_hf(hf: dict, *, dtype=jnp.float32) -> TransformerConfig:
    """A :class:`TransformerConfig` from a Hugging Face ``config.json`` dict.

    The architecture is ``architectures[0]``, else the one ``model_type`` names ("llama",
    "mistral", "qwen2"). ValueError names an unsupported architecture, feature or missing key.
    """
    if not isinstance(hf, dict):
        raise ValueError(f"a Hugging Face config must be a JSON object, got {type(hf).__name__}")
    arch = _architecture(hf)
    _check_supported(hf, arch)
    theta, scaling = _rope(hf)

    head_dim = hf.get("head_dim")
    if head_dim == hf["hidden_size"] // hf["num_attention_heads"]:
        head_dim = None  # the derived default: keeps round trips equal
    return TransformerConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        mlp_dim=hf["intermediate_size"],
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=_number(hf, "rms_norm_eps", 1e-6),
        qkv_bias=arch == "Qwen2ForCausalLM",
        sliding_window=_sliding_window(hf, arch),
        tie_embeddings=_flag(hf, "tie_word_embeddings"),
        max_position=hf.get("max_position_embeddings", 2048),
        bos_id=_token_id(hf, "bos_token_id"),
        eos_id=_token_id(hf, "eos_token_id"),
        pad_id=_token_id(hf, "pad_token_id"),
        dtype=jnp.dtype(dtype).name,
    )


def config_to_hf(config: TransformerConfig) -> dict:
    """The ``config.json`` dict for ``config``: Qwen2 when it has q/k/v bias, Mistral when it has
    a sliding window, else Llama."""
    if config.attn_softcap or config.final_softcap:
        raise ValueError("softcap has no Llama/Mistral/Qwen2 equivalent; cannot export it")
    if config.qkv_bias and config.sliding_window is not None:
        raise ValueError("q/k/v bias with a sliding window has no supported HF architecture")
    arch = "LlamaForCausalLM"
    if config.qkv_bias:
        arch = "Qwen2ForCausalLM"
    elif config.sliding_window is not None:
        arch = "MistralForCausalLM"
    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope.update(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position,
        )
    hf = {
        "architectures": [arch],
        "model_type": _MODEL_TYPE[arch],
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.resolved_head_dim,
        "intermediate_size": config.mlp_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": rope,
        "max_position_embeddings": config.max_position,
        "tie_word_embeddings": config.tie_embeddings,
        "bos_token_id": config.bos_id,
        "eos_token_id": config.eos_id,
        "pad_token_id": config.pad_id,
        "dtype": config.dtype,
    }
    if arch == "MistralForCausalLM":
        hf["sliding_window"] = config.sliding_window
    if arch == "Qwen2ForCausalLM":
        hf.update(use_sliding_window=False, sliding_window=None)
    if arch == "LlamaForCausalLM":
        hf.update(attention_bias=False, mlp_bias=False)
    return hf


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One model parameter and the Hugging Face tensors it is made of: ``merge`` maps those
    tensors (in ``names`` order, HF layout) to the parameter's value, ``split`` maps back."""

    param: nnx.Param
    names: tuple[str, ...]
    merge: Callable = lambda t: t
    split: Callable = lambda x: (x,)


def _linear_entries(prefix: str, linear: nnx.Linear, names: list[str], fuse, unfuse):
    """Entries of a (possibly fused) linear layer whose HF parts are ``prefix + name``."""
    weights = tuple(f"{prefix}{n}.weight" for n in names)
    entries = [
        _Entry(
            linear.kernel,
            weights,
            lambda *t: fuse(*(w.T for w in t)),  # HF [out, in] -> NNX [in, out]
            lambda x: tuple(w.T for w in unfuse(x)),
        )
    ]
    if linear.bias is not None:
        entries.append(_Entry(linear.bias, tuple(f"{prefix}{n}.bias" for n in names), fuse, unfuse))
    return entries


def _entries(model: Transformer) -> list[_Entry]:
    """Every parameter of ``model`` with the HF tensors it is made of (q/k/v and gate/up fused)."""
    c = model.config
    qkv = dict(
        fuse=lambda q, k, v: fuse_qkv(q, k, v, c.num_kv_heads),
        unfuse=lambda w: split_qkv(w, c.num_kv_heads, c.resolved_head_dim),
    )
    one = dict(fuse=lambda w: w, unfuse=lambda w: (w,))
    entries = [
        _Entry(model.embed.embedding, ("model.embed_tokens.weight",)),
        _Entry(model.norm.weight, ("model.norm.weight",)),
    ]
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        entries += [
            _Entry(layer.input_norm.weight, (p + "input_layernorm.weight",)),
            _Entry(layer.post_attn_norm.weight, (p + "post_attention_layernorm.weight",)),
            *_linear_entries(p + "self_attn.", layer.attn.qkv_proj, ["q_proj", "k_proj", "v_proj"],
                             **qkv),
            *_linear_entries(p + "self_attn.", layer.attn.o_proj, ["o_proj"], **one),
            *_linear_entries(p + "mlp.", layer.mlp.gate_up_proj, ["gate_proj", "up_proj"],
                             fuse_gate_up, split_gate_up),
            *_linear_entries(p + "mlp.", layer.mlp.down_proj, ["down_proj"], **one),
        ]  # fmt: skip
    if model.lm_head is not None:
        entries += _linear_entries("", model.lm_head, ["lm_head"], **one)
    return entries


def _read_json(file: str):
    """The parsed JSON file; ValueError naming the file when it is not valid JSON."""
    with open(file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from None


def _read_config(path: str) -> dict:
    """``path/config.json``; FileNotFoundError saying what is missing when it is not there."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint")
    return _read_json(file)


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = _read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise ValueError(f"{index} has no weight_map of tensor names to file names")
        files = sorted(set(weight_map.values()))
    else:
        files = ["model.safetensors"]
    root = os.path.realpath(path)
    tensors = {}
    for name in files:
        file = os.path.join(path, name)
        if os.path.commonpath([root, os.path.realpath(file)]) != root:
            raise ValueError(f"{index} names {name!r}, outside the checkpoint directory")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"{path} has no {name} (weights are read from safetensors)")
        try:
            with safetensors.safe_open(file, framework="flax") as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except safetensors.SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file: {e}") from None
    return tensors


def load_hf_checkpoint(path: str, *, dtype=jnp.float32, attn_impl: str = "auto") -> Transformer:
    """A :class:`Transformer` from a Hugging Face checkpoint directory, parameters in ``dtype``.

    Raises FileNotFoundError when ``config.json`` or the weights are missing, and ValueError for
    malformed files, an unsupported architecture (naming it) or tensors that do not match.
    """
    hf = _read_config(path)
    try:
        config = config_from_hf(hf, dtype=dtype)
    except ValueError as e:
        raise ValueError(f"checkpoint {path}: {e}") from None
    config = config.replace(attn_impl=attn_impl)
    return build_model(config, _read_tensors(path), f"checkpoint {path}")


def _few(names: list[str], n: int = 5) -> str:
    """At most ``n`` names and how many more: a checkpoint of another model lacks hundreds."""
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return f"{names[:n]}{more}"


def build_model(config: TransformerConfig, tensors: Mapping[str, np.ndarray], source: str):
    """A :class:`Transformer` for ``config`` from tensors named and laid out as in Hugging Face
    checkpoints (``[out, in]`` linear weights, separate q/k/v and gate/up), cast to the config's
    dtype. ValueError naming ``source`` when tensors are missing, unexpected or misshapen."""
    layers = {int(n.split(".")[2]) for n in tensors if n.startswith("model.layers.") and
              n.split(".")[2].isdigit()}  # fmt: skip
    if layers != set(range(config.num_layers)):
        raise ValueError(  # before building: a config can claim any number of layers
            f"{source}: the config has {config.num_layers} layers, the tensors "
            f"{len(layers)} (indices {min(layers, default=None)}..{max(layers, default=None)})"
        )
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    entries = _entries(model)
    named = {name for e in entries for name in e.names}
    ignored = {k for k in tensors if k.endswith("rotary_emb.inv_freq")}
    if config.tie_embeddings:
        ignored.add("lm_head.weight")
    missing = sorted(set(named) - set(tensors))
    unexpected = sorted(set(tensors) - set(named) - ignored)
    if missing or unexpected:
        raise ValueError(
            f"{source}: missing tensors {_few(missing)}, unexpected {_few(unexpected)}"
        )
    for e in entries:
        for n in e.names:
            if not jnp.issubdtype(tensors[n].dtype, jnp.floating):
                raise ValueError(f"{source}: tensor {n} is {tensors[n].dtype}, not floating point")
        try:
            value = e.merge(*(jnp.asarray(tensors[n], config.jnp_dtype) for n in e.names))
        except (TypeError, ValueError):  # parts that do not fit together
            value = None
        if value is None or value.shape != e.param.shape:
            shapes = [tuple(tensors[n].shape) for n in e.names]
            raise ValueError(
                f"{source}: tensors {list(e.names)}: shapes {shapes} do not make the expected "
                f"{e.param.shape}"
            )
        if not np.isfinite(np.asarray(value)).all():  # on the host: no program per shape
            raise ValueError(f"{source}: tensors {list(e.names)} hold NaN or infinite values")
        e.param.set_value(value)
    return model


def hf_tensors(model: Transformer, dtype) -> dict[str, jax.Array]:
    """``model``'s parameters in ``dtype`` under Hugging Face's names and layouts (what
    :func:`build_model` reads back)."""
    tensors = {}
    for e in _entries(model):
        parts = e.split(jnp.asarray(e.param[...], dtype))
        tensors.update({n: jnp.asarray(t) for n, t in zip(e.names, parts, strict=True)})
    return tensors


def save_hf_checkpoint(model: Transformer, path: str, *, dtype=None) -> None:
    """Writes ``config.json`` and ``model.safetensors`` (parameters in ``dtype``, default the
    model's), loadable by :func:`load_hf_checkpoint` and by ``transformers``."""
    config = model.config
    if dtype is not None:
        config = config.replace(dtype=jnp.dtype(dtype).name)
    os.makedirs(path, exist_ok=True)
    tensors = hf_tensors(model, config.jnp_dtype)
    safetensors.flax.save_file(
        tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"}
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(config), f, indent=2, sort_keys=True)
        f.write("\n")
