"""A Flax NNX Llama-family transformer on ``pallas_attn``, its KV cache, Hugging Face checkpoint
import/export, training, and the shipped byte-level code models."""

from models.config import PRESETS, RopeScaling, TransformerConfig
from models.kv_cache import KVCache
from models.tokenizer import ByteTokenizer
from models.transformer import Transformer

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "KVCache",
    "RopeScaling",
    "Transformer",
    "TransformerConfig",
]
