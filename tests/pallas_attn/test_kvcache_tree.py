"""``attention_with_kvcache(tree_mask=...)``: tree attention among the new tokens, every impl
against a plain numpy oracle, CUDA lowering, bad masks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kvcache_lowering import lower_decode_step

from pallas_attn import attention_with_kvcache

B, Hq, Hkv, D, S, P = 2, 4, 2, 16, 32, 8
PARENTS = [-1, 0, 0, 1, 2, 1, 3]  # node 0 is the root (the last accepted token)


def ancestors_mask(parents):
    """[T, T] bool: node j is i or an ancestor of i."""
    T = len(parents)
    m = np.eye(T, dtype=bool)
    for i in range(T):
        j = parents[i]
        while j >= 0:
            m[i, j] = True
            j = parents[j]
    return m


def inputs(seed=0):
    r = np.random.default_rng(seed)
    T = len(PARENTS)
    f = lambda *s: r.standard_normal(s).astype(np.float32)  # noqa: E731
    seqlens = np.array([5, 13], np.int32)
    return dict(
        q=f(B, T, Hq, D),
        kc=f(B, S, Hkv, D),
        vc=f(B, S, Hkv, D),
        k=f(B, T, Hkv, D),
        v=f(B, T, Hkv, D),
        seqlens=seqlens,
    )


def oracle(x, tree):
    """numpy: row b's query i sees cache keys < seqlens[b] and new key j where tree[b, i, j]."""
    T = x["q"].shape[1]
    out = np.zeros_like(x["q"])
    for b in range(B):
        n = x["seqlens"][b]
        keys = np.concatenate([x["kc"][b, :n], x["k"][b]])
        vals = np.concatenate([x["vc"][b, :n], x["v"][b]])
        for i in range(T):
            vis = np.concatenate([np.ones(n, bool), tree[b, i]])
            for h in range(Hq):
                s = keys[vis, h // (Hq // Hkv)] @ x["q"][b, i, h] / np.sqrt(D)
                p = np.exp(s - s.max())
                out[b, i, h] = (p / p.sum()) @ vals[vis, h // (Hq // Hkv)]
    return out


def run(x, tree, impl, paged):
    kc, vc, kw = x["kc"], x["vc"], {}
    if paged:  # row b's logical page i is physical page perm[b * S/P + i]
        perm = np.random.default_rng(1).permutation(B * S // P).reshape(B, S // P)
        kc = np.zeros((B * S // P, P, Hkv, D), np.float32)
        vc = np.zeros_like(kc)
        kc[perm] = x["kc"].reshape(B, S // P, P, Hkv, D)
        vc[perm] = x["vc"].reshape(B, S // P, P, Hkv, D)
        kw["block_table"] = jnp.asarray(perm, jnp.int32)
    return attention_with_kvcache(
        x["q"],
        kc,
        vc,
        x["k"],
        x["v"],
        cache_seqlens=x["seqlens"],
        causal=True,
        tree_mask=tree,
        impl=impl,
        **kw,
    ).out


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("impl", ["reference", "xla", "interpret"])
def test_tree_mask_matches_oracle(impl, paged):
    x = inputs()
    tree = np.stack([ancestors_mask(PARENTS), np.tril(np.ones((7, 7), bool))])  # per row
    want = oracle(x, tree)
    np.testing.assert_allclose(np.asarray(run(x, tree, impl, paged)), want, atol=2e-5)
    # The mask matters: a chain (causal) mask gives another result for the tree row.
    chain = np.stack([np.tril(np.ones((7, 7), bool))] * 2)
    assert not np.allclose(np.asarray(run(x, chain, impl, paged))[0], want[0], atol=1e-3)


def test_shared_2d_mask_broadcasts():
    x = inputs(1)
    tree = ancestors_mask(PARENTS)
    got = run(x, tree, "xla", False)
    np.testing.assert_allclose(np.asarray(got), oracle(x, np.stack([tree] * B)), atol=2e-5)


@pytest.mark.parametrize("bad", [np.ones((7, 6), bool), np.ones((7, 7), np.int32), "x"])
def test_bad_tree_mask_raises(bad):
    x = inputs()
    with pytest.raises(ValueError, match="tree_mask"):
        run(x, bad, "reference", False)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_tree_mask_lowers_for_cuda(paged):
    tree = jax.ShapeDtypeStruct((2, 11, 11), jnp.bool_)
    text = lower_decode_step(Tq=11, paged=paged, causal=True, tree_mask=tree)
    assert "kvcache_decode" in text
