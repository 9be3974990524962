"""A Flax NNX Llama-family transformer on ``pallas_attn``, its KV cache, checkpoints in and out
(Hugging Face safetensors, GGUF), tokenizers and chat templates, training, tensor/data parallel
sharding (``models.shard``), and models by name (SmolLM2-135M-Instruct, the shipped code models)."""

from models.config import PRESETS, RopeScaling, TransformerConfig
from models.eagle import EagleHead
from models.gguf import load_gguf, save_gguf
from models.hf import load_hf_checkpoint, save_hf_checkpoint
from models.kv_cache import KVCache
from models.medusa import MedusaHeads
from models.nnx_attention import pallas_attention_fn
from models.pretrained import load_model, pretrained
from models.quant import QuantLinear, dequantize, quantize
from models.sharding import make_train_step as make_sharded_train_step
from models.sharding import memory_plan, param_shardings, shard, train_shardings
from models.stream_decoder import StreamDecoder
from models.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from models.transformer import Transformer, configure

__all__ = [
    "PRESETS",
    "ByteTokenizer",
    "HFTokenizer",
    "KVCache",
    "EagleHead",
    "MedusaHeads",
    "QuantLinear",
    "RopeScaling",
    "StreamDecoder",
    "Tokenizer",
    "Transformer",
    "TransformerConfig",
    "configure",
    "dequantize",
    "load_gguf",
    "load_hf_checkpoint",
    "load_model",
    "load_tokenizer",
    "make_sharded_train_step",
    "memory_plan",
    "pallas_attention_fn",
    "param_shardings",
    "pretrained",
    "quantize",
    "save_gguf",
    "save_hf_checkpoint",
    "shard",
    "train_shardings",
]
