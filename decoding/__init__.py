"""Jitted KV-cache generation, speculative decoding, sampling, the paged cache's page allocator
and the continuous-batching engine (its scheduler and step plans)."""

from decoding.drafts import DraftKind, EarlyExit, PromptLookup
from decoding.eagle import Eagle
from decoding.engine import Engine
from decoding.generate import (
    DecodeState,
    GenerateOptions,
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
from decoding.scheduler import Scheduler, StepPlan
from decoding.speculative import speculative_generate
from decoding.tree import TreeSpec

__all__ = [
    "BlockTables",
    "DecodeState",
    "DraftKind",
    "EarlyExit",
    "Engine",
    "GenerateOptions",
    "GenerateResult",
    "Eagle",
    "Medusa",
    "OutOfPagesError",
    "PageAllocator",
    "PromptLookup",
    "SamplingConfig",
    "SamplingParams",
    "Scheduler",
    "StepPlan",
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
