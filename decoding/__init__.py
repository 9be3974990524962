"""Jitted KV-cache generation, sampling, and the paged cache's page allocator."""

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
