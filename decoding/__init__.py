"""Jitted KV-cache generation, sampling, the paged cache's page allocator and the continuous-
batching engine."""

from decoding.engine import Engine
from decoding.generate import (
    DecodeState,
    GenerateResult,
    compiled_count,
    decode,
    decode_step,
    generate,
    prefill,
)
from decoding.paging import BlockTables, OutOfPagesError, PageAllocator
from decoding.sampling import SamplingConfig, filtered_logits, probabilities, sample

__all__ = [
    "BlockTables",
    "DecodeState",
    "Engine",
    "GenerateResult",
    "OutOfPagesError",
    "PageAllocator",
    "SamplingConfig",
    "compiled_count",
    "decode",
    "decode_step",
    "filtered_logits",
    "generate",
    "prefill",
    "probabilities",
    "sample",
]
