"""attention_with_kvcache: the reference against a NumPy loop, "xla"/"interpret" against the reference,
cache contents, paged == contiguous, num_splits, donation in place, and bad input."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from attn_utils import max_err, numpy_attention

import pallas_attn
from pallas_attn import attention_with_kvcache, cpu, native

FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Case:
    B: int = 2
    Tq: int = 1
    Tn: int = 1
    Hq: int = 4
    Hkv: int = 2
    D: int = 16
    S: int = 40  # capacity of a row (contiguous S, or max_blocks * P when paged)
    page: int | None = None  # P; None = contiguous cache
    leftpad: bool = False
    batch_idx: bool = False
    rotary: tuple[int, bool] | None = None  # (R, interleaved)
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    fp8: bool = False
    dtype: str = "float32"
    cache_dtype: str | None = None  # a 16-bit cache under float32 queries; None = dtype

    @property
    def stored_dtype(self) -> str:
        return self.cache_dtype or self.dtype


@dataclasses.dataclass
class Inputs:
    """Call arguments plus the logical (contiguous, per batch row) view of the cache."""

    q: np.ndarray
    k_cache: np.ndarray
    v_cache: np.ndarray
    k: np.ndarray | None
    v: np.ndarray | None
    kwargs: dict
    rows: np.ndarray  # [B] cache row (contiguous) of each batch row
    k_log: np.ndarray  # [B, S, Hkv, D] real values before the call
    v_log: np.ndarray


def make_inputs(case: Case, seed: int) -> Inputs:
    rng = np.random.default_rng(seed)
    B, S, Hkv, D = case.B, case.S, case.Hkv, case.D
    dtype = jnp.dtype(case.dtype)

    def normal(*shape):
        return rng.normal(size=shape).astype(np.float32)

    lens = rng.integers(0, S - case.Tn + 1, size=B).astype(np.int32)
    lens[0] = S - case.Tn  # one row filled to capacity
    kwargs = dict(cache_seqlens=jnp.asarray(lens), causal=case.causal, window_size=case.window)
    kwargs["softcap"] = case.softcap
    descale = None
    if case.fp8:
        descale = (rng.uniform(0.5, 2.0, (2, B, Hkv))).astype(np.float32)
        kwargs.update(k_descale=jnp.asarray(descale[0]), v_descale=jnp.asarray(descale[1]))
    k_log, v_log = normal(B, S, Hkv, D), normal(B, S, Hkv, D)
    if case.fp8:  # real values representable by the stored FP8 numbers
        k_log = _fp8_round(k_log / descale[0][:, None, :, None]) * descale[0][:, None, :, None]
        v_log = _fp8_round(v_log / descale[1][:, None, :, None]) * descale[1][:, None, :, None]
    else:
        k_log, v_log = (
            np.asarray(jnp.asarray(x, case.stored_dtype).astype(jnp.float32))
            for x in (k_log, v_log)
        )

    def stored(x, i=None):
        """What the cache holds for real values x (per batch row, or unscaled pool garbage)."""
        if case.fp8:
            d = 1.0 if i is None else descale[i][:, None, :, None]
            return (x / d).astype(ml_dtypes.float8_e4m3fn)
        return np.array(jnp.asarray(x, case.stored_dtype))

    rows = np.arange(B)
    if case.page is not None:
        P = case.page
        max_blocks = S // P
        num_blocks = B * max_blocks + 3
        perm = rng.permutation(num_blocks)
        table = perm[: B * max_blocks].reshape(B, max_blocks).astype(np.int32)
        k_cache, v_cache = (
            stored(normal(num_blocks, P, Hkv, D)),
            stored(normal(num_blocks, P, Hkv, D)),
        )
        kst, vst = stored(k_log, 0), stored(v_log, 1)
        for b in range(B):
            for j in range(max_blocks):
                k_cache[table[b, j]] = kst[b, j * P : (j + 1) * P]
                v_cache[table[b, j]] = vst[b, j * P : (j + 1) * P]
            used = -(-(lens[b] + case.Tn) // P)
            table[b, used:] = -1
        kwargs["block_table"] = jnp.asarray(table)
    elif case.batch_idx:
        rows = rng.permutation(B + 1)[:B]
        k_cache, v_cache = stored(normal(B + 1, S, Hkv, D)), stored(normal(B + 1, S, Hkv, D))
        k_cache[rows], v_cache[rows] = stored(k_log, 0), stored(v_log, 1)
        kwargs["cache_batch_idx"] = jnp.asarray(rows, jnp.int32)
    else:
        k_cache, v_cache = stored(k_log, 0), stored(v_log, 1)
    if case.leftpad:
        kwargs["cache_leftpad"] = jnp.asarray(rng.integers(0, lens + 1), jnp.int32)
    if case.rotary is not None:
        R, interleaved = case.rotary
        angle = rng.uniform(0, 2 * np.pi, (S + case.Tq + 8, R // 2)).astype(np.float32)
        kwargs.update(
            rotary_cos=jnp.asarray(np.cos(angle), dtype),
            rotary_sin=jnp.asarray(np.sin(angle), dtype),
            rotary_interleaved=interleaved,
        )
    q = jnp.asarray(normal(B, case.Tq, case.Hq, D), dtype)
    k = v = None
    if case.Tn:
        k = jnp.asarray(normal(B, case.Tn, Hkv, D), dtype)
        v = jnp.asarray(normal(B, case.Tn, Hkv, D), dtype)
    return Inputs(q, jnp.asarray(k_cache), jnp.asarray(v_cache), k, v, kwargs, rows, k_log, v_log)


def _fp8_round(x):
    return np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def call(inp: Inputs, impl: str, **extra):
    kw = {**inp.kwargs, **extra}
    return attention_with_kvcache(
        inp.q, inp.k_cache, inp.v_cache, inp.k, inp.v, return_lse=True, impl=impl, **kw
    )


def numpy_rotary(x, cos, sin, pos, interleaved):
    """x: [H, D] at one position, rotated pair by pair with explicit loops."""
    x = np.array(x, np.float64)
    out = x.copy()
    half = cos.shape[1]
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        c, s = float(cos[pos, i]), float(sin[pos, i])
        out[:, a] = x[:, a] * c - x[:, b] * s
        out[:, b] = x[:, b] * c + x[:, a] * s
    return out


def numpy_kvcache(case: Case, inp: Inputs):
    """Independent oracle: per-row loops over the logical cache. Returns (out, lse, k_new, v_new)
    with k_new/v_new the real values written at positions lens[b] + t."""
    kw = inp.kwargs
    lens = np.asarray(kw["cache_seqlens"])
    pad = np.asarray(kw.get("cache_leftpad", np.zeros_like(lens)))
    K, V = inp.k_log.astype(np.float64), inp.v_log.astype(np.float64)
    q = np.asarray(jnp.asarray(inp.q, jnp.float32), np.float64)
    windowed = case.causal or case.window != (-1, -1)
    new_k = new_v = None
    if case.Tn:
        new_k = np.asarray(jnp.asarray(inp.k, jnp.float32), np.float64)
        new_v = np.asarray(jnp.asarray(inp.v, jnp.float32), np.float64)
    if case.rotary is not None:
        cos = np.asarray(jnp.asarray(kw["rotary_cos"], jnp.float32))
        sin = np.asarray(jnp.asarray(kw["rotary_sin"], jnp.float32))
        inter = case.rotary[1]
        for b in range(case.B):
            base = lens[b] - pad[b]
            for i in range(case.Tq):
                q[b, i] = numpy_rotary(q[b, i], cos, sin, base + (i if windowed else 0), inter)
            for t in range(case.Tn):
                new_k[b, t] = numpy_rotary(new_k[b, t], cos, sin, base + t, inter)
    if case.Tn:
        new_k, new_v = (_as_stored(case, inp, x, i) for i, x in enumerate((new_k, new_v)))
        for b in range(case.B):
            K[b, lens[b] : lens[b] + case.Tn] = new_k[b]
            V[b, lens[b] : lens[b] + case.Tn] = new_v[b]
    out, lse = numpy_attention(
        q,
        K,
        V,
        scale=case.D**-0.5,
        causal=case.causal,
        window=case.window,
        softcap=case.softcap,
        q_offset=lens + case.Tn - case.Tq,
        kv_start=pad,
        kv_len=lens + case.Tn,
    )
    return out, lse, new_k, new_v


def _as_stored(case, inp, x, i):
    """Real value the cache holds after storing x (rounded to the cache dtype / FP8 grid)."""
    if case.fp8:
        d = np.asarray(inp.kwargs["v_descale" if i else "k_descale"])[:, None, :, None]
        return _fp8_round(x.astype(np.float32) / d) * d
    return np.asarray(jnp.asarray(x.astype(np.float32), case.stored_dtype).astype(jnp.float32))


def logical_cache(case: Case, inp: Inputs, cache, i):
    """The [B, S, Hkv, D] real values a returned cache holds for each batch row."""
    c = np.asarray(jnp.asarray(cache).astype(jnp.float32))
    if case.page is not None:
        table = np.asarray(inp.kwargs["block_table"])
        P, B = case.page, case.B
        out = np.zeros((B, case.S, case.Hkv, case.D), np.float32)
        for b in range(B):
            for j in range(case.S // P):
                if table[b, j] >= 0:
                    out[b, j * P : (j + 1) * P] = c[table[b, j]]
        c = out
    else:
        c = c[inp.rows]
    if case.fp8:
        c = c * np.asarray(inp.kwargs["v_descale" if i else "k_descale"])[:, None, :, None]
    return c


def check_caches(case: Case, inp: Inputs, res, new_k, new_v):
    """Written slots equal the oracle's stored values; every other slot is unchanged."""
    lens = np.asarray(inp.kwargs["cache_seqlens"])
    for i, (cache, before, new) in enumerate(
        ((res.k_cache, inp.k_log, new_k), (res.v_cache, inp.v_log, new_v))
    ):
        got = logical_cache(case, inp, cache, i)
        want = before.copy()
        valid = np.zeros(got.shape[:2], bool)
        for b in range(case.B):
            valid[b, : lens[b] + case.Tn] = True  # pages past the length are not in the table
            if case.Tn:
                want[b, lens[b] : lens[b] + case.Tn] = new[b]
        # Rotated keys are rounded from float32 math: allow one ulp of the stored dtype.
        tol = 0.0 if case.rotary is None or i == 1 else _ulp(case)
        np.testing.assert_allclose(got[valid], want[valid], rtol=tol, atol=tol)
    for name, cache in (("k_cache", res.k_cache), ("v_cache", res.v_cache)):
        original = inp.k_cache if name == "k_cache" else inp.v_cache
        assert cache.shape == original.shape and cache.dtype == original.dtype, name
    if case.page is None:  # cache rows that no batch row uses are untouched
        others = np.setdiff1d(np.arange(inp.k_cache.shape[0]), inp.rows)
        for got, orig in ((res.k_cache, inp.k_cache), (res.v_cache, inp.v_cache)):
            np.testing.assert_array_equal(as_bits(got)[others], as_bits(orig)[others])
    else:  # pages outside every table row are untouched
        table = np.asarray(inp.kwargs["block_table"])
        others = np.setdiff1d(np.arange(inp.k_cache.shape[0]), table[table >= 0])
        for got, orig in ((res.k_cache, inp.k_cache), (res.v_cache, inp.v_cache)):
            np.testing.assert_array_equal(as_bits(got)[others], as_bits(orig)[others])


def as_bits(x):
    """``x``'s bits as unsigned integers of its width (for bit-exact comparisons)."""
    x = np.asarray(x)
    return x.view(np.uint8 if x.dtype.itemsize == 1 else np.dtype(f"u{x.dtype.itemsize}"))


def _ulp(case):
    if case.fp8:
        return 0.13  # e4m3: 3 mantissa bits
    return {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}[case.stored_dtype]


def tolerance(case):
    """The error bound of a case's dtype (wider for float32 with rotary embeddings)."""
    base = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}[case.dtype]
    return max(base, 2e-3) if case.rotary is not None and case.dtype == "float32" else base


# A hand-picked set covering each option at least once, plus a seeded sample of the full cross.
HAND = [
    Case(),
    Case(Tq=5, Tn=5, Hq=4, Hkv=1, D=40, causal=True),
    Case(Tq=5, Tn=0, Hq=6, Hkv=3, S=33, page=None, leftpad=True, window=(3, 1)),
    Case(Tq=64, Tn=64, Hq=2, Hkv=2, S=80, page=16, causal=True),
    Case(Tq=1, Tn=1, Hq=8, Hkv=1, S=12, page=1, leftpad=True, softcap=3.0),
    Case(Tq=5, Tn=1, S=36, page=4, rotary=(8, True), causal=True),
    Case(Tq=5, Tn=5, D=40, rotary=(40, False), batch_idx=True, window=(6, 0)),
    Case(Tq=1, Tn=0, rotary=(16, False)),
    Case(Tq=5, Tn=5, fp8=True, causal=True, page=4, S=24),
    Case(Tq=1, Tn=1, fp8=True, batch_idx=True, dtype="bfloat16", rotary=(8, False)),
    Case(Tq=5, Tn=1, dtype="bfloat16", Hq=4, Hkv=1, causal=True, softcap=2.0, window=(4, -1)),
    Case(Tq=5, Tn=1, dtype="float16", leftpad=True, causal=True),
    # 16-bit caches under float32 queries: keys stored rounded, attended in float32.
    Case(Tq=5, Tn=5, D=40, causal=True, page=4, S=24, cache_dtype="bfloat16"),
    Case(Tq=1, Tn=1, Hq=8, Hkv=1, batch_idx=True, rotary=(8, False), cache_dtype="float16"),
    Case(B=3, Tq=1, Tn=1, Hq=9, Hkv=3, D=64, S=208, page=16, causal=True, cache_dtype="bfloat16"),
]


def sampled_cases(n: int, seed: int):
    rng = np.random.default_rng(seed)
    cases = []
    for _ in range(n):
        Tq = int(rng.choice([1, 5, 64]))
        Hq, Hkv = [(4, 1), (4, 2), (2, 2), (6, 3)][rng.integers(4)]
        page = [None, None, 1, 4, 16][rng.integers(5)]
        S = {None: int(rng.choice([33, 70])), 1: 24, 4: 36, 16: 96}[page]
        Tn = int(rng.choice([0, 1, Tq]))
        if Tn > S - 4:
            Tn = 1
        D = int(rng.choice([16, 40]))
        R = int(rng.choice([8, D]))
        window = [(-1, -1), (5, 0), (7, 3)][rng.integers(3)]
        cases.append(
            Case(
                Tq=Tq,
                Tn=Tn,
                Hq=Hq,
                Hkv=Hkv,
                D=D,
                S=S,
                page=page,
                leftpad=bool(rng.integers(2)),
                batch_idx=page is None and bool(rng.integers(2)),
                rotary=(R, bool(rng.integers(2))) if rng.integers(2) else None,
                causal=bool(rng.integers(2)),
                window=window,
                softcap=float(rng.choice([0.0, 4.0])),
                fp8=bool(rng.integers(4) == 0),
                dtype=str(rng.choice(["float32", "bfloat16"])),
            )
        )
    return cases


def check_impls(case: Case, seed: int):
    """The reference against the NumPy loop (values and cache contents), "xla" against the
    reference (values; caches bit-identical)."""
    inp = make_inputs(case, seed=seed)
    res = call(inp, "reference")
    out, lse, new_k, new_v = numpy_kvcache(case, inp)
    assert res.out.dtype == inp.q.dtype and res.lse.dtype == jnp.float32
    assert max_err(res.out, out) <= tolerance(case) * 4
    assert max_err(res.lse, lse) <= tolerance(case) * 4
    check_caches(case, inp, res, new_k, new_v)
    impls = ["xla"]
    if native.available():  # the C++ kernel, where it takes the shape
        impls.append("native" if case.Tq * case.Hq // case.Hkv <= cpu.MAX_ROWS else None)
    for impl in impls:
        if impl is None:
            with pytest.raises(ValueError, match="at most"):
                call(inp, "native")
            continue
        got = call(inp, impl)
        assert max_err(got.out, res.out) <= tolerance(case)
        assert max_err(got.lse, res.lse) <= tolerance(case)
        for a, b in ((got.k_cache, res.k_cache), (got.v_cache, res.v_cache)):
            np.testing.assert_array_equal(as_bits(a), as_bits(b))


def _runs_native(impl: str, inp: Inputs) -> bool:
    """Whether the traced program of ``call(inp, impl)`` calls the native kernel."""
    return native.KV_ATTENTION in str(jax.make_jaxpr(lambda: call(inp, impl))())


@pytest.mark.skipif(not native.available(), reason="native CPU kernels not built")
def test_native_is_an_impl_that_auto_picks_on_cpu():
    inp = make_inputs(Case(Tq=1, Tn=1, Hq=4, Hkv=2, S=40, page=8, causal=True), seed=2)
    assert _runs_native("auto", inp) and _runs_native("native", inp)
    assert not _runs_native("xla", inp)  # "xla" is the blockwise path, never silently native
    wide = make_inputs(Case(Tq=40, Tn=40, Hq=8, Hkv=2, S=60, page=None, causal=True), seed=2)
    assert not _runs_native("auto", wide)  # 160 queries per KV head: auto falls back to xla
    with pytest.raises(ValueError, match=r'impl="native" takes at most 128 queries'):
        call(wide, "native")


def test_native_is_not_an_impl_of_full_attention():
    q = jnp.zeros((1, 4, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match=r'impl="native".*not an implementation of this op'):
        pallas_attn.flash_attention(q, q, q, impl="native")


@pytest.mark.parametrize("case", HAND + sampled_cases(4, seed=1), ids=repr)
def test_reference_and_xla(case):
    check_impls(case, seed=3)


LONG = [  # rows long enough that the native CPU kernel splits their keys across tasks
    Case(B=1, S=1200, Tq=1, Tn=1, page=16, causal=True),
    Case(B=1, S=1104, Tq=5, Tn=5, page=48, causal=True, window=(700, 0), Hq=8, Hkv=2, D=40),
    Case(B=3, S=800, Tq=1, Tn=0, leftpad=True, batch_idx=True, softcap=3.0),
    Case(B=1, S=1024, Tq=2, Tn=2, page=64, fp8=True, dtype="bfloat16", causal=True),
    Case(B=2, S=700, Tq=1, Tn=1, Hq=9, Hkv=3, D=64, page=None, causal=True, cache_dtype="bfloat16"),
]


@pytest.mark.parametrize("case", LONG, ids=repr)
def test_reference_and_xla_long_rows(case):
    check_impls(case, seed=5)


WIDE_HEADS = [  # D >= 64: the native kernel's position-major scores (D >= 128 with AVX-512), D % 16
    Case(Tq=1, Tn=1, Hq=8, Hkv=2, D=64, S=64, page=16, causal=True),
    Case(Tq=5, Tn=5, Hq=8, Hkv=1, D=80, S=96, page=16, causal=True, softcap=3.0),
    Case(Tq=3, Tn=3, Hq=4, Hkv=4, D=128, S=33, page=None, leftpad=True, window=(5, 0)),
    Case(B=1, S=608, Tq=4, Tn=4, Hq=8, Hkv=2, D=72, page=16, causal=True),
    Case(Tq=2, Tn=2, Hq=4, Hkv=2, D=128, fp8=True, dtype="bfloat16", page=4, S=24, causal=True),
]


@pytest.mark.parametrize("case", WIDE_HEADS, ids=repr)
def test_reference_and_xla_wide_heads(case):
    check_impls(case, seed=6)


@pytest.mark.slow
@pytest.mark.parametrize("case", sampled_cases(40, seed=2), ids=repr)
def test_reference_and_xla_wide(case):
    check_impls(case, seed=4)


@pytest.mark.parametrize(
    "impl,page",
    [("reference", 1), ("reference", 4), ("xla", 16), ("xla", 1), ("interpret", 4)]
    + [("native", 16), ("native", 1)] * native.available(),
)
def test_paged_equals_contiguous(impl, page):
    case = Case(Tq=5, Tn=5, Hq=4, Hkv=2, S=48, page=page, leftpad=True, causal=True)
    paged = make_inputs(case, seed=5)
    contiguous = dataclasses.replace(
        paged,
        k_cache=jnp.asarray(paged.k_log),
        v_cache=jnp.asarray(paged.v_log),
        kwargs={k: w for k, w in paged.kwargs.items() if k != "block_table"},
    )
    a, b = call(paged, impl), call(contiguous, impl)
    np.testing.assert_array_equal(np.asarray(a.out), np.asarray(b.out))
    np.testing.assert_array_equal(np.asarray(a.lse), np.asarray(b.lse))
    flat = dataclasses.replace(case, page=None)
    lens = np.asarray(paged.kwargs["cache_seqlens"]) + case.Tn
    for i, (pc, cc) in enumerate(((a.k_cache, b.k_cache), (a.v_cache, b.v_cache))):
        got, want = logical_cache(case, paged, pc, i), logical_cache(flat, contiguous, cc, i)
        for row in range(case.B):
            np.testing.assert_array_equal(got[row, : lens[row]], want[row, : lens[row]])


def test_result_is_a_namedtuple_and_lse_optional():
    inp = make_inputs(Case(), seed=0)
    res = attention_with_kvcache(inp.q, inp.k_cache, inp.v_cache, inp.k, inp.v, **inp.kwargs)
    assert res.lse is None
    out, lse, k_cache, v_cache = res
    assert out.shape == inp.q.shape and k_cache.shape == inp.k_cache.shape


def test_int_seqlens_and_fully_masked_rows():
    """An int cache_seqlens; leftpad past the length hides every key: out 0, lse -inf."""
    inp = make_inputs(Case(Tn=0), seed=0)
    kw = dict(inp.kwargs, cache_seqlens=10, cache_leftpad=jnp.asarray([0, 12], jnp.int32))
    for impl in ("reference", "xla"):
        res = attention_with_kvcache(
            inp.q, inp.k_cache, inp.v_cache, return_lse=True, impl=impl, **kw
        )
        assert np.all(np.asarray(res.out[1]) == 0) and np.all(np.isneginf(res.lse[1]))
        assert np.all(np.isfinite(res.lse[0]))


def _temp_bytes(fn, *args):
    """Temporary bytes of ``fn`` compiled with the caches (args 1, 2) donated; checks that both
    caches alias outputs."""
    stats = jax.jit(fn, donate_argnums=(1, 2)).lower(*args).compile().memory_analysis()
    assert stats.alias_size_in_bytes >= args[1].nbytes + args[2].nbytes
    return stats.temp_size_in_bytes


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_donated_cache_updated_in_place(impl, paged):
    """With the caches donated, no second cache-sized buffer: temporaries stay below half a cache.

    Paged: a big pool of which this batch uses a few pages (the xla path gathers the batch's pages,
    which is fine; a copy of the pool is not).
    """
    B, S, Hkv, D, P = 2, 4096, 2, 32, 16
    case = Case(
        B=B, Tq=1, Tn=1, Hq=4, Hkv=Hkv, D=D, S=64 if paged else S, page=P if paged else None
    )
    inp = make_inputs(case, seed=0)
    if paged:
        pool = jnp.zeros((S * B // P, P, Hkv, D), jnp.float32)
        inp = dataclasses.replace(
            inp, k_cache=pool.at[: inp.k_cache.shape[0]].set(inp.k_cache), v_cache=pool
        )
    cache_bytes = inp.k_cache.size * inp.k_cache.dtype.itemsize

    def fn(q, kc, vc, k, v):
        return attention_with_kvcache(q, kc, vc, k, v, impl=impl, **inp.kwargs)

    temp = _temp_bytes(fn, inp.q, inp.k_cache, inp.v_cache, inp.k, inp.v)
    assert temp < cache_bytes // 2, (temp, cache_bytes)


BAD = [
    ("block_table", dict(block_table=np.arange(2 * 8, dtype=np.int32).reshape(2, 8))),
    ("k and v", dict(v=None)),
    ("k_descale", dict(k_descale=np.ones((2, 2), np.float32))),
    ("q", dict(q=np.zeros((2, 1, 3, 16), np.float32))),
    ("k_cache", dict(k_cache=np.zeros((2, 40, 3, 16), np.float32))),
    (
        "k must have shape",
        dict(k=np.zeros((2, 1, 1, 16), np.float32), v=np.zeros((2, 1, 1, 16), np.float32)),
    ),
    ("cache_seqlens", dict(cache_seqlens=np.array([40, 0], np.int32))),
    ("cache_batch_idx", dict(cache_batch_idx=np.array([0, 5], np.int32))),
    (
        "cache_batch_idx",
        dict(cache_batch_idx=np.array([0, 1], np.int32), block_table=np.zeros((2, 1), np.int32)),
    ),
    (
        "rotary_cos",
        dict(rotary_cos=np.ones((8, 12), np.float32), rotary_sin=np.ones((8, 12), np.float32)),
    ),
    ("rotary_cos and rotary_sin", dict(rotary_cos=np.ones((8, 4), np.float32))),
    ("window_size", dict(window_size=(-2, 0))),
    ("rotary_cos has 8 rows", dict(rotary_cos=np.ones((8, 4)), rotary_sin=np.ones((8, 4)))),
    ("q must have B >= 1", dict(q=np.zeros((0, 1, 4, 16), np.float32))),
    ("q must have D >= 1", dict(q=np.zeros((2, 1, 4, 0), np.float32))),
    ("k_cache must have S", dict(k_cache=np.zeros((2, 0, 2, 16)), v_cache=np.zeros((2, 0, 2, 16)))),
    ("block_table must have N", dict(block_table=np.zeros((2, 0), np.int32))),
    ("softcap", dict(softcap=float("nan"))),
    ("num_splits", dict(num_splits=-1)),
    ("impl", dict(impl="cuda")),
    (
        "k_cache",
        dict(
            k_cache=np.zeros((3, 40, 2, 16), np.float32),
            v_cache=np.zeros((3, 40, 2, 16), np.float32),
        ),
    ),
]


@pytest.mark.parametrize("needle,override", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_naming_the_argument(needle, override):
    inp = make_inputs(Case(), seed=0)
    args = dict(q=inp.q, k_cache=inp.k_cache, v_cache=inp.v_cache, k=inp.k, v=inp.v)
    kw = dict(inp.kwargs)
    for name, value in override.items():
        (args if name in args else kw)[name] = (
            jnp.asarray(value) if hasattr(value, "shape") else value
        )
    with pytest.raises(ValueError, match=needle):
        attention_with_kvcache(**args, **kw)


def test_wrong_dtypes_raise_type_error():
    inp = make_inputs(Case(), seed=0)
    # A cache wider than the queries, or 16-bit of another kind: only float32 queries take a
    # bfloat16 / float16 cache.
    for q_dtype, cache_dtype in (
        (jnp.bfloat16, jnp.float32),
        (jnp.float16, jnp.bfloat16),
        (jnp.bfloat16, jnp.float16),
    ):
        with pytest.raises(TypeError, match="k_cache"):
            attention_with_kvcache(
                inp.q.astype(q_dtype),
                inp.k_cache.astype(cache_dtype),
                inp.v_cache.astype(cache_dtype),
                cache_seqlens=1,
            )
    with pytest.raises(TypeError, match="k and v"):
        attention_with_kvcache(
            inp.q, inp.k_cache, inp.v_cache, inp.k.astype(jnp.bfloat16), inp.v, cache_seqlens=1
        )


def test_traced_arguments_skip_value_checks_under_jit():
    inp = make_inputs(Case(page=4, S=36, Tq=5, Tn=5, causal=True), seed=0)
    fn = functools.partial(attention_with_kvcache, impl="xla", causal=True)
    jitted = jax.jit(
        lambda q, kc, vc, k, v, lens, bt: fn(q, kc, vc, k, v, cache_seqlens=lens, block_table=bt)
    )
    got = jitted(
        inp.q,
        inp.k_cache,
        inp.v_cache,
        inp.k,
        inp.v,
        inp.kwargs["cache_seqlens"],
        inp.kwargs["block_table"],
    )
    want = call(inp, "xla")
    np.testing.assert_allclose(np.asarray(got.out), np.asarray(want.out), atol=1e-6)


def check_interpret(case: Case, seed: int, **extra):
    """The Pallas kernels (interpreted) against the reference: values, and caches bit-identical."""
    inp = make_inputs(case, seed=seed)
    got, want = call(inp, "interpret", **extra), call(inp, "reference")
    assert got.out.dtype == want.out.dtype
    assert max_err(got.out, want.out) <= tolerance(case)
    assert max_err(got.lse, want.lse) <= tolerance(case)
    for a, b in ((got.k_cache, want.k_cache), (got.v_cache, want.v_cache)):
        np.testing.assert_array_equal(as_bits(a), as_bits(b))
    return got


INTERPRET = [
    Case(Tq=3, Tn=3, Hq=4, Hkv=2, D=40, S=36, page=4, causal=True, cache_dtype="bfloat16"),
    Case(Tq=5, Tn=5, Hq=4, Hkv=1, D=40, S=36, page=4, causal=True, rotary=(8, True)),
    Case(Tq=1, Tn=1, Hq=8, Hkv=1, S=12, page=1, leftpad=True, softcap=3.0),
    Case(Tq=64, Tn=64, Hq=2, Hkv=2, S=80, page=16, causal=True, window=(20, 0)),
    Case(Tq=5, Tn=0, D=40, rotary=(40, False), batch_idx=True, window=(6, 2), leftpad=True),
    Case(
        Tq=5,
        Tn=5,
        Hq=2,
        D=40,
        S=24,
        page=1,
        rotary=(40, False),
        window=(5, 0),
        softcap=4.0,
        fp8=True,
        dtype="bfloat16",
    ),
    Case(Tq=1, Tn=1, fp8=True, batch_idx=True, rotary=(8, False), causal=True),
    Case(Tq=64, Tn=40, Hq=6, Hkv=3, S=96, batch_idx=True, causal=True, rotary=(16, True)),
]


@pytest.mark.parametrize("case", INTERPRET, ids=repr)
def test_interpret_matches_reference(case):
    check_interpret(case, seed=6)


@pytest.mark.slow
@pytest.mark.parametrize("case", sampled_cases(24, seed=7), ids=repr)
def test_interpret_matches_reference_wide(case):
    check_interpret(case, seed=8)


@pytest.mark.parametrize("num_splits", [0, 1, 3])
def test_num_splits_agree(num_splits):
    """Any split count gives the reference result (S = 200 keys: 4 key tiles of 64)."""
    case = Case(Tq=5, Tn=1, Hq=4, Hkv=2, S=200, leftpad=True, causal=True, window=(150, 0))
    check_interpret(case, seed=9, num_splits=num_splits)


def test_interpret_is_deterministic():
    """Same inputs, same output bits (splits are combined in a fixed order)."""
    inp = make_inputs(Case(Tq=5, Tn=5, S=200, page=4, causal=True), seed=10)
    a, b = call(inp, "interpret", num_splits=3), call(inp, "interpret", num_splits=3)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(as_bits(x), as_bits(y))


@pytest.mark.skipif(not native.available(), reason="native CPU kernels not built")
@pytest.mark.parametrize("Tq,window", [(1, (-1, -1)), (3, (-1, -1)), (1, (1100, 0))])
def test_native_row_is_batch_invariant(Tq, window):
    """A row's output from the native kernel is the same bit for bit alone or in a batch of rows
    of other lengths (its keys are cut into spans at fixed positions, 64 keys apart and wider past
    512, whatever the row's length, first key or batch): the engine's batches change every step,
    and a request's tokens must not depend on who shares them."""
    B, S, Hq, Hkv, D = 4, 2600, 8, 2, 64
    keys = jax.random.split(jax.random.key(11), 3)
    q = jax.random.normal(keys[0], (B, Tq, Hq, D), jnp.float32)
    kc = jax.random.normal(keys[1], (B, S, Hkv, D), jnp.float32)
    vc = jax.random.normal(keys[2], (B, S, Hkv, D), jnp.float32)
    lens = jnp.asarray([830, 45, 300, 2555], jnp.int32)
    run = lambda q, kc, vc, n: attention_with_kvcache(  # noqa: E731
        q, kc, vc, cache_seqlens=n, causal=True, window_size=window, return_lse=True, impl="native"
    )
    batch = run(q, kc, vc, lens)
    for r in range(B):
        alone = run(q[r : r + 1], kc[r : r + 1], vc[r : r + 1], lens[r : r + 1])
        np.testing.assert_array_equal(np.asarray(alone.out[0]), np.asarray(batch.out[r]))
        np.testing.assert_array_equal(np.asarray(alone.lse[0]), np.asarray(batch.lse[r]))


@pytest.mark.skipif(not native.available(), reason="native CPU kernels not built")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("Tq,window", [(1, (-1, -1)), (2, (-1, -1)), (1, (70, 0))])
def test_native_rows_sharing_pages_read_them_once(dtype, Tq, window):
    """Rows whose block tables agree (a ragged verification's draft rows: their request's pages,
    one key more each) are one pass over the keys, and each row's output is still the one it has
    alone, bit for bit; a row sharing only its first pages (prefix caching) still reads its own, and
    every row matches the reference."""
    B, P, Hq, Hkv, D, pages = 7, 16, 6, 2, 64, 40
    dt = getattr(jnp, dtype)
    keys = jax.random.split(jax.random.key(12), 3)
    q = jax.random.normal(keys[0], (B, Tq, Hq, D), jnp.float32).astype(dt)
    kc = jax.random.normal(keys[1], (pages, P, Hkv, D), jnp.float32).astype(dt)
    vc = jax.random.normal(keys[2], (pages, P, Hkv, D), jnp.float32).astype(dt)
    req_a = [3, 9, 4, 11, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
    req_b = [5, 6, 7, 0, 1, 2, 8, 10, 12, 13, 14, 15, 16, 17, 18, 19]
    prefix = [3, 9, 32, 33, 34, 35, 36, 37, 38, 39, 0, 1, 2, 5, 6, 7]  # req_a's first 2 pages
    table = np.asarray([req_a, req_b, req_a, req_a, prefix, req_b, req_a], np.int32)
    # Row 0 a request's row at 130 keys, rows 2, 3 its draft rows (one key more each), row 6 a
    # draft row past a page boundary; rows 1 and 5 another request; row 4 shares 2 pages.
    lens = jnp.asarray([130, 57, 131, 132, 150, 58, 160], jnp.int32)
    run = lambda q, n, t, impl="native": attention_with_kvcache(  # noqa: E731
        q,
        kc,
        vc,
        cache_seqlens=n,
        block_table=jnp.asarray(t),
        causal=True,
        window_size=window,
        return_lse=True,
        impl=impl,
    )
    batch, ref = run(q, lens, table), run(q, lens, table, "reference")
    tol = 2e-2 if dtype == "bfloat16" else 2e-5
    np.testing.assert_allclose(
        np.asarray(batch.out, np.float32), np.asarray(ref.out, np.float32), atol=tol, rtol=tol
    )
    np.testing.assert_allclose(np.asarray(batch.lse), np.asarray(ref.lse), atol=1e-4, rtol=1e-5)
    for r in range(B):
        alone = run(q[r : r + 1], lens[r : r + 1], table[r : r + 1])
        np.testing.assert_array_equal(as_bits(alone.out[0]), as_bits(batch.out[r]))
        np.testing.assert_array_equal(np.asarray(alone.lse[0]), np.asarray(batch.lse[r]))
