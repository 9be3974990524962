"""``TransformerConfig``: one frozen, hashable description of a Llama-family decoder, with presets."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_attn import IMPLS


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (``rope_type: "llama3"`` in Hugging Face configs).

    Wavelengths longer than ``original_max_position / low_freq_factor`` are divided by ``factor``,
    those shorter than ``original_max_position / high_freq_factor`` are kept, and the band in
    between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """A decoder-only transformer: token embedding, ``num_layers`` x (RMSNorm, GQA attention with
    RoPE, RMSNorm, SwiGLU MLP), final RMSNorm, LM head.

    Shapes: V = ``vocab_size``, Hq = ``num_heads``, Hkv = ``num_kv_heads``, D = ``head_dim``.

    Attributes:
      sliding_window: if set, a query sees itself and the ``sliding_window - 1`` keys before it
        (Mistral / Hugging Face convention), i.e. ``window_size = (sliding_window - 1, 0)``.
      attn_softcap, final_softcap: Gemma-2 style ``c * tanh(x / c)`` on attention scores / logits
        (0 = off).
      attn_impl: the ``pallas_attn`` implementation used by every attention call.
      dtype: parameter and activation dtype name ("float32", "bfloat16", "float16"); logits are
        always returned in float32.
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
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    tie_embeddings: bool = False
    max_position: int = 2048
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    attn_impl: str = "auto"
    dtype: str = "float32"

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
        if self.attn_impl not in IMPLS:
            raise ValueError(f"attn_impl must be one of {IMPLS}, got {self.attn_impl!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def resolved_head_dim(self) -> int:
        """D: ``head_dim`` if given, else ``dim // num_heads``."""
        return self.head_dim if self.head_dim is not None else self.dim // self.num_heads

    @property
    def window_size(self) -> tuple[int, int]:
        """``(left, right)`` for ``pallas_attn``: causal, limited look-back with a sliding window."""
        return (-1 if self.sliding_window is None else self.sliding_window - 1, 0)

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def replace(self, **changes) -> TransformerConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        D, Hq, Hkv = self.resolved_head_dim, self.num_heads, self.num_kv_heads
        attn = self.dim * D * (Hq + 2 * Hkv) + Hq * D * self.dim
        if self.qkv_bias:
            attn += D * (Hq + 2 * Hkv)
        layer = attn + 3 * self.dim * self.mlp_dim + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + self.num_layers * layer + self.dim + head

    @classmethod
    def preset(cls, name: str, **overrides) -> TransformerConfig:
        """A named configuration (see ``PRESETS``), with optional field overrides."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
        return PRESETS[name].replace(**overrides)


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
