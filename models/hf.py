"""Hugging Face checkpoints: ``config.json`` + ``model.safetensors`` (or sharded with
``model.safetensors.index.json``) for ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and ``Gemma3ForCausalLM`` (the text model, ``model_type``
``gemma3_text``), read and written without torch. :data:`FAMILIES` describes each family once.

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

from models.config import RopeScaling, TransformerConfig, kv_dtype_name
from models.transformer import Transformer, fuse_gate_up, fuse_qkv, split_gate_up, split_qkv


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its names in Hugging Face and llama.cpp files and what it switches on.

    The one description of a family that :func:`config_from_hf`, :func:`config_to_hf`, the
    tensor names of :func:`build_model` / :func:`hf_tensors` and the GGUF reader and writer
    (``models.gguf``, which turns a file's metadata into this family's ``config.json`` dict
    through its one table of keys) all read.

    Attributes:
      architecture, model_type: Hugging Face's ``architectures[0]`` and ``model_type``.
      gguf: llama.cpp's ``general.architecture`` for it; None when llama.cpp's converter writes
        the family under another one (Mistral as ``llama``).
      features: the :class:`TransformerConfig` fields the family fixes (the others' defaults).
      act: ``(config key, value)``: the activation key and the one value supported.
      defaults: values of transformers' config class for keys a ``config.json`` may omit.
      gguf_defaults: ``config.json`` values llama.cpp's loader assumes for the family when the
        file's metadata lacks them (its converter never writes them).
      permute_qk: llama.cpp's converter reorders each Q/K head's rows for GPT-J RoPE pairing.
      gguf_norm_shift: added to every norm weight by llama.cpp's converter (Gemma's ``1 + w``
        is stored as its sum).
      renames: our tensor name -> the family's Hugging Face name, where they differ.
    """

    architecture: str
    model_type: str
    gguf: str | None
    features: dict = dataclasses.field(default_factory=dict)
    act: tuple[str, str] = ("hidden_act", "silu")
    defaults: dict = dataclasses.field(default_factory=dict)
    gguf_defaults: dict = dataclasses.field(default_factory=dict)
    permute_qk: bool = False
    gguf_norm_shift: float = 0.0
    renames: dict = dataclasses.field(default_factory=dict)


# The TransformerConfig fields a family decides; every other family has their defaults.
_FEATURES = dict(
    qkv_bias=False,
    qk_norm=False,
    norm_plus_one=False,
    sandwich_norm=False,
    embed_scale=False,
    mlp_act="silu",
)
_GEMMA3_LOCAL_THETA = 10000.0  # transformers' and llama.cpp's base of Gemma 3's sliding layers
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("LlamaForCausalLM", "llama", "llama", permute_qk=True),
        Family("MistralForCausalLM", "mistral", None),
        Family("Qwen2ForCausalLM", "qwen2", "qwen2", features=dict(qkv_bias=True)),
        Family(
            "Qwen3ForCausalLM",
            "qwen3",
            "qwen3",
            features=dict(qk_norm=True),
            defaults=dict(head_dim=128),
        ),
        Family(
            "Gemma3ForCausalLM",
            "gemma3_text",
            "gemma3",
            features=dict(
                qk_norm=True,
                norm_plus_one=True,
                sandwich_norm=True,
                embed_scale=True,
                mlp_act="gelu_tanh",
            ),
            act=("hidden_activation", "gelu_pytorch_tanh"),
            defaults=dict(
                head_dim=256,
                query_pre_attn_scalar=256,
                sliding_window=4096,
                sliding_window_pattern=6,
                rms_norm_eps=1e-6,
                tie_word_embeddings=True,
                rope_theta=1e6,
                rope_local_base_freq=_GEMMA3_LOCAL_THETA,
            ),
            # llama.cpp's src/llama-model.cpp, LLM_ARCH_GEMMA3 hparams: set_swa_pattern(6)
            # (every 6th layer global), rope_freq_base_train_swa = 10000, no scaling of the
            # local RoPE, and f_attention_scale = 1 / sqrt(n_embd_head_k) except for the 62-layer
            # 27B model, 1 / sqrt(n_embd / n_head) (see models.gguf._gemma3_defaults).
            gguf_defaults=dict(sliding_window_pattern=6, rope_local_base_freq=_GEMMA3_LOCAL_THETA),
            gguf_norm_shift=1.0,
            renames={
                "post_attn_norm": "pre_feedforward_layernorm",
                "attn_out_norm": "post_attention_layernorm",
                "mlp_out_norm": "post_feedforward_layernorm",
            },
        ),
    )
}
ARCHITECTURES = tuple(f.architecture for f in FAMILIES.values())
_BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}


_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)


def family_of_hf(hf: dict) -> Family:
    """The family of a ``config.json`` dict: ``architectures[0]``, or when that list is absent
    the family ``model_type`` names (older and hand-written configs give only ``model_type``)."""
    archs = hf.get("architectures")
    if archs:
        arch = archs if isinstance(archs, str) else archs[0]
        if arch not in _BY_ARCHITECTURE:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {ARCHITECTURES}")
        return _BY_ARCHITECTURE[arch]
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported model: no architectures and model_type {model_type!r}; supported: "
            f"{ARCHITECTURES} or model_type in {tuple(FAMILIES)}"
        )
    return FAMILIES[model_type]


def family_of(config: TransformerConfig) -> Family:
    """The family whose features ``config`` has; ValueError when no family has them all."""
    if config.norm_plus_one:
        family = FAMILIES["gemma3_text"]
    elif config.qk_norm:
        family = FAMILIES["qwen3"]
    elif config.qkv_bias:
        family = FAMILIES["qwen2"]
    elif config.sliding_window is not None:
        family = FAMILIES["mistral"]
    else:
        family = FAMILIES["llama"]
    wanted = {**_FEATURES, **family.features}
    have = {k: getattr(config, k) for k in _FEATURES}
    gemma = family.model_type == "gemma3_text"
    if have != wanted or (
        not gemma
        and (config.layer_types or config.local_rope_theta or config.query_pre_attn_scalar)
    ):
        raise ValueError(
            f"no supported Hugging Face architecture has this combination of features: {have} "
            f"(the nearest, {family.architecture}, has {wanted})"
        )
    if family.model_type in ("qwen2", "qwen3") and config.sliding_window is not None:
        raise ValueError(f"{family.architecture} with a sliding window cannot be exported")
    return family


def _check_supported(hf: dict, family: Family) -> None:
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
    key, act = family.act
    if hf.get(key, act) != act:
        raise ValueError(f"unsupported {key} {hf[key]!r} (only {act})")
    if hf.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=True")
    if hf.get("attention_bias") and not family.features.get("qkv_bias"):
        raise ValueError("unsupported attention_bias=True (bias on o_proj)")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention=True (a causal decoder only)")


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


def _flag(hf: dict, key: str, default: bool = False) -> bool:
    value = hf.get(key, default)
    if not isinstance(value, bool):  # "false" is truthy: never guess
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def _scalar(hf: dict) -> int | float:
    """Gemma's ``query_pre_attn_scalar``, an int kept an int (transformers' config wants one)."""
    _number(hf, "query_pre_attn_scalar", 1.0)
    return hf["query_pre_attn_scalar"]


def _softcap(hf: dict, key: str) -> float:
    return 0.0 if hf.get(key) is None else _number(hf, key, 0.0)


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


def _rope(rope: dict, default_theta: float) -> tuple[float, RopeScaling | None]:
    """(theta, scaling or None) from one ``rope_parameters`` dict (legacy keys merged in)."""
    theta = _number({"rope_theta": rope.get("rope_theta", default_theta)}, "rope_theta", 1.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling(rope_type="linear", factor=_number(rope, "factor", 1.0))
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope_type {rope_type!r} (default, linear or llama3)")
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


def _rope_params(hf: dict, family: Family) -> tuple[float, RopeScaling | None, float | None]:
    """(theta, scaling, local theta or None): ``rope_parameters`` (per layer kind for Gemma 3),
    else the legacy ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict) or not isinstance(hf.get("rope_scaling") or {}, dict):
        raise ValueError(f"rope_parameters must be an object, got {params!r}")
    default_theta = family.defaults.get("rope_theta", 10000.0)
    legacy = {"rope_theta": hf.get("rope_theta", default_theta), **(hf.get("rope_scaling") or {})}
    if "full_attention" in params or "sliding_attention" in params:  # one dict per layer kind
        theta, scaling = _rope({**legacy, **(params.get("full_attention") or {})}, default_theta)
        local = {
            "rope_theta": hf.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA),
            **(params.get("sliding_attention") or {}),
        }
        local_theta, local_scaling = _rope(local, _GEMMA3_LOCAL_THETA)
        if local_scaling is not None:
            raise ValueError("unsupported RoPE scaling of the sliding_attention layers")
        return theta, scaling, local_theta
    theta, scaling = _rope({**legacy, **params}, default_theta)
    local = None
    if family.model_type == "gemma3_text":
        local = _number(hf, "rope_local_base_freq", _GEMMA3_LOCAL_THETA)
    return theta, scaling, local


def _layer_types(hf: dict, family: Family) -> tuple[str, ...] | None:
    """Gemma 3's per-layer kinds: ``layer_types``, else every ``sliding_window_pattern``-th
    layer global (transformers' rule)."""
    if family.model_type != "gemma3_text":
        return None
    n = hf["num_hidden_layers"]
    kinds = hf.get("layer_types")
    if kinds is None:
        pattern = hf.get("sliding_window_pattern", family.defaults["sliding_window_pattern"])
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"sliding_window_pattern must be a positive int, got {pattern!r}")
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n:
        raise ValueError(f"layer_types must be a list of num_hidden_layers ({n}) entries")
    bad = sorted(set(kinds) - {"sliding_attention", "full_attention"})
    if bad:
        raise ValueError(f"unsupported layer_types {bad}")
    return tuple(kinds)


def _sliding_window(hf: dict, family: Family) -> int | None:
    if family.model_type == "mistral":
        window = hf.get("sliding_window")
    elif family.model_type == "gemma3_text":
        window = hf.get("sliding_window", family.defaults["sliding_window"])
    elif family.model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        kinds = set(hf.get("layer_types") or ["sliding_attention"])
        if kinds != {"sliding_attention"}:
            raise ValueError(f"unsupported mix of layer_types {sorted(kinds)} (one kind only)")
        window = hf.get("sliding_window")
    else:
        return None
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ValueError(f"sliding_window must be a positive int or null, got {window!r}")
    return window


def config_from_hf(hf: dict, *, dtype=jnp.float32) -> TransformerConfig:
    """A :class:`TransformerConfig` from a Hugging Face ``config.json`` dict.

    The family is ``architectures[0]``, else the one ``model_type`` names (see
    :data:`FAMILIES`: llama, mistral, qwen2, qwen3, gemma3_text). ValueError names an
    unsupported architecture, feature or missing key.
    """
    if not isinstance(hf, dict):
        raise ValueError(f"a Hugging Face config must be a JSON object, got {type(hf).__name__}")
    family = family_of_hf(hf)
    hf = {**family.defaults, **hf}
    _check_supported(hf, family)
    theta, scaling, local_theta = _rope_params(hf, family)

    head_dim = hf.get("head_dim")
    if head_dim == hf["hidden_size"] // hf["num_attention_heads"]:
        head_dim = None  # the derived default: keeps round trips equal
    features = {**_FEATURES, **family.features}
    gemma = family.model_type == "gemma3_text"
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
        sliding_window=_sliding_window(hf, family),
        layer_types=_layer_types(hf, family),
        local_rope_theta=local_theta,
        query_pre_attn_scalar=_scalar(hf) if gemma else None,
        attn_softcap=_softcap(hf, "attn_logit_softcapping"),
        final_softcap=_softcap(hf, "final_logit_softcapping"),
        tie_embeddings=_flag(hf, "tie_word_embeddings"),
        max_position=hf.get("max_position_embeddings", 2048),
        bos_id=_token_id(hf, "bos_token_id"),
        eos_id=_token_id(hf, "eos_token_id"),
        pad_id=_token_id(hf, "pad_token_id"),
        dtype=jnp.dtype(dtype).name,
        **features,
    )


def _rope_dict(theta: float, scaling: RopeScaling | None) -> dict:
    rope = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None and scaling.rope_type == "linear":
        rope.update(rope_type="linear", factor=scaling.factor)
    elif scaling is not None:
        rope.update(
            rope_type="llama3",
            factor=scaling.factor,
            low_freq_factor=scaling.low_freq_factor,
            high_freq_factor=scaling.high_freq_factor,
            original_max_position_embeddings=scaling.original_max_position,
        )
    return rope


def config_to_hf(config: TransformerConfig) -> dict:
    """The ``config.json`` dict for ``config``, of the family whose features it has
    (:func:`family_of`: Gemma 3 with Gemma's norms, Qwen3 with q/k norms, Qwen2 with q/k/v
    bias, Mistral with a sliding window, else Llama)."""
    family = family_of(config)
    gemma = family.model_type == "gemma3_text"
    if (config.attn_softcap or config.final_softcap) and not gemma:
        raise ValueError(f"softcap has no {family.architecture} equivalent; cannot export it")
    if config.rope_scaling is not None and config.rope_scaling.rope_type == "linear" and not gemma:
        raise ValueError("linear RoPE scaling is only exported for Gemma 3")
    rope = _rope_dict(config.rope_theta, config.rope_scaling)
    act_key, act = family.act
    hf = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.resolved_head_dim,
        "intermediate_size": config.mlp_dim,
        act_key: act,
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
    if family.model_type != "qwen2":  # Qwen2's bias is not optional: its config has no key
        hf["attention_bias"] = False
    if family.model_type == "mistral":
        hf["sliding_window"] = config.sliding_window
    if family.model_type in ("qwen2", "qwen3"):
        hf.update(use_sliding_window=False, sliding_window=None)
    if family.model_type == "llama":
        hf["mlp_bias"] = False
    if gemma:
        del hf["rope_theta"]
        local = (
            config.local_rope_theta if config.local_rope_theta is not None else config.rope_theta
        )
        hf.update(
            rope_parameters={"full_attention": rope, "sliding_attention": _rope_dict(local, None)},
            sliding_window=config.sliding_window,
            layer_types=[
                "sliding_attention" if config.is_sliding(i) else "full_attention"
                for i in range(config.num_layers)
            ],
            query_pre_attn_scalar=(
                config.query_pre_attn_scalar
                if config.query_pre_attn_scalar is not None
                else config.resolved_head_dim
            ),
            attn_logit_softcapping=config.attn_softcap or None,
            final_logit_softcapping=config.final_softcap or None,
        )
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
    """Every parameter of ``model`` with the HF tensors it is made of (q/k/v and gate/up fused),
    named as its family names them (:attr:`Family.renames`)."""
    c = model.config
    renames = family_of(c).renames if (c.sandwich_norm or c.qk_norm) else {}
    qkv = dict(
        fuse=lambda q, k, v: fuse_qkv(q, k, v, c.num_kv_heads),
        unfuse=lambda w: split_qkv(w, c.num_kv_heads, c.resolved_head_dim),
    )
    one = dict(fuse=lambda w: w, unfuse=lambda w: (w,))
    entries = [
        _Entry(model.embed.embedding, ("model.embed_tokens.weight",)),
        _Entry(model.norm.weight, ("model.norm.weight",)),
    ]
    norms = {
        "input_norm": "input_layernorm",
        "post_attn_norm": "post_attention_layernorm",
        "attn_out_norm": None,
        "mlp_out_norm": None,
    }
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        for attr, hf_name in norms.items():
            norm = getattr(layer, attr)
            if norm is not None:
                name = renames.get(attr, hf_name)
                entries.append(_Entry(norm.weight, (f"{p}{name}.weight",)))
        if layer.attn.q_norm is not None:
            entries += [
                _Entry(layer.attn.q_norm.weight, (p + "self_attn.q_norm.weight",)),
                _Entry(layer.attn.k_norm.weight, (p + "self_attn.k_norm.weight",)),
            ]
        entries += [
            *_linear_entries(
                p + "self_attn.", layer.attn.qkv_proj, ["q_proj", "k_proj", "v_proj"], **qkv
            ),
            *_linear_entries(p + "self_attn.", layer.attn.o_proj, ["o_proj"], **one),
            *_linear_entries(
                p + "mlp.",
                layer.mlp.gate_up_proj,
                ["gate_proj", "up_proj"],
                fuse_gate_up,
                split_gate_up,
            ),
            *_linear_entries(p + "mlp.", layer.mlp.down_proj, ["down_proj"], **one),
        ]
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


def load_hf_checkpoint(
    path: str, *, dtype=jnp.float32, attn_impl: str = "auto", kv_dtype=None
) -> Transformer:
    """A :class:`Transformer` from a Hugging Face checkpoint directory, parameters in ``dtype``,
    its KV caches in ``kv_dtype`` (None: ``dtype``; see :class:`TransformerConfig`).

    Raises FileNotFoundError when ``config.json`` or the weights are missing, and ValueError for
    malformed files, an unsupported architecture (naming it) or tensors that do not match.
    """
    hf = _read_config(path)
    try:
        config = config_from_hf(hf, dtype=dtype)
    except ValueError as e:
        raise ValueError(f"checkpoint {path}: {e}") from None
    config = config.replace(attn_impl=attn_impl, kv_dtype=kv_dtype_name(kv_dtype))
    return build_model(config, _read_tensors(path), f"checkpoint {path}")


def _few(names: list[str], n: int = 5) -> str:
    """At most ``n`` names and how many more: a checkpoint of another model lacks hundreds."""
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return f"{names[:n]}{more}"


def build_model(config: TransformerConfig, tensors: Mapping[str, np.ndarray], source: str):
    """A :class:`Transformer` for ``config`` from tensors named and laid out as in Hugging Face
    checkpoints (``[out, in]`` linear weights, separate q/k/v and gate/up), cast to the config's
    dtype. ValueError naming ``source`` when tensors are missing, unexpected or misshapen."""
    layers = {
        int(n.split(".")[2])
        for n in tensors
        if n.startswith("model.layers.") and n.split(".")[2].isdigit()
    }
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
