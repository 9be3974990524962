"""Attention kernels for JAX: reference, blockwise XLA, and Pallas GPU kernels (Triton, and Mosaic
GPU for Hopper: ``impl="mosaic"``).

Layout [B, T, H, D]; see ``pallas_attn.masks`` for the mask semantics every impl shares.
"""

from pallas_attn.api import flash_attention
from pallas_attn.heuristics import BlockSizes, num_splits_heuristic
from pallas_attn.kvcache import KVCacheResult, attention_with_kvcache
from pallas_attn.validation import IMPLS
from pallas_attn.varlen import flash_attention_varlen

__all__ = [
    "IMPLS",
    "BlockSizes",
    "KVCacheResult",
    "attention_with_kvcache",
    "flash_attention",
    "flash_attention_varlen",
    "num_splits_heuristic",
]
