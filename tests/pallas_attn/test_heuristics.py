"""num_splits_heuristic on cases computed by hand for a 132-SM GPU (H100/H200 SXM).

Notation: ``programs = batch * kv_heads * m_blocks``, ``eff(n) = w / ceil(w)`` with
``w = programs * n / 132`` waves; ``n`` is eligible when ``ceil(blocks / n) != ceil(blocks / (n-1))``.
"""

import pytest

from pallas_attn import num_splits_heuristic

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
