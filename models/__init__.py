"""A Flax NNX Llama-family transformer on ``pallas_attn``, its KV cache, Hugging Face checkpoint
import/export, training, and the shipped byte-level code models."""

from models.config import PRESETS, RopeScaling, TransformerConfig
from models.hf import load_hf_checkpoint, save_hf_checkpoint
from models.kv_cache import KVCache
from models.medusa import MedusaHeads
from models.nnx_attention import pallas_attention_fn
from models.pretrained import pretrained
from models.tokenizer import ByteTokenizer
from models.transformer import Transformer

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "KVCache",
    "MedusaHeads",
    "RopeScaling",
    "Transformer",
    "TransformerConfig",
    "load_hf_checkpoint",
    "pallas_attention_fn",
    "pretrained",
    "save_hf_checkpoint",
]
