"""Block sizes for the kernels and the split-KV ``num_splits`` heuristic."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_attn import shapes

# Streaming multiprocessors of the GPU the heuristics assume when none is visible (H100/H200 SXM).
DEFAULT_NUM_SMS = 132


def padded_head_dim(head_dim: int) -> int:
    """Dp: the head dim the Pallas kernels see, the next power of two >= 16 (Triton's ``dot``)."""
    return shapes.next_pow2(head_dim, floor=16)


def _check_head_dim(head_dim) -> int:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or not 1 <= head_dim <= 256:
        raise ValueError(f"head_dim must be an int in [1, 256], got {head_dim!r}")
    return head_dim


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the flash-attention kernels; frozen and hashable, so jit caches by it.

    Attributes:
      block_q, block_k: forward tile, rows of Q by rows of K/V.
      block_q_bwd, block_k_bwd: backward tiles (dK/dV and dQ kernels).
      num_warps: warps per Triton program, used by the forward and both backward kernels.
      num_stages: software-pipelining depth of the K/V loads.

    The Pallas kernels need powers of two >= 16 (Triton's ``dot``) and shrink a tile to the
    smallest such power covering the sequence (T = 7 runs 16-row tiles); the "xla" path uses only
    ``block_q``/``block_k``, any positive size.
    """

    block_q: int = 64
    block_k: int = 64
    block_q_bwd: int = 64
    block_k_bwd: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BlockSizes.{f.name} must be a positive int, got {value!r}")

    @classmethod
    def get_default(cls, head_dim: int = 64, dtype=jnp.bfloat16) -> BlockSizes:
        """Defaults by padded head dim Dp and dtype, chosen so that every kernel compiles without
        register spills on sm_90 (H100/H200) and sm_80 (A100).

        Checked by ``make gpu-compile`` (ptxas on the real kernels, every D and mask; see the
        README's GPU section). The accumulators live in registers, ``[block, Dp]`` float32 per
        program (two of them, dK and dV, in the dK/dV kernel), so the tiles shrink as Dp and the
        element size grow, and 8 warps share them where 4 spilled (D <= 64 forward and D > 128
        backward on sm_80; D > 128 backward on sm_90). One table serves both architectures.

        ====================  =============  ==============  =====  ======
        dtype, Dp             forward q x k  backward q x k  warps  stages
        ====================  =============  ==============  =====  ======
        16-bit, Dp <= 128     128 x 64       64 x 32         8      2
        16-bit, Dp = 256      64 x 32        32 x 32         8      1
        float32, Dp <= 64     64 x 32        32 x 32         4      2
        float32, Dp = 128     32 x 32        32 x 32         8      2
        float32, Dp = 256     32 x 32        16 x 16         8      1
        ====================  =============  ==============  =====  ======

        At Dp = 256 the K/V loads are not software-pipelined (``num_stages=1``): the forward
        spilled with two stages on both architectures.
        """
        Dp = padded_head_dim(_check_head_dim(head_dim))
        if jnp.dtype(dtype).itemsize >= 4:
            if Dp <= 64:  # with 8 warps ptxas held sm_80 to 128 registers and the forward spilled
                return cls(block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=32, num_warps=4)
            if Dp <= 128:
                return cls(block_q=32, block_k=32, block_q_bwd=32, block_k_bwd=32, num_warps=8)
            return cls(
                block_q=32, block_k=32, block_q_bwd=16, block_k_bwd=16, num_warps=8, num_stages=1
            )
        if Dp <= 128:
            return cls(block_q=128, block_k=64, block_q_bwd=64, block_k_bwd=32, num_warps=8)
        return cls(
            block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=32, num_warps=8, num_stages=1
        )


def decode_blocks(rows: int, head_dim: int, dtype) -> tuple[int, int, int, int]:
    """``(block_m, block_n, num_warps, num_stages)`` of the split-KV decode kernel.

    ``rows = G * Tq`` packed query rows; ``block_m`` (at most 32: 64 spilled on sm_80 at D = 64)
    packed rows and ``block_n`` keys per tile.
    Keys are gathered row by row (a pointer per element), so the K/V tiles cost registers as well
    as the accumulator: the tiles shrink with Dp and the element size (16 keys at Dp = 256 keep
    D = 192, whose masked lanes cost most, at 184 registers on sm_80), and for float32 or
    Dp = 256 the loads are not software-pipelined (``num_stages=1``: half the registers). 8 warps
    made ptxas spill heavily on sm_80, so 4. Checked like :meth:`BlockSizes.get_default`.
    """
    Dp = padded_head_dim(_check_head_dim(head_dim))
    half = jnp.dtype(dtype).itemsize < 4
    block_m = min(shapes.next_pow2(rows, floor=16), 32)
    if half:
        block_n = 64 if Dp <= 128 else 16
    else:
        block_n = 32 if Dp <= 32 else 16
    return block_m, block_n, 4, 2 if half and Dp <= 128 else 1


def num_splits_heuristic(
    batch_nheads_mblocks: int,
    num_sms: int,
    num_n_blocks: int,
    max_splits: int = 128,
) -> int:
    """How many KV splits a decode call should use (FlashAttention's rule).

    No split when the (batch, kv-head, query-block) programs alone fill 80% of the SMs. Otherwise
    pick the smallest split count whose wave efficiency ``n_waves / ceil(n_waves)`` is within 85%
    of the best one, over counts up to ``min(max_splits, num_sms, num_n_blocks)``; a count that
    gives the same number of KV blocks per split as the count below it is not eligible.
    """
    if batch_nheads_mblocks >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    if max_splits <= 1:
        return 1

    def eligible(n: int) -> bool:
        return n == 1 or math.ceil(num_n_blocks / n) != math.ceil(num_n_blocks / (n - 1))

    efficiency = {}
    for n in range(1, max_splits + 1):
        if eligible(n):
            waves = batch_nheads_mblocks * n / num_sms
            efficiency[n] = waves / math.ceil(waves)
    best = max(efficiency.values())
    return next(n for n, eff in efficiency.items() if eff >= 0.85 * best)


def xla_blocks(T: int, S: int) -> tuple[int, int]:
    """``(block_q, block_k)`` of the "xla" path: big enough to keep XLA's matmuls efficient on CPU,
    small enough for O(T) memory."""
    return min(512, shapes.round_up(T, 8)), min(512, shapes.round_up(S, 8))


def xla_cache_block(S: int, cap: int = 512) -> int | None:
    """Largest multiple of 8 <= cap dividing S (so the XLA path never pads a copy of a cache), or
    None (the default of :func:`xla_blocks`)."""
    for bk in range(min(cap, S) // 8 * 8, 7, -8):
        if S % bk == 0:
            return bk
    return None


def num_sms() -> int:
    """Streaming multiprocessors of the first GPU, or ``DEFAULT_NUM_SMS`` off GPU."""
    device = jax.devices()[0]
    return getattr(device, "core_count", None) or DEFAULT_NUM_SMS


def choose_splits(num_splits: int, programs: int, capacity: int, block_n: int) -> int:
    """``num_splits`` as asked, or :func:`num_splits_heuristic` for 0, capped by the key blocks."""
    n_blocks = -(-capacity // block_n)
    if num_splits == 0:
        num_splits = num_splits_heuristic(programs, num_sms(), n_blocks)
    return max(1, min(num_splits, n_blocks))
