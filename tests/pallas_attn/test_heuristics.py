"""num_splits_heuristic on cases computed by hand for a 132-SM GPU (H100/H200 SXM).

Notation: ``programs = batch * kv_heads * m_blocks``, ``eff(n) = w / ceil(w)`` with
``w = programs * n / 132`` waves; ``n`` is eligible when ``ceil(blocks / n) != ceil(blocks / (n-1))``.
"""

import jax.numpy as jnp
import pytest

from pallas_attn import BlockSizes, num_splits_heuristic
from pallas_attn.heuristics import decode_blocks, padded_head_dim

SMS = 132


@pytest.mark.parametrize(
    "programs,n_blocks,want",
    [
        # 106 >= 0.8 * 132 = 105.6: the programs alone fill the GPU, no split.
        (106, 512, 1),
        # 105 < 105.6, 8 key blocks. Eligible n: 1, 2, 3, 4, 8 (5..7 give 2 blocks per split,
        # like 4). eff(1..4) = 105/132 = 0.795, eff(8) = 6.36/7 = 0.909 is the best;
        # 0.85 * 0.909 = 0.773 <= 0.795, so n = 1.
        (105, 8, 1),
        # B=1, Hkv=8, S=32k with 64-key tiles: 512 blocks. Every n with eff > 32/33 (n = 33, 49,
        # 65, 66, 81, 82, ...) is ineligible, so the best is 32/33 = 0.970 (n = 16, 32, 64).
        # Smallest eligible n with eff = 8n/132 >= 0.85 * 0.970 = 0.824 is n = 14 (0.848).
        (8, 512, 14),
        # B=8, Hkv=8: eff(2) = 128/132 = 0.970, eff(35) = 16.97/17 = 0.998 is the best;
        # 0.85 * 0.998 = 0.848 <= 0.970, and eff(1) = 0.485 is not, so n = 2.
        (64, 512, 2),
        # One program, 1000 blocks: n <= 128 stays under one wave, eff = n / 132. The largest
        # eligible n is 125 (ceil(1000/125) = 8, ceil(1000/124) = 9; 126..128 also give 8), so the
        # best is 125/132 = 0.947 and the bar 0.805 asks n >= 107; 107..111 all give 10 blocks per
        # split like 100, the first eligible is 112 (9 blocks per split).
        (1, 1000, 112),
        # A single key block cannot be split.
        (4, 1, 1),
        # Two blocks: n = 2 is eligible; eff(1) = 4/132, eff(2) = 8/132 is the best, and
        # 0.85 * 8/132 > 4/132, so n = 2.
        (4, 2, 2),
    ],
)
def test_num_splits_heuristic_hand_computed(programs, n_blocks, want):
    assert num_splits_heuristic(programs, SMS, n_blocks) == want


def test_max_splits_caps_the_count():
    # (1, 1000) would pick 112; with at most 16 splits eff = n / 132 grows with n up to 16.
    # Eligible n <= 16 all are (ceil(1000/n) strictly decreases there); best 16/132,
    # 0.85 * 16 = 13.6, so n = 14.
    assert num_splits_heuristic(1, SMS, 1000, max_splits=16) == 14


# --- tile defaults ------------------------------------------------------------------------------
# ``make gpu-compile`` checks the defaults with ptxas on sm_90 and sm_80; these tests pin the
# register model behind them: float32 accumulators of a program, spread over its threads, take at
# most a quarter of the 255 registers a thread can hold (the former 4-warp tables took 128 at
# D = 256 and spilled).
HEAD_DIMS = [8, 32, 40, 64, 80, 96, 128, 160, 192, 256]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
ACC_REGISTER_BUDGET = 64


def _acc_registers(bs: BlockSizes, D: int) -> dict[str, float]:
    """float32 accumulator registers per thread of each flash kernel."""
    threads = 32 * bs.num_warps
    Dp = padded_head_dim(D)
    return {
        "fwd": bs.block_q * Dp / threads,  # acc [block_q, Dp]
        "dkdv": 2 * bs.block_k_bwd * Dp / threads,  # dK and dV [block_k_bwd, Dp]
        "dq": bs.block_q_bwd * Dp / threads,  # dQ [block_q_bwd, Dp]
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("D", HEAD_DIMS)
def test_default_accumulators_fit_the_register_budget(D, dtype):
    regs = _acc_registers(BlockSizes.get_default(D, dtype), D)
    assert max(regs.values()) <= ACC_REGISTER_BUDGET, regs


def test_default_tiles_shrink_with_head_dim_and_element_size():
    def area(D, dtype):
        bs = BlockSizes.get_default(D, dtype)
        return bs.block_q * bs.block_k, bs.block_q_bwd * bs.block_k_bwd

    for dtype in DTYPES:
        small, large = area(64, dtype), area(256, dtype)
        assert all(s > g for s, g in zip(small, large, strict=True)), dtype
    for D in HEAD_DIMS:
        half, full = area(D, jnp.bfloat16), area(D, jnp.float32)
        assert all(h > f for h, f in zip(half, full, strict=True)), D


@pytest.mark.parametrize("head_dim", [0, 257, 64.0, True])
def test_defaults_reject_bad_head_dims(head_dim):
    with pytest.raises(ValueError, match="head_dim"):
        BlockSizes.get_default(head_dim, jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        decode_blocks(8, head_dim, jnp.bfloat16)


@pytest.mark.parametrize(
    "rows,D,dtype,want",
    [
        # Decode of one token, G = 4: one 16-row tile, 64-key tiles, pipelined.
        (4, 128, jnp.bfloat16, (16, 64, 4, 2)),
        # 128 packed rows: 32-row tiles.
        (128, 64, jnp.bfloat16, (32, 64, 4, 2)),
        (128, 80, jnp.float16, (32, 64, 4, 2)),
        # Dp = 256 (D = 160 pads to 256): 16-key tiles, loads not pipelined.
        (128, 160, jnp.bfloat16, (32, 16, 4, 1)),
        # float32: 16-key tiles except at Dp <= 32, never pipelined.
        (128, 32, jnp.float32, (32, 32, 4, 1)),
        (40, 64, jnp.float32, (32, 16, 4, 1)),
        (128, 256, jnp.float32, (32, 16, 4, 1)),
    ],
)
def test_decode_blocks(rows, D, dtype, want):
    assert decode_blocks(rows, D, dtype) == want


def test_padded_head_dim():
    assert [padded_head_dim(D) for D in (1, 16, 17, 40, 64, 80, 128, 160, 256)] == [
        16,
        16,
        32,
        64,
        64,
        128,
        128,
        256,
        256,
    ]


def _default_tiles(D, dtype):
    bs = BlockSizes.get_default(D, dtype)
    return bs.block_q, bs.block_k, bs.block_q_bwd, bs.block_k_bwd


@pytest.mark.parametrize(
    ("case", "dtype"),
    [
        # 16-bit Dp <= 128: 128 x 64 forward, 64 x 32 backward; two query blocks, partial last.
        (dict(T=200, S=203, Hq=4, Hkv=2, D=64, causal=True), jnp.bfloat16),
        pytest.param(
            dict(T=70, S=45, Hq=2, Hkv=1, D=160, softcap=5.0), jnp.float32, marks=pytest.mark.slow
        ),
        pytest.param(
            dict(T=100, S=100, Hq=4, Hkv=1, D=96, window=(20, 3)),
            jnp.float16,
            marks=pytest.mark.slow,
        ),
    ],
    ids=["bf16-D64", "f32-D160", "f16-D96"],
)
def test_default_tiles_match_reference_interpret(case, dtype):
    """The kernels at the default tiles (not the tests' 16-row ones), interpreted."""
    from attn_utils import check_against_reference

    check_against_reference(dict(case, blocks=_default_tiles(case["D"], dtype)), dtype, "interpret")
