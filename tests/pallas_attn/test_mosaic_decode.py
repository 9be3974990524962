"""attention_with_kvcache with the Mosaic GPU decode kernel under JAX's GPU interpreter
(``impl="mosaic_interpret"``) against the reference: values, caches, splits, unowned memory."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from attn_utils import max_err
from test_kvcache import Case, as_bits, call, make_inputs, tolerance
from test_kvcache_tree import ancestors_mask

IMPL = "mosaic_interpret"
# PackGQA rows G * Tq of 8, 20, 6 and 64; paged with pages of 16 (four per tile) and 64, and
# contiguous (through cache_batch_idx); leftpad, rotary, causal, window, softcap; D 64 and 128.
CASES = [
    Case(
        Tq=1, Tn=1, Hq=8, Hkv=1, D=64, S=128, page=16, leftpad=True, causal=True, dtype="bfloat16"
    ),
    Case(
        Tq=5,
        Tn=5,
        Hq=4,
        Hkv=1,
        D=64,
        S=128,
        batch_idx=True,
        rotary=(16, True),
        causal=True,
        dtype="float16",
    ),
    Case(
        Tq=3,
        Tn=0,
        Hq=2,
        Hkv=1,
        D=128,
        S=128,
        page=64,
        leftpad=True,
        window=(20, 0),
        softcap=3.0,
        dtype="bfloat16",
    ),
]
SLOW_CASES = [
    Case(
        Tq=5,
        Tn=5,
        Hq=8,
        Hkv=2,
        D=128,
        S=128,
        batch_idx=True,
        window=(40, 0),
        fp8=True,
        dtype="float16",
    ),
    Case(Tq=16, Tn=16, Hq=8, Hkv=2, D=128, S=256, page=32, causal=True, dtype="float16"),
    Case(Tq=1, Tn=0, Hq=4, Hkv=4, D=64, S=192, leftpad=True, dtype="bfloat16"),
]


def check(case: Case, seed: int, inputs=None, tree_mask=None, **extra):
    """Out and lse within the reference's tolerance; caches bit-identical (the same jnp write)."""
    inp = make_inputs(case, seed=seed) if inputs is None else inputs
    tree = {} if tree_mask is None else dict(tree_mask=jnp.asarray(tree_mask))
    got, want = call(inp, IMPL, **tree, **extra), call(inp, "reference", **tree)
    assert got.out.dtype == want.out.dtype and got.lse.dtype == jnp.float32
    assert max_err(got.out, want.out) <= tolerance(case)
    assert max_err(got.lse, want.lse) <= tolerance(case)
    for a, b in ((got.k_cache, want.k_cache), (got.v_cache, want.v_cache)):
        np.testing.assert_array_equal(as_bits(a), as_bits(b))
    return got


@pytest.mark.parametrize("case", CASES, ids=repr)
def test_mosaic_decode_matches_reference(case):
    check(case, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=repr)
def test_mosaic_decode_matches_reference_slow(case):
    check(case, seed=2)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mosaic_decode_num_splits(num_splits):
    case = Case(
        Tq=2,
        Tn=1,
        Hq=4,
        Hkv=2,
        D=64,
        S=256,
        page=16,
        leftpad=True,
        causal=True,
        window=(150, 0),
        dtype="bfloat16",
    )
    check(case, seed=3, num_splits=num_splits)


def test_mosaic_decode_ignores_unowned_memory():
    """NaN in every slot a row does not own (leftpad, past its length) changes nothing."""
    case = Case(Tq=2, Tn=1, Hq=4, Hkv=1, D=64, S=192, leftpad=True, causal=True, dtype="bfloat16")
    inp = make_inputs(case, seed=4)
    lens = np.asarray(inp.kwargs["cache_seqlens"]) + case.Tn
    pad = np.asarray(inp.kwargs["cache_leftpad"])
    pos = np.arange(case.S)
    unowned = (pos[None, :] < pad[:, None]) | (pos[None, :] >= lens[:, None])  # [B, S]
    poisoned = dataclasses.replace(
        inp,
        k_cache=jnp.where(unowned[..., None, None], jnp.nan, inp.k_cache).astype(inp.k_cache.dtype),
        v_cache=jnp.where(unowned[..., None, None], jnp.nan, inp.v_cache).astype(inp.v_cache.dtype),
    )
    clean, dirty = call(inp, IMPL), call(poisoned, IMPL)
    np.testing.assert_array_equal(as_bits(clean.out), as_bits(dirty.out))
    np.testing.assert_array_equal(as_bits(clean.lse), as_bits(dirty.lse))


def test_mosaic_decode_fp8_cache():
    """A float8_e4m3fn paged cache with per-(row, KV head) descales (tiles upcast in SMEM), NaN
    in every slot a row does not own: within the reference's tolerance, finite, the written
    slots bit-identical (the same quantising jnp write)."""
    case = Case(Tq=2, Tn=1, Hq=4, Hkv=1, D=64, S=128, page=16, leftpad=True, causal=True, fp8=True)
    case = dataclasses.replace(case, dtype="bfloat16")
    inp = make_inputs(case, seed=7)
    table = np.asarray(inp.kwargs["block_table"])
    lens = np.asarray(inp.kwargs["cache_seqlens"]) + case.Tn
    pad = np.asarray(inp.kwargs["cache_leftpad"])
    owned = np.zeros(inp.k_cache.shape[:2], bool)  # [num_pages, P]
    for b in range(case.B):
        for pos in range(pad[b], lens[b]):
            owned[table[b, pos // case.page], pos % case.page] = True
    poison = jnp.asarray(~owned[..., None, None])
    inp = dataclasses.replace(
        inp,
        k_cache=jnp.where(poison, jnp.nan, inp.k_cache).astype(inp.k_cache.dtype),
        v_cache=jnp.where(poison, jnp.nan, inp.v_cache).astype(inp.v_cache.dtype),
    )
    got = check(case, seed=7, inputs=inp)
    assert np.all(np.isfinite(np.asarray(got.out, np.float32)))


def _tree(Tq: int, seed: int):
    """[Tq, Tq] ancestor mask of a random token tree (node 0 the root, parents before children)."""
    parents = [-1] + [int(p) for p in np.random.default_rng(seed).integers(0, np.arange(1, Tq))]
    return ancestors_mask(parents)


# (case, num_splits): PackGQA rows of two query heads per tree node; a 40-node tree (two words of
# mask bits per row) over an FP8 cache in float16, split.
TREE_CASES = [
    (Case(Tq=7, Tn=7, Hq=4, Hkv=2, D=64, S=128, page=16, causal=True, dtype="bfloat16"), 0),
]
TREE_SLOW_CASES = [
    (
        Case(
            Tq=40,
            Tn=40,
            Hq=2,
            Hkv=2,
            D=128,
            S=192,
            leftpad=True,
            causal=True,
            fp8=True,
            dtype="float16",
        ),
        2,
    ),
]


def _check_tree(case, num_splits):
    tree = np.stack([_tree(case.Tq, 0), _tree(case.Tq, 1)])  # one tree per batch row
    inp = make_inputs(case, seed=8)
    chain = call(inp, "reference").out  # causal only: the test must see the tree
    got = check(case, seed=8, inputs=inp, tree_mask=tree, num_splits=num_splits)
    assert max_err(got.out, chain) > tolerance(case)


@pytest.mark.parametrize(("case", "num_splits"), TREE_CASES, ids=repr)
def test_mosaic_decode_tree_mask(case, num_splits):
    """Token-tree verification (Tq > 1): each query sees the cache and its ancestors."""
    _check_tree(case, num_splits)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "num_splits"), TREE_SLOW_CASES, ids=repr)
def test_mosaic_decode_tree_mask_slow(case, num_splits):
    _check_tree(case, num_splits)


@pytest.mark.parametrize(
    ("case", "extra", "error", "match"),
    [
        (Case(D=64, S=128), {}, TypeError, "bfloat16 or float16"),
        (Case(D=40, S=128, dtype="bfloat16"), {}, ValueError, "head dims"),
        (Case(D=64, S=96, page=24, dtype="bfloat16"), {}, ValueError, "page size"),
        (Case(D=64, S=100, dtype="bfloat16"), {}, ValueError, "multiple of 64"),
    ],
)
def test_mosaic_decode_rejects_what_it_cannot_run(case, extra, error, match):
    inp = make_inputs(case, seed=5)
    extra = {k: jnp.asarray(v) for k, v in extra.items()}
    with pytest.raises(error, match=match):
        call(inp, IMPL, **extra)


@pytest.mark.parametrize(("case", "want"), [(CASES[0], "mosaic"), (CASES[0], "pallas")])
def test_auto_picks_mosaic_decode_on_hopper(monkeypatch, case, want):
    """On sm_90+ "auto" runs the Mosaic kernel where it applies, else the Triton one."""
    import jax

    from pallas_attn import kvcache, validation

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(validation, "_compute_capability", lambda: 9)
    seen, result = [], (jnp.zeros(1), jnp.zeros(1), None, None)
    monkeypatch.setattr(kvcache, "_mosaic", lambda *a, **k: seen.append("mosaic") or result)
    monkeypatch.setattr(kvcache, "_pallas", lambda *a, **k: seen.append("pallas") or result)
    if want == "pallas":
        case = dataclasses.replace(case, D=40)
    call(make_inputs(case, seed=6), "auto")
    assert seen == [want]


@pytest.mark.parametrize(("dtype", "Tq"), [("bfloat16", 2), ("float16", 40)])
def test_mosaic_decode_fp8_lowers_for_sm90(dtype, Tq):
    """The compiled path lowers for CUDA on a CPU-only machine with an FP8 paged cache and a tree
    mask (the interpreter skips the layouts and the conversions sm_90 lacks: e4m3 -> bf16 goes
    via f32); a 40-node tree takes two words of mask bits per row."""
    import jax

    from pallas_attn import attention_with_kvcache

    B, Hkv, G, D, P, S = 2, 2, 4, 128, 16, 256
    sds = jax.ShapeDtypeStruct
    cache = sds((B * S // P, P, Hkv, D), jnp.float8_e4m3fn)
    args = (
        sds((B, Tq, G * Hkv, D), jnp.dtype(dtype)),
        cache,
        cache,
        sds((B,), jnp.int32),
        sds((B, S // P), jnp.int32),
        sds((B, Hkv), jnp.float32),
        sds((B, Tq, Tq), jnp.bool_),
    )

    def step(q, k_cache, v_cache, lens, table, descale, tree):
        res = attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=lens,
            block_table=table,
            k_descale=descale,
            v_descale=descale,
            causal=True,
            tree_mask=tree,
            impl="mosaic",
        )
        return res.out

    text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
