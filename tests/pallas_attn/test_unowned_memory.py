"""Memory a row does not own never reaches its output (issue 17, item 1).

A paged engine recycles pages and a GPU hands out uninitialised memory, so cache slots past a row's
length, its leftpad slots, pages that only pad its block table, and the padding of packed/varlen
batches may hold NaN or inf. Every impl must ignore them: the output, the lse, the gradients and
the slots the call writes are the same as with a clean cache, bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_attn import BlockSizes, attention_with_kvcache, flash_attention_varlen
from pallas_attn.api import run_impl

IMPLS = ("reference", "xla", "interpret")
POISON = st.sampled_from([np.nan, np.inf, -np.inf])
SMALL = BlockSizes(block_q=16, block_k=16, block_q_bwd=16, block_k_bwd=16)
SETTINGS = settings(max_examples=4, deadline=None, database=None, derandomize=True)

B, Tq, Tn, Hq, Hkv, D = 2, 2, 1, 2, 1, 16
S, P = 12, 4  # capacity of a row; page size
MAX_BLOCKS, JUNK_PAGES = S // P, 2


def _bits(x):
    x = np.asarray(x)
    return x.view(np.dtype(f"u{x.dtype.itemsize}"))


def _cache_layout(paged: bool, lens, pad, junk):
    """Physical cache shape, call kwargs, and ``owned[b]``: a mask of the physical slots that
    hold row ``b``'s keys ``[pad[b], lens[b] + Tn)`` after the call."""
    if not paged:
        rows = np.array([2, 0], np.int32)  # cache row 1 belongs to nobody
        shape = (B + 1, S, Hkv, D)
        owned = np.zeros(shape[:2], bool)
        for b in range(B):
            owned[rows[b], pad[b] : lens[b] + Tn] = True
        return shape, dict(cache_batch_idx=jnp.asarray(rows)), owned
    num_pages = B * MAX_BLOCKS + JUNK_PAGES
    table = np.arange(B * MAX_BLOCKS, dtype=np.int32)[::-1].reshape(B, MAX_BLOCKS).copy()
    owned = np.zeros((num_pages, P), bool)
    for b in range(B):
        for pos in range(pad[b], lens[b] + Tn):
            owned[table[b, pos // P], pos % P] = True
        used = -(-(lens[b] + Tn) // P)
        table[b, used:] = B * MAX_BLOCKS + junk[b]  # padding entries point at a poisoned page
    return (num_pages, P, Hkv, D), dict(block_table=jnp.asarray(table)), owned


@pytest.mark.parametrize("layout", ["contiguous", "paged", "paged-fp8"])
@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(
    lens=st.lists(st.integers(0, S - Tn), min_size=B, max_size=B),
    pad_frac=st.lists(st.floats(0, 1), min_size=B, max_size=B),
    junk=st.lists(st.integers(0, JUNK_PAGES - 1), min_size=B, max_size=B),
    poison=POISON,
    causal=st.booleans(),
)
def test_kvcache_ignores_unowned_slots(impl, layout, lens, pad_frac, junk, poison, causal):
    fp8 = layout.endswith("fp8")
    lens = np.array(lens, np.int32)
    pad = np.floor(np.array(pad_frac) * lens).astype(np.int32)
    shape, kw, owned = _cache_layout(layout != "contiguous", lens, pad, junk)
    rng = np.random.default_rng(int(lens.sum()))
    k_cache, v_cache = (rng.normal(size=shape).astype(np.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(B, Tq, Hq, D)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(B, Tn, Hkv, D)), jnp.float32) for _ in range(2))
    cache_dtype = jnp.float8_e4m3fn if fp8 else jnp.float32
    if fp8:
        poison = np.nan  # float8_e4m3fn has no inf
    mask = owned[..., None, None]
    call = functools.partial(
        attention_with_kvcache,
        q,
        k=k,
        v=v,
        cache_seqlens=jnp.asarray(lens),
        cache_leftpad=jnp.asarray(pad),
        causal=causal,
        return_lse=True,
        impl=impl,
        **kw,
    )
    clean = call(jnp.asarray(k_cache, cache_dtype), jnp.asarray(v_cache, cache_dtype))
    dirty_k = jnp.asarray(np.where(mask, k_cache, poison), cache_dtype)
    dirty_v = jnp.asarray(np.where(mask, v_cache, -poison), cache_dtype)
    dirty = call(dirty_k, dirty_v)
    assert np.all(np.isfinite(np.asarray(dirty.out)))
    np.testing.assert_array_equal(np.asarray(dirty.out), np.asarray(clean.out))
    np.testing.assert_array_equal(np.asarray(dirty.lse), np.asarray(clean.lse))
    for got, want, before in (
        (dirty.k_cache, clean.k_cache, dirty_k),
        (dirty.v_cache, clean.v_cache, dirty_v),
    ):
        got, want, before = _bits(got), _bits(want), _bits(before)
        np.testing.assert_array_equal(got[owned], want[owned])  # written and owned slots
        np.testing.assert_array_equal(got[~owned], before[~owned])  # the rest untouched


@functools.cache
def _kv_len_grad(impl):
    """Jitted ``grad`` (and out, lse) of a loss over ``run_impl`` with per-row key ranges."""

    def loss(q, k, v, q_offset, kv_start, kv_len):
        out, lse = run_impl(
            impl,
            q,
            k,
            v,
            block_sizes=SMALL,
            softmax_scale=0.25,
            window=(-1, 0),
            softcap=0.0,
            q_offset=q_offset,
            kv_start=kv_start,
            kv_len=kv_len,
        )
        return jnp.sum(out * jnp.cos(q)), (out, lse)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("impl", IMPLS)
@SETTINGS
@given(
    lens=st.lists(st.integers(1, 9), min_size=2, max_size=2),
    starts=st.lists(st.integers(0, 5), min_size=2, max_size=2),
    poison=POISON,
)
def test_kv_len_padding_ignored_forward_and_backward(impl, lens, starts, poison):
    """Keys outside ``[kv_start, kv_len)`` (the prefill and varlen padding) hold poison: output,
    lse and gradients equal the clean ones, and the gradient of a poisoned key is 0."""
    T, Sk = 5, 12
    lens = np.array(lens) + 2
    starts = np.minimum(np.array(starts), lens - 1)
    rng = np.random.default_rng(int(lens.sum() + 10 * starts.sum()))
    q = jnp.asarray(rng.normal(size=(2, T, 2, 16)), jnp.float32)
    k, v = (rng.normal(size=(2, Sk, 1, 16)).astype(np.float32) for _ in range(2))
    pos = np.arange(Sk)[None, :]
    owned = ((pos >= starts[:, None]) & (pos < lens[:, None]))[..., None, None]
    lengths = tuple(jnp.asarray(x, jnp.int32) for x in (lens - T, starts, lens))
    results = []
    for kk, vv in ((k, v), (np.where(owned, k, poison), np.where(owned, v, -poison))):
        results.append(_kv_len_grad(impl)(q, jnp.asarray(kk), jnp.asarray(vv), *lengths))
    (g_clean, (out_clean, lse_clean)), (g_dirty, (out_dirty, lse_dirty)) = results
    np.testing.assert_array_equal(np.asarray(out_dirty), np.asarray(out_clean))
    np.testing.assert_array_equal(np.asarray(lse_dirty), np.asarray(lse_clean))
    for a, b in zip(g_dirty, g_clean, strict=True):
        assert np.all(np.isfinite(np.asarray(a)))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for g in g_dirty[1:]:
        assert np.all(np.asarray(g)[~np.broadcast_to(owned, g.shape)] == 0)


def test_varlen_ignores_tokens_past_the_last_sequence():
    """Packed tensors longer than ``cu_seqlens[-1]``: the tail is no sequence's and is ignored
    (the unpacking is shared by every impl; the padding it makes is the kv_len case above)."""
    rng = np.random.default_rng(0)
    cu_q, cu_k = jnp.array([0, 3, 5], jnp.int32), jnp.array([0, 4, 9], jnp.int32)
    q = rng.normal(size=(8, 2, 16)).astype(np.float32)
    k, v = (rng.normal(size=(12, 1, 16)).astype(np.float32) for _ in range(2))

    def loss(q, k, v):
        out, lse = flash_attention_varlen(
            q, k, v, cu_q, cu_k, 3, 5, causal=True, return_lse=True, impl="reference"
        )
        return jnp.sum(out), (out, lse)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    results = []
    for poison in (None, np.nan):
        qq, kk, vv = (x.copy() for x in (q, k, v))
        if poison is not None:
            qq[5:], kk[9:], vv[9:] = poison, -np.inf, np.inf
        args = tuple(jnp.asarray(x) for x in (qq, kk, vv))
        results.append(grad(*args))
    (g_clean, (out_clean, lse_clean)), (g_dirty, (out_dirty, lse_dirty)) = results
    np.testing.assert_array_equal(np.asarray(out_dirty)[:5], np.asarray(out_clean)[:5])
    np.testing.assert_array_equal(np.asarray(lse_dirty), np.asarray(lse_clean))
    for a, b in zip(g_dirty, g_clean, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
