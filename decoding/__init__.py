"""Jitted KV-cache generation, speculative decoding, sampling, the paged cache's page allocator
and the continuous-batching engine."""

from decoding.drafts import EarlyExit, PromptLookup
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
from decoding.medusa import Medusa
from decoding.paging import BlockTables, OutOfPagesError, PageAllocator
from decoding.sampling import SamplingConfig, SamplingParams, filtered_logits, probabilities, sample
from decoding.speculative import speculative_generate
from decoding.tree import TreeSpec

__all__ = [
    "BlockTables",
    "DecodeState",
    "EarlyExit",
    "Engine",
    "GenerateResult",
    "Medusa",
    "OutOfPagesError",
    "PageAllocator",
    "PromptLookup",
    "SamplingConfig",
    "SamplingParams",
    "TreeSpec",
    "compiled_count",
    "decode",
    "decode_step",
    "filtered_logits",
    "generate",
    "prefill",
    "probabilities",
    "sample",
    "speculative_generate",
]
