"""``TransformerConfig``: one frozen, hashable description of a Llama-family decoder, with presets."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_attn import IMPLS


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling.

    ``rope_type`` "llama3" (Hugging Face's ``rope_type: "llama3"``): wavelengths longer than
    ``original_max_position / low_freq_factor`` are divided by ``factor``, those shorter than
    ``original_max_position / high_freq_factor`` are kept, and the band in between is
    interpolated smoothly. "linear" (Gemma 3's global layers): every frequency is divided by
    ``factor`` (the other fields unused).
    """

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self):
        if self.rope_type not in ("llama3", "linear"):
            raise ValueError(f"rope_type must be 'llama3' or 'linear', got {self.rope_type!r}")
        if not 0 < self.factor < float("inf"):
            raise ValueError(f"RoPE scaling factor must be a positive number, got {self.factor!r}")


def kv_dtype_name(kv_dtype) -> str | None:
    """``kv_dtype`` (None, a name or a dtype) as :class:`TransformerConfig` holds it; ValueError
    naming it when it is not a dtype."""
    if kv_dtype is None:
        return None
    try:
        return jnp.dtype(kv_dtype).name
    except TypeError:
        raise ValueError(f"kv_dtype must be a dtype name or None, got {kv_dtype!r}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """A decoder-only transformer: token embedding, ``num_layers`` x (RMSNorm, GQA attention with
    RoPE, RMSNorm, gated MLP), final RMSNorm, LM head.

    Shapes: V = ``vocab_size``, Hq = ``num_heads``, Hkv = ``num_kv_heads``, D = ``head_dim``.

    Attributes:
      sliding_window: if set, a query sees itself and the ``sliding_window - 1`` keys before it
        (Mistral / Hugging Face convention), i.e. ``window_size = (sliding_window - 1, 0)``; in
        every layer, or with ``layer_types`` only in the ``"sliding_attention"`` layers.
      layer_types: None, or one of ``"sliding_attention"`` / ``"full_attention"`` per layer
        (Gemma 3's local and global layers; Hugging Face's ``layer_types``).
      local_rope_theta: RoPE base of the sliding layers when they have their own (Gemma 3: 10k
        beside the global layers' ``rope_theta`` of 1M); their RoPE is never scaled.
      qk_norm: RMSNorm over each head's queries and keys before RoPE (Qwen3, Gemma 3).
      norm_plus_one: RMSNorm weights are applied as ``(1 + w)``, the product taken in float32
        (Gemma); ``w`` is stored as Hugging Face stores it.
      sandwich_norm: four norms per layer: also one on the attention output and one on the MLP
        output, before each residual add (Gemma 2 / 3).
      embed_scale: multiply the embedding by ``sqrt(dim)`` (rounded to the activation dtype, as
        transformers' Gemma does).
      mlp_act: the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma).
      query_pre_attn_scalar: the softmax scale is its ``** -0.5``; None = D (``1 / sqrt(D)``).
        Gemma 3's field of that name (its 27B model scales by ``dim / num_heads``, not D).
      attn_softcap, final_softcap: Gemma-2 style ``c * tanh(x / c)`` on attention scores / logits
        (0 = off).
      attn_impl: the ``pallas_attn`` implementation used by every attention call.
      dtype: parameter and activation dtype name ("float32", "bfloat16", "float16"); logits are
        always returned in float32.
      kv_dtype: the KV cache's dtype name; None = ``dtype``. A float32 model may keep a
        "bfloat16" or "float16" cache: half the bytes each decode step reads per cached token
        (llama.cpp's default cache is float16), new keys rounded once on the write.
    """

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    mlp_dim: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    local_rope_theta: float | None = None
    qk_norm: bool = False
    norm_plus_one: bool = False
    sandwich_norm: bool = False
    embed_scale: bool = False
    mlp_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    tie_embeddings: bool = False
    max_position: int = 2048
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    attn_impl: str = "auto"
    dtype: str = "float32"
    kv_dtype: str | None = None

    def __post_init__(self):
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "mlp_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim is None and self.dim % self.num_heads:
            raise ValueError(
                f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads}) "
                "when head_dim is not given"
            )
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.resolved_head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.layer_types is not None:
            if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers:
                raise ValueError(
                    f"layer_types must be a tuple of num_layers ({self.num_layers}) entries, got "
                    f"{self.layer_types!r}"
                )
            bad = set(self.layer_types) - set(LAYER_TYPES)
            if bad:
                raise ValueError(f"layer_types entries must be in {LAYER_TYPES}, got {sorted(bad)}")
        if self.mlp_act not in MLP_ACTS:
            raise ValueError(f"mlp_act must be one of {MLP_ACTS}, got {self.mlp_act!r}")
        for name in ("local_rope_theta", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")
        if self.attn_impl not in IMPLS:
            raise ValueError(f"attn_impl must be one of {IMPLS}, got {self.attn_impl!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        narrow = ("bfloat16", "float16") if self.dtype == "float32" else ()
        if self.kv_dtype is not None and self.kv_dtype not in (self.dtype, *narrow):
            raise ValueError(
                f"kv_dtype must be None, the model's dtype ({self.dtype!r})"
                + (f" or one of {narrow}" if narrow else "")
                + f", got {self.kv_dtype!r}"
            )

    @property
    def resolved_head_dim(self) -> int:
        """D: ``head_dim`` if given, else ``dim // num_heads``."""
        return self.head_dim if self.head_dim is not None else self.dim // self.num_heads

    @property
    def window_size(self) -> tuple[int, int]:
        """``(left, right)`` for ``pallas_attn``: causal, limited look-back with a sliding window
        (the sliding layers' window when ``layer_types`` mixes kinds; see :meth:`layer_window`)."""
        return (-1 if self.sliding_window is None else self.sliding_window - 1, 0)

    def is_sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through ``sliding_window``."""
        if self.sliding_window is None:
            return False
        return self.layer_types is None or self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> tuple[int, int]:
        """``window_size`` of layer ``layer``: the sliding window or unbounded (causal)."""
        return self.window_size if self.is_sliding(layer) else (-1, 0)

    def layer_rope_theta(self, layer: int) -> float:
        """RoPE base of layer ``layer``: ``local_rope_theta`` for a sliding layer when set."""
        if self.local_rope_theta is not None and self.is_sliding(layer):
            return self.local_rope_theta
        return self.rope_theta

    @property
    def softmax_scale(self) -> float | None:
        """The attention's softmax scale (None: ``pallas_attn``'s default ``1 / sqrt(D)``)."""
        q = self.query_pre_attn_scalar
        return None if q is None else float(q) ** -0.5

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def kv_jnp_dtype(self):
        """The KV cache's dtype: ``kv_dtype``, else ``dtype``."""
        return jnp.dtype(self.dtype if self.kv_dtype is None else self.kv_dtype)

    def replace(self, **changes) -> TransformerConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        D, Hq, Hkv = self.resolved_head_dim, self.num_heads, self.num_kv_heads
        attn = self.dim * D * (Hq + 2 * Hkv) + Hq * D * self.dim
        if self.qkv_bias:
            attn += D * (Hq + 2 * Hkv)
        if self.qk_norm:
            attn += 2 * D
        norms = (4 if self.sandwich_norm else 2) * self.dim
        layer = attn + 3 * self.dim * self.mlp_dim + norms
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.num_layers * layer + self.dim + head

    @classmethod
    def preset(cls, name: str, **overrides) -> TransformerConfig:
        """A named configuration (see ``PRESETS``), with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        return PRESETS[name].replace(**overrides)


LAYER_TYPES = ("sliding_attention", "full_attention")
MLP_ACTS = ("silu", "gelu_tanh")

# Byte-level vocabulary of the shipped models: 256 bytes + BOS/EOS/PAD = 259 ids, embedding
# padded to 264 (a multiple of 8) so the LM-head matmul has an aligned width. Ids 259..263 are
# never produced by the tokenizer.
BYTE_VOCAB = 264
_BYTE_IDS = dict(bos_id=256, eos_id=257, pad_id=258)

PRESETS: dict[str, TransformerConfig] = {
    "tiny": TransformerConfig(
        vocab_size=BYTE_VOCAB,
        dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=128,
        tie_embeddings=True,
        max_position=512,
        **_BYTE_IDS,
    ),
    "code-draft": TransformerConfig(
        vocab_size=BYTE_VOCAB,
        dim=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=320,
        tie_embeddings=True,
        max_position=2048,
        **_BYTE_IDS,
    ),
    "code-target": TransformerConfig(
        vocab_size=BYTE_VOCAB,
        dim=256,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        mlp_dim=576,
        tie_embeddings=True,
        max_position=2048,
        **_BYTE_IDS,
    ),
    "llama-3-8b": TransformerConfig(
        vocab_size=128256,
        dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        mlp_dim=14336,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(),
        max_position=131072,
        bos_id=128000,
        eos_id=128001,
        dtype="bfloat16",
    ),
    "mistral-7b": TransformerConfig(
        vocab_size=32000,
        dim=4096,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        mlp_dim=14336,
        sliding_window=4096,
        max_position=32768,
        bos_id=1,
        eos_id=2,
        dtype="bfloat16",
    ),
}
