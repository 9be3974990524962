"""attention_with_kvcache with the Mosaic GPU decode kernel under JAX's GPU interpreter
(``impl="mosaic_interpret"``) against the reference: values, caches, splits, unowned memory."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from attn_utils import max_err
from test_kvcache import Case, as_bits, call, make_inputs, tolerance

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


def check(case: Case, seed: int, inputs=None, **extra):
    """Out and lse within the reference's tolerance; caches bit-identical (the same jnp write)."""
    inp = make_inputs(case, seed=seed) if inputs is None else inputs
    got, want = call(inp, IMPL, **extra), call(inp, "reference")
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


@pytest.mark.parametrize(
    ("case", "extra", "error", "match"),
    [
        (Case(D=64, S=128), {}, TypeError, "bfloat16 or float16"),
        (Case(D=40, S=128, dtype="bfloat16"), {}, ValueError, "head dims"),
        (Case(D=64, S=96, page=24, dtype="bfloat16"), {}, ValueError, "page size"),
        (Case(D=64, S=100, dtype="bfloat16"), {}, ValueError, "multiple of 64"),
        (
            Case(Tq=2, D=64, S=128, dtype="bfloat16"),
            dict(tree_mask=np.eye(2, dtype=bool)),
            ValueError,
            "tree_mask",
        ),
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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mosaic_decode_fp8_lowers_for_sm90(dtype):
    """The compiled path lowers for CUDA on a CPU-only machine with an FP8 paged cache (the
    interpreter skips the layouts and the conversions sm_90 lacks: e4m3 -> bf16 goes via f32)."""
    import jax

    from pallas_attn import attention_with_kvcache

    B, Hkv, G, D, P, S = 2, 2, 4, 128, 16, 256
    sds = jax.ShapeDtypeStruct
    cache = sds((B * S // P, P, Hkv, D), jnp.float8_e4m3fn)
    args = (
        sds((B, 2, G * Hkv, D), jnp.dtype(dtype)),
        cache,
        cache,
        sds((B,), jnp.int32),
        sds((B, S // P), jnp.int32),
        sds((B, Hkv), jnp.float32),
    )

    def step(q, k_cache, v_cache, lens, table, descale):
        res = attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=lens,
            block_table=table,
            k_descale=descale,
            v_descale=descale,
            causal=True,
            impl="mosaic",
        )
        return res.out

    text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
