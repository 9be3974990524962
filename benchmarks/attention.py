"""Attention benchmark: ``python -m benchmarks.attention`` from the repository root.

On a GPU: forward and forward+backward TFLOP/s of ``impl="pallas"`` against
``jax.nn.dot_product_attention(implementation="cudnn")``, ``jax.nn``'s ``"xla"`` and this
package's ``"xla"`` path; bfloat16, B * T = 16k tokens, T in {512, 2k, 8k, 16k}, D in {64, 128}
(Hq = 2048 / D), causal and not. Writes ``benchmarks/results/attention_gpu.json``.

On CPU: this package's ``"xla"`` path against ``jax.nn.dot_product_attention(implementation="xla")``,
float32, B * T = 2048 tokens, Hq = 4, D = 64, time and planned peak memory (``compiled.memory_analysis()``), forward and
forward+backward. Writes ``benchmarks/results/attention_cpu.json``.

FLOPs count the two matmuls of the forward, ``4 * B * Hq * T * S * D`` (halved when causal), and
2.5x that for the backward, as FlashAttention's benchmarks do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from tqdm import tqdm

from benchmarks import common
from benchmarks.plot import Plot
from pallas_attn import flash_attention


def ours(impl):
    """``flash_attention(q, k, v, causal=causal, impl=impl)`` as ``fn(q, k, v, causal)``."""

    def fn(q, k, v, causal):
        return flash_attention(q, k, v, causal=causal, impl=impl)

    return fn


def jax_nn(implementation):
    """``jax.nn.dot_product_attention`` with ``implementation``, as ``fn(q, k, v, causal)``."""

    def fn(q, k, v, causal):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation=implementation
        )

    return fn


def _flops(B, T, H, D, causal, backward):
    fwd = 4 * B * H * T * T * D * (0.5 if causal else 1.0)
    return fwd * (3.5 if backward else 1.0)


def fwd_bwd(fn, causal):
    """The jitted gradient of ``sum(fn(q, k, v, causal))`` with respect to q, k and v."""

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, causal).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def make_inputs(B, T, H, D, dtype, seed=0):
    """q, k, v [B, T, H, D] of ``dtype``, standard normal from ``seed``."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(key, (B, T, H, D), dtype) for key in (kq, kk, kv))


def _measure(name, fn, shape, causal, dtype, runs, with_memory, warmup=1):
    """Times (and optionally sizes) forward and forward+backward; returns (row, forward output)."""
    B, T, H, D = shape
    q, k, v = make_inputs(B, T, H, D, dtype)
    fwd = jax.jit(functools.partial(fn, causal=causal))
    bwd = fwd_bwd(fn, causal)
    row = dict(impl=name, B=B, T=T, H=H, D=D, causal=causal, dtype=jnp.dtype(dtype).name)
    compiled = {}
    try:
        for key, jitted in (("fwd", fwd), ("fwd_bwd", bwd)):
            compiled[key] = jitted.trace(q, k, v).lower().compile()
            row[f"{key}_ms"] = 1e3 * common.time_fn(
                compiled[key], q, k, v, runs=runs, warmup=warmup
            )
            if with_memory:
                row[f"{key}_peak_MiB"] = common.peak_memory_bytes(compiled[key]) / 2**20
    except Exception as e:  # noqa: BLE001 - one failing impl (OOM, unsupported) must not stop the run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return row, None
    row["fwd_TFLOPs"] = _flops(B, T, H, D, causal, False) / row["fwd_ms"] / 1e9
    row["fwd_bwd_TFLOPs"] = _flops(B, T, H, D, causal, True) / row["fwd_bwd_ms"] / 1e9
    return row, compiled["fwd"](q, k, v)


GPU_IMPLS = {
    "pallas": ours("pallas"),
    "cudnn": jax_nn("cudnn"),
    "jax_nn_xla": jax_nn("xla"),
    "xla": ours("xla"),
}
GPU_CONFIGS = [
    (T, D, c) for T in (512, 2048, 8192, 16384) for D in (64, 128) for c in (False, True)
]
GPU_QUICK_CONFIGS = [(T, 128, c) for T in (2048, 8192) for c in (False, True)]


def run_gpu(runs: int, impls=None, configs=None, tokens: int = 16384, warmup: int = 1):
    """(T, D, causal) configs, B = tokens / T, Hq = 2048 / D; ``impls`` must name pallas, cudnn."""
    impls = impls or GPU_IMPLS
    configs = configs or GPU_CONFIGS
    rows = []
    for T, D, causal in tqdm(configs, desc="gpu configs"):
        shape = (tokens // T, T, 2048 // D, D)
        outs = {}
        for name, fn in impls.items():
            row, out = _measure(
                name, fn, shape, causal, jnp.bfloat16, runs, with_memory=False, warmup=warmup
            )
            outs[name] = out
            rows.append(row)
        by_name = {r["impl"]: r for r in rows[-len(impls) :]}
        if outs["pallas"] is not None and outs["cudnn"] is not None:
            diff = jnp.max(jnp.abs(outs["pallas"].astype(jnp.float32) - outs["cudnn"]))
            by_name["pallas"]["max_abs_diff_vs_cudnn"] = float(diff)
        if "fwd_TFLOPs" in by_name["pallas"] and "fwd_TFLOPs" in by_name["cudnn"]:
            for key in ("fwd_TFLOPs", "fwd_bwd_TFLOPs"):
                ratio = by_name["pallas"][key] / by_name["cudnn"][key]
                by_name["pallas"][f"{key}_vs_cudnn"] = ratio
    cols = ["impl", "T", "D", "causal", "fwd_TFLOPs", "fwd_bwd_TFLOPs", "fwd_TFLOPs_vs_cudnn"]
    return rows, cols


def run_cpu(runs: int, quick: bool, warmup: int = 1):
    impls = {"xla": ours("xla"), "jax_nn_xla": jax_nn("xla")}
    lengths = (256, 2048) if quick else (256, 1024, 2048)
    configs = [(T, c) for T in lengths for c in (False, True)]
    rows = []
    for T, causal in tqdm(configs, desc="cpu configs"):
        shape = (2048 // T, T, 4, 64)
        for name, fn in impls.items():
            row, _ = _measure(name, fn, shape, causal, jnp.float32, runs, True, warmup)
            rows.append(row)
    cols = ["impl", "B", "T", "causal", "fwd_ms", "fwd_bwd_ms", "fwd_peak_MiB", "fwd_bwd_peak_MiB"]
    return rows, cols


PLOTS = {
    "attention_cpu": (
        Plot("time", x="T", y=("fwd_ms", "fwd_bwd_ms"), series=("impl", "causal"), logx=True),
        Plot(
            "memory",
            x="T",
            y=("fwd_peak_MiB", "fwd_bwd_peak_MiB"),
            series=("impl",),
            where=(("causal", True),),
            logx=True,
        ),  # causal or not: the same buffers
    ),
    "attention_gpu": (
        Plot(
            "tflops",
            x="T",
            y=("fwd_TFLOPs", "fwd_bwd_TFLOPs"),
            series=("impl",),
            facet="D",
            where=(("causal", True),),
            logx=True,
        ),
    ),
}


def main(argv=None) -> None:
    args = common.parser(
        __doc__, runs=3, quick="CPU: only T in {256, 2048}; GPU: only D = 128, T in {2k, 8k}"
    ).parse_args(argv)
    if jax.default_backend() == "gpu":
        configs = GPU_QUICK_CONFIGS if args.quick else GPU_CONFIGS
        rows, cols = run_gpu(args.runs, configs=configs, warmup=args.warmup)
        name = "attention_gpu"
    else:
        rows, cols = run_cpu(args.runs, args.quick, args.warmup)
        name = "attention_cpu"
    common.finish(args, name, rows, cols)
    for row in rows:  # the goal: forward bf16 D=128 causal T=8k at >= 0.6x cuDNN
        if (row["impl"], row["T"], row["D"], row["causal"]) == ("pallas", 8192, 128, True):
            print(f"goal (>= 0.6x cuDNN): pallas/cudnn fwd = {row.get('fwd_TFLOPs_vs_cudnn')}")


if __name__ == "__main__":
    main()
