"""A Flax NNX Llama-family transformer on ``pallas_attn``, its KV cache, Hugging Face checkpoint
import/export, training, tensor/data parallel sharding (``models.shard``), and the shipped byte-level code models."""

from models.config import PRESETS, RopeScaling, TransformerConfig
from models.hf import load_hf_checkpoint, save_hf_checkpoint
from models.kv_cache import KVCache
from models.medusa import MedusaHeads
from models.nnx_attention import pallas_attention_fn
from models.pretrained import load_model, pretrained
from models.shard import make_train_step as make_sharded_train_step
from models.shard import memory_plan, param_shardings, shard, train_shardings
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
    "load_model",
    "make_sharded_train_step",
    "memory_plan",
    "pallas_attention_fn",
    "param_shardings",
    "pretrained",
    "save_hf_checkpoint",
    "shard",
    "train_shardings",
]
