"""KV-cache decode benchmark: ``python -m benchmarks.decode`` from the repository root.

On a GPU: achieved bandwidth of ``attention_with_kvcache(impl="pallas")`` for one decode step
(``Tq = 1``, every row filled to ``S``), counted as the K/V bytes read over the time, against the
bandwidth of a measured device-to-device copy of the same bytes (read + write over its time).
bfloat16, Hq = 32, Hkv = 8, D = 128, B in {1, 8, 64}, S in {1k, 8k, 32k, 128k}, contiguous and paged
(P = 16, 64), ``num_splits`` auto (0) and 1. Where the shapes allow, JAX's bundled Triton kernels
(``decode_attention.gqa``, ``paged_attention``) are timed as a comparison only. Writes
``benchmarks/results/decode_gpu.json``.

On CPU: the ``"native"`` kernel's time (``pallas_attn.cpu``, where it is built; what ``"auto"``
runs there) and the blockwise ``"xla"`` path's (float32, B in {1, 8}, S in {1k, 8k}, contiguous and
paged P = 16), with the same bandwidth figures (``num_splits`` does not apply to them);
plus the shipped code-target's decode and verification calls (Hq = 8, Hkv = 4, D = 32, S = 160,
paged P = 16, B = 1, Tq in {1, 3, 5}; ``small_heads``), timed as a jitted loop of calls (each call
is a few microseconds, below one dispatch); and SmolLM2-135M's attention per decode step and
k = 1 verification (Hq = 9, Hkv = 3, D = 64, 30 layers' paged float32 and bfloat16 caches
(``kv_dtype``) under float32 queries, B in {1, 8}, S in {256, 1k, 4k}; ``smollm2_heads``). Writes ``benchmarks/results/decode_cpu.json``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks import common
from benchmarks.plot import Plot
from pallas_attn import attention_with_kvcache, cpu

Hq, Hkv, D = 32, 8, 128


def make_inputs(B, S, P, dtype, seed=0):
    """q [B, 1, Hq, D], caches (contiguous or paged with a shuffled table), lengths = S."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, 1, Hq, D), dtype)
    shape = (B, S, Hkv, D) if P is None else (B * S // P, P, Hkv, D)
    k_cache = jax.random.normal(kk, shape, dtype)
    v_cache = jax.random.normal(kv, shape, dtype)
    table = None
    if P is not None:
        perm = np.random.default_rng(seed).permutation(B * S // P).astype(np.int32)
        table = jnp.asarray(perm.reshape(B, S // P))
    return q, k_cache, v_cache, table


def ours(impl, num_splits):
    @jax.jit
    def fn(q, k_cache, v_cache, lengths, table):
        return attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=lengths,
            block_table=table,
            causal=True,
            num_splits=num_splits,
            impl=impl,
        ).out

    return fn


def _copy_bandwidth(nbytes: int, dtype, runs: int, warmup: int) -> float:
    """Bytes per second of a device-to-device copy (read + write) of ``nbytes``."""
    x = jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype)
    copy = jax.jit(lambda a: a + jnp.asarray(0, dtype))  # a fresh output buffer, not an alias
    return 2 * nbytes / common.time_fn(copy, x, runs=runs, warmup=warmup)


def _bundled(kind):
    """JAX's own Triton decode kernels, as a comparison (imported only here, never by the library)."""
    if kind == "contiguous":
        from jax.experimental.pallas.ops.gpu import decode_attention

        @jax.jit
        def fn(q, k_cache, v_cache, lengths):
            return decode_attention.gqa(q[:, 0], k_cache, v_cache, kv_seq_len=lengths)

        return fn
    from jax.experimental.pallas.ops.gpu import paged_attention

    @jax.jit
    def fn(q, k_pages, v_pages, lengths, table):
        return paged_attention.paged_attention(q[:, 0], k_pages, v_pages, table, lengths)

    return fn


def _measure(row, fn, args, kv_bytes, copy_bw, runs, warmup):
    try:
        seconds = common.time_fn(fn, *args, runs=runs, warmup=warmup)
    except Exception as e:  # noqa: BLE001 - one failing config (OOM, unsupported) must not stop the run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return row
    row["ms"] = 1e3 * seconds
    row["GB_per_s"] = kv_bytes / seconds / 1e9
    row["vs_copy"] = kv_bytes / seconds / copy_bw
    return row


def run(configs, impls, dtype, runs, *, bundled: bool, warmup: int = 1):
    rows = []
    for B, S, P in tqdm(configs, desc=f"{'/'.join(impls)} configs"):
        q, k_cache, v_cache, table = make_inputs(B, S, P, dtype)
        lengths = jnp.full((B,), S, jnp.int32)
        kv_bytes = 2 * B * S * Hkv * D * jnp.dtype(dtype).itemsize
        copy_bw = _copy_bandwidth(kv_bytes, dtype, runs, warmup)
        base = dict(B=B, S=S, layout="contiguous" if P is None else f"paged P={P}")
        base.update(dtype=jnp.dtype(dtype).name, copy_GB_per_s=copy_bw / 1e9)
        args = (q, k_cache, v_cache, lengths, table)
        for impl in impls:
            if impl == "native" and not cpu.eligible(q, k_cache):
                continue
            for splits in (0, 1) if impl == "pallas" else (0,):  # the CPU paths do not split
                row = dict(base, impl=impl, num_splits="auto" if splits == 0 else 1)
                fn = ours(impl, splits)
                rows.append(_measure(row, fn, args, kv_bytes, copy_bw, runs, warmup))
        if bundled:
            row = dict(base, impl="jax_bundled", num_splits="")
            if P is None:
                bargs = (q, k_cache, v_cache, lengths)
            else:  # its layout is [Hkv, pages, P, D]: transposed once, outside the timing
                pages = [jnp.transpose(c, (2, 0, 1, 3)) for c in (k_cache, v_cache)]
                bargs = (q, *pages, lengths, table)
            fn = _bundled(base["layout"].split()[0])
            rows.append(_measure(row, fn, bargs, kv_bytes, copy_bw, runs, warmup))
        del q, k_cache, v_cache, table
    return rows


SMALL = dict(Hq=8, Hkv=4, D=32, S=160, P=16)  # code-target's attention shapes
SMALL_CALLS = 200  # calls per timed loop


def small_heads(runs: int, warmup: int) -> list[dict]:
    """Microseconds per ``attention_with_kvcache`` call at code-target's shapes, B = 1, Tq in
    {1, 3, 5} (a decode step and verifications of k = 2, 4), native kernel and blockwise path:
    a jitted loop of SMALL_CALLS calls, each query the previous output (no call is dead code)."""
    h, kv_heads, d, S, P = (SMALL[n] for n in ("Hq", "Hkv", "D", "S", "P"))
    pages = 2 * S // P
    kk, kv, kq = jax.random.split(jax.random.key(1), 3)
    k_cache = jax.random.normal(kk, (pages, P, kv_heads, d), jnp.float32)
    v_cache = jax.random.normal(kv, (pages, P, kv_heads, d), jnp.float32)
    table = jnp.arange(pages, dtype=jnp.int32)[None]
    lengths = jnp.full((1,), S, jnp.int32)

    def make_loop(impl):
        def loop(q, k_cache, v_cache):
            def body(_, q):
                return attention_with_kvcache(
                    q,
                    k_cache,
                    v_cache,
                    cache_seqlens=lengths,
                    block_table=table,
                    causal=True,
                    impl=impl,
                ).out

            return jax.lax.fori_loop(0, SMALL_CALLS, body, q)

        return jax.jit(loop)

    rows = []
    for Tq in tqdm((1, 3, 5), desc="code-target shapes"):
        q = jax.random.normal(kq, (1, Tq, h, d), jnp.float32)
        for impl in ("native", "xla") if cpu.eligible(q, k_cache) else ("xla",):
            loop = make_loop(impl)
            seconds = common.time_fn(loop, q, k_cache, v_cache, runs=runs, warmup=warmup)
            row = dict(impl=impl, B=1, S=S, layout=f"paged P={P}", case="code-target", Tq=Tq)
            rows.append(dict(row, us_per_call=1e6 * seconds / SMALL_CALLS))
    return rows


SMOLLM2 = dict(Hq=9, Hkv=3, D=64, P=16, layers=30)  # SmolLM2-135M's attention shapes


def smollm2_heads(runs: int, warmup: int, quick: bool) -> list[dict]:
    """Milliseconds of the attention of one decode step (Tq = 1) and one k = 1 verification
    (Tq = 2) of SmolLM2-135M, the native kernel (``"auto"`` on CPU): one call per layer over
    30 layers' own paged caches (more bytes than the last-level cache holds from S = 1024 at B =
    8, as in a real step, whose weights evict the cache), B in {1, 8}, S in {256, 1024, 4096}
    keys per row; float32 and bfloat16 caches (a float32 model's ``kv_dtype``), float32
    queries."""
    h, kv_heads, d, P, L = (SMOLLM2[n] for n in ("Hq", "Hkv", "D", "P", "layers"))
    rows = []
    configs = [
        (B, S, cdt)
        for B in ((1,) if quick else (1, 8))
        for S in (256, 1024, 4096)
        for cdt in (jnp.float32, jnp.bfloat16)
    ]
    for B, S, cdt in tqdm(configs, desc="SmolLM2 shapes"):
        pages = B * S // P
        keys = jax.random.split(jax.random.key(2), 2 * L + 1)
        caches = [
            jax.random.normal(k, (pages, P, kv_heads, d), jnp.float32).astype(cdt) for k in keys[1:]
        ]
        perm = np.random.default_rng(3).permutation(pages).astype(np.int32)
        table = jnp.asarray(perm.reshape(B, S // P))
        lengths = jnp.full((B,), S, jnp.int32)
        for Tq in (1, 2):
            q = jax.random.normal(keys[0], (B, Tq, h, d), jnp.float32)
            if not cpu.eligible(q, caches[0]):
                continue

            @jax.jit
            def step(q, caches, lengths, table):
                out = q
                for k_cache, v_cache in zip(caches[::2], caches[1::2], strict=True):
                    out = (
                        out
                        + attention_with_kvcache(
                            q,
                            k_cache,
                            v_cache,
                            cache_seqlens=lengths,
                            block_table=table,
                            causal=True,
                            impl="native",
                        ).out
                    )
                return out

            seconds = common.time_fn(step, q, caches, lengths, table, runs=runs, warmup=warmup)
            kv_bytes = 2 * L * B * S * kv_heads * d * jnp.dtype(cdt).itemsize
            row = dict(impl="native", B=B, S=S, layout=f"paged P={P}", case="smollm2", Tq=Tq)
            row["kv_dtype"] = jnp.dtype(cdt).name
            rows.append(dict(row, ms=1e3 * seconds, GB_per_s=kv_bytes / seconds / 1e9))
        del caches
    return rows


PLOTS = {
    "decode_cpu": (
        Plot(
            "time",
            x="S",
            y=("ms",),
            series=("impl", "layout"),
            facet="B",
            where=(("case", None),),
            logx=True,
            logy=True,
        ),
        Plot(
            "code_target",
            x="Tq",
            y=("us_per_call",),
            series=("impl",),
            where=(("case", "code-target"),),
        ),
        Plot(
            "smollm2",
            x="S",
            y=("ms",),
            series=("Tq", "kv_dtype"),
            facet="B",
            where=(("case", "smollm2"),),
            logx=True,
            logy=True,
        ),
    ),
    "decode_gpu": (
        Plot(
            "bandwidth",
            x="S",
            y=("vs_copy",),
            series=("impl", "layout", "num_splits"),
            facet="B",
            logx=True,
        ),
    ),
}


def _configs(gpu: bool, quick: bool) -> list[tuple]:
    """(B, S, P) triples; P None = contiguous."""
    if not gpu:
        batches = (1,) if quick else (1, 8)
        return [(B, S, P) for B in batches for S in (1024, 8192) for P in (None, 16)]
    if quick:
        return [(8, S, P) for S in (8192, 32768) for P in (None, 16)]
    lengths = (1024, 8192, 32768, 131072)
    return [(B, S, P) for B in (1, 8, 64) for S in lengths for P in (None, 16, 64)]


def main(argv=None) -> None:
    args = common.parser(
        __doc__, runs=5, quick="CPU: B = 1 only; GPU: B = 8, S in {8k, 32k}, P in {none, 16}"
    ).parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    configs = _configs(gpu, args.quick)
    if gpu:
        rows = run(configs, ("pallas",), jnp.bfloat16, args.runs, bundled=True, warmup=args.warmup)
    else:
        rows = run(
            configs, ("native", "xla"), jnp.float32, args.runs, bundled=False, warmup=args.warmup
        )
        small = small_heads(args.runs, args.warmup)
        common.print_table(small, ["impl", "Tq", "S", "layout", "us_per_call"])
        smollm2 = smollm2_heads(args.runs, args.warmup, args.quick)
        common.print_table(smollm2, ["B", "S", "Tq", "kv_dtype", "ms", "GB_per_s"])
        rows += small + smollm2
    cols = ["impl", "B", "S", "layout", "num_splits", "ms", "GB_per_s", "vs_copy", "copy_GB_per_s"]
    cols += ["Tq", "kv_dtype", "us_per_call"] if not gpu else []
    goal = [
        r
        for r in rows
        if r.get("impl") == "pallas" and r["B"] == 8 and r["S"] == 32768 and "vs_copy" in r
    ]
    meta = dict(shape=dict(Hq=Hq, Hkv=Hkv, D=D, Tq=1), code_target_shape=SMALL)
    meta["smollm2_shape"] = SMOLLM2
    if goal:
        meta["goal_B8_S32k_best_vs_copy"] = max(r["vs_copy"] for r in goal)
    common.finish(args, "decode_gpu" if gpu else "decode_cpu", rows, cols, **meta)


if __name__ == "__main__":
    main()
