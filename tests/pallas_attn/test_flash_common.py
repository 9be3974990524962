"""The block-range helpers the flash kernels use to skip and to un-mask tiles, against brute force."""

import itertools

import numpy as np
import pytest

from pallas_attn import masks
from pallas_attn.kernels import flash_common as fc

WINDOWS = [(-1, -1), (-1, 0), (5, 0), (0, 3), (7, 2), (20, -1), (-1, 9)]


def _config(window):
    return fc.Config(
        softmax_scale=1.0,
        window=window,
        softcap=0.0,
        segments=False,
        block_q=8,
        block_k=8,
        block_q_bwd=8,
        block_k_bwd=8,
        num_warps=4,
        num_stages=2,
        interpret=True,
    )


def _cases():
    rng = np.random.default_rng(0)
    for window in WINDOWS:
        for _ in range(4):
            T, S = (int(x) for x in rng.integers(1, 40, 2))
            kv_len = int(rng.integers(0, S + 1))
            kv_start = int(rng.integers(0, max(kv_len, 1)))
            q_offset = int(rng.integers(-T, S + 5))
            yield window, T, S, q_offset, kv_start, kv_len


def _blocks(n, b):
    return -(-n // b)


@pytest.mark.parametrize("window", WINDOWS)
def test_block_ranges_match_brute_force(window):
    bq = bk = 8
    cfg = _config(window)
    for _, T, S, q_offset, kv_start, kv_len in (c for c in _cases() if c[0] == window):
        nq, nk = _blocks(T, bq), _blocks(S, bk)
        rows = np.arange(nq * bq)[:, None]
        keys = np.arange(nk * bk)[None, :]
        vis = np.asarray(
            masks.visible(rows + q_offset, keys, window=window, kv_start=kv_start, kv_len=kv_len)
        )
        for i, j in itertools.product(range(nq), range(nk)):
            tile = vis[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            q_first, k_first = q_offset + i * bq, j * bk
            q_last, k_last = q_first + bq - 1, k_first + bk - 1
            args = (kv_start, kv_len)
            lo, hi = fc.key_block_range(cfg, q_first, q_last, *args, bk, nk)
            full = fc.full_key_blocks(cfg, q_first, q_last, *args, bk)
            in_range = int(lo) <= j < int(hi)
            a = int(np.clip(full[0], lo, hi))
            unmasked = a <= j < int(np.clip(full[1], a, hi))
            assert in_range or not tile.any(), (i, j, "key block skipped but visible")
            assert not unmasked or tile.all(), (i, j, "key block unmasked but not fully visible")

            lo, hi = fc.query_block_range(cfg, k_first, k_last, q_offset, *args, bq, nq)
            full = fc.full_query_blocks(cfg, k_first, k_last, q_offset, *args, bq, nq)
            in_range = int(lo) <= i < int(hi)
            a = int(np.clip(full[0], lo, hi))
            unmasked = a <= i < int(np.clip(full[1], a, hi))
            assert in_range or not tile.any(), (i, j, "query block skipped but visible")
            assert not unmasked or tile.all(), (i, j, "query block unmasked but not fully visible")


def test_causal_interior_tiles_are_unmasked():
    """The split is not vacuous: with T = S = 64 causal, 8 x 8 tiles below the diagonal."""
    cfg = _config((-1, 0))
    lo, hi = fc.key_block_range(cfg, 40, 47, 0, 64, 8, 8)
    full = fc.full_key_blocks(cfg, 40, 47, 0, 64, 8)
    assert (int(lo), int(hi)) == (0, 6)
    assert (int(full[0]), int(full[1])) == (0, 5)
