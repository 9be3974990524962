"""One command for a lent GPU: ``python -m benchmarks.gpu_suite`` (installs nothing, < 8 minutes).

Sections, one JSON (``benchmarks/results/gpu_suite_<device>.json``) and one printed table:

* ``check``: the compiled Pallas kernels (``impl="pallas"``, default tiles; and the Mosaic GPU
  kernels, ``impl="mosaic"``, on the cases they take: D <= 128) against the float32
  reference on awkward shapes (T = 7, 113, 203, 1023; T != S; D = 40, 80, 96, 128, 256; GQA;
  causal, window, softcap, segments), bf16 and f16, output, lse and dQ/dK/dV under random
  cotangents, with FlashAttention's rule: error <= 2x (3x for gradients) that of the reference
  computed in the input dtype, plus a floor; and KV-cache decode (paged, FP8, rotary, Tq = 5)
  against ``impl="reference"``.
* ``attention``: forward and forward+backward TFLOP/s of the Pallas (Triton) and Mosaic kernels
  against
  ``jax.nn.dot_product_attention(implementation="cudnn")``, ``jax.nn``'s XLA and this package's
  XLA path (:func:`benchmarks.attention.run_gpu` on a few configs).
* ``decode``: KV-cache decode bandwidth against a measured device copy
  (:func:`benchmarks.decode.run`).
* ``generate``: ``decoding.generate`` tokens/s of a llama-3-8b-shaped model (random bf16 weights,
  paged cache), B = 8, 512-token prompts, 128 new tokens, greedy.
* ``speculative``: greedy ``speculative_generate`` speed-up over plain ``generate`` on the
  shipped code models (prompt lookup, Medusa chain and calibrated tree, the distilled draft),
  with ``match`` (identical tokens) and tokens per target call (:func:`run_speculative`; not
  part of ``--deviceless``).

``--sections check,decode`` runs some sections (``--checks`` picks checks by name) and ``--out``
names the folder; each row replaces the one of its section and name in the JSON as it lands, so
a run cut short keeps what it measured. ``.ci/gpu_check.sh`` runs the GPU tests and then
each section in its own process under its own time limit: one command for a lent machine.

``--deviceless`` compiles the same programs (the ``check`` kernels, the Pallas/XLA/cuDNN
attention programs, the decode steps, the generation prefill and loop, at the same shapes) on a
CPU-only machine for the H200 target (:mod:`benchmarks.deviceless`; in ``.venv-cuda``) and
writes ``gpu_suite_deviceless.json``; programs that need a device to compile (cuDNN builds its
graph at compile time) are reported as ``needs_device``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import attention, common, decode

F16, BF16 = "float16", "bfloat16"
CHECKS = {
    "check-T113-S203-D40-causal": (dict(T=113, S=203, Hq=8, Hkv=2, D=40, causal=True), BF16),
    "check-T1023-D80-window-softcap": (
        dict(T=1023, S=1023, Hq=4, Hkv=1, D=80, window_size=(64, 0), softcap=20.0),
        F16,
    ),
    "check-T203-S113-D96-segments": (dict(T=203, S=113, Hq=4, Hkv=4, D=96, segments=True), BF16),
    "check-T512-D128-causal": (dict(T=512, S=512, Hq=8, Hkv=2, D=128, causal=True), F16),
    "check-T257-S1024-D256-softcap": (
        dict(T=257, S=1024, Hq=4, Hkv=2, D=256, causal=True, softcap=30.0),
        BF16,
    ),
    "check-T7-S1023-D64-mqa": (dict(T=7, S=1023, Hq=16, Hkv=1, D=64), BF16),
}
KV_CHECKS = {
    "check-decode-paged-fp8-rotary": dict(Tq=1, D=128, dtype=BF16, paged=True, fp8=True),
    "check-decode-Tq5-D80-f16": dict(Tq=5, D=80, dtype=F16, paged=False, fp8=False),
}
FLOOR = {BF16: 1e-3, F16: 2e-4}
ATTN_CONFIGS = [(2048, 64, True), (2048, 128, True), (8192, 128, True), (8192, 128, False)]
ATTN_TOKENS = 16384
DECODE_CONFIGS = [(1, 32768, None), (8, 32768, 16), (64, 8192, 16)]
MOSAIC = attention.ours("mosaic")  # the Mosaic GPU kernels beside Triton ("pallas") and cuDNN
GEN = dict(preset="llama-3-8b", batch=8, prompt_len=512, new_tokens=128)


def _check_inputs(case, dtype, seed=0):
    """q, k, v, d_out, d_lse (and segment ids) for one check case, as a jax function of nothing."""
    B, T, S, Hq, Hkv, D = 2, case["T"], case["S"], case["Hq"], case["Hkv"], case["D"]
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (B, T, Hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (B, S, Hkv, D), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (B, S, Hkv, D), jnp.float32).astype(dtype)
    d_out = jax.random.normal(keys[3], (B, T, Hq, D), jnp.float32).astype(dtype)
    d_lse = jax.random.normal(keys[4], (B, Hq, T), jnp.float32)
    seg_q = jnp.sort(jax.random.randint(keys[5], (B, T), 0, 3), axis=1)
    seg_k = jnp.sort(jax.random.randint(keys[5], (B, S), 0, 3), axis=1)
    return q, k, v, d_out, d_lse, seg_q, seg_k


def mosaic_takes(case) -> bool:
    """Whether the Mosaic kernels take a check case (D <= 128)."""
    return case["D"] <= 128


def _attend_vjp(case, how):
    """``fn(q, k, v, d_out, d_lse, seg_q, seg_k) -> (out, lse, dq, dk, dv)``; ``how`` is
    "pallas", "mosaic", "oracle" (float32 reference) or "same" (the reference in the input
    dtype)."""
    from pallas_attn import flash_attention, masks, reference

    opts = {k: case[k] for k in ("causal", "window_size", "softcap") if k in case}

    def fn(q, k, v, d_out, d_lse, seg_q, seg_k):
        seg = dict(q_segment_ids=seg_q, kv_segment_ids=seg_k) if case.get("segments") else {}
        if how in ("pallas", "mosaic"):
            f = functools.partial(flash_attention, **opts, **seg, return_lse=True, impl=how)
        else:
            window = masks.normalize_window(
                opts.get("causal", False), opts.get("window_size", (-1, -1))
            )
            kw = dict(
                softmax_scale=case["D"] ** -0.5, window=window, softcap=opts.get("softcap", 0.0)
            )
            f = functools.partial(reference.attention, **kw, **seg, upcast=how == "oracle")
            if how == "oracle":
                q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
        (out, lse), pull = jax.vjp(f, q, k, v)
        lse_ct = jnp.where(jnp.isfinite(lse), d_lse, 0.0).astype(lse.dtype)
        return (out, lse, *pull((d_out.astype(out.dtype), lse_ct)))

    return fn


def _kv_inputs(case, seed=0):
    """q, caches (filled to S), new k/v, lengths, block table, rotary tables, descales."""
    B, Hq, Hkv, S, P, D, Tq = 2, 16, 4, 2048, 16, case["D"], case["Tq"]
    dtype = jnp.dtype(case["dtype"])
    keys = jax.random.split(jax.random.key(seed), 6)
    shape = (B * S // P, P, Hkv, D) if case["paged"] else (B, S, Hkv, D)
    cache_dtype = jnp.float8_e4m3fn if case["fp8"] else dtype
    k_cache = jax.random.normal(keys[0], shape, jnp.float32).astype(cache_dtype)
    v_cache = jax.random.normal(keys[1], shape, jnp.float32).astype(cache_dtype)
    table = jax.random.permutation(keys[2], B * S // P).astype(jnp.int32).reshape(B, S // P)
    angles = jnp.arange(S)[:, None] * 10000.0 ** (-jnp.arange(D // 4) / (D // 4))
    return dict(
        q=jax.random.normal(keys[3], (B, Tq, Hq, D), jnp.float32).astype(dtype),
        k_cache=k_cache,
        v_cache=v_cache,
        k=jax.random.normal(keys[4], (B, Tq, Hkv, D), jnp.float32).astype(dtype),
        v=jax.random.normal(keys[5], (B, Tq, Hkv, D), jnp.float32).astype(dtype),
        cache_seqlens=jnp.array([S // 3, S - Tq], jnp.int32),
        block_table=table if case["paged"] else None,
        rotary_cos=jnp.cos(angles).astype(dtype),
        rotary_sin=jnp.sin(angles).astype(dtype),
        k_descale=jnp.full((B, Hkv), 0.5, jnp.float32) if case["fp8"] else None,
        v_descale=jnp.full((B, Hkv), 2.0, jnp.float32) if case["fp8"] else None,
    )


def _kv_step(impl):
    from pallas_attn import attention_with_kvcache

    def fn(a):
        a = dict(a)
        args = [a.pop(n) for n in ("q", "k_cache", "v_cache", "k", "v")]
        res = attention_with_kvcache(*args, **a, causal=True, return_lse=True, impl=impl)
        return res.out, res.lse

    return fn


def _programs() -> dict:
    """Every compiled program of the suite: name -> (fn, inputs), ``inputs()`` a jax function."""
    progs = {}
    for name, (case, dtype) in CHECKS.items():
        progs[name] = (_attend_vjp(case, "pallas"), functools.partial(_check_inputs, case, dtype))
        if mosaic_takes(case):
            inputs = functools.partial(_check_inputs, case, dtype)
            progs[f"{name}-mosaic"] = (_attend_vjp(case, "mosaic"), inputs)
    for name, case in KV_CHECKS.items():
        progs[name] = (_kv_step("pallas"), lambda c=case: (_kv_inputs(c),))
    impls = {"pallas": attention.GPU_IMPLS["pallas"], "xla": attention.GPU_IMPLS["xla"]}
    impls["cudnn"] = attention.GPU_IMPLS["cudnn"]
    impls["mosaic"] = MOSAIC
    for T, D, causal in ATTN_CONFIGS:
        shape = (ATTN_TOKENS // T, T, 2048 // D, D, jnp.bfloat16)
        inputs = functools.partial(attention.make_inputs, *shape)
        for impl, fn in impls.items():
            tag = f"{impl}-T{T}-D{D}-{'causal' if causal else 'full'}"
            progs[f"attn-fwd-{tag}"] = (functools.partial(fn, causal=causal), inputs)
            progs[f"attn-fwd_bwd-{tag}"] = (attention.fwd_bwd(fn, causal), inputs)
    for B, S, P in DECODE_CONFIGS:
        inputs = functools.partial(_decode_inputs, B, S, P)
        for splits in (0, 1):
            name = f"decode-B{B}-S{S}-{'contiguous' if P is None else f'P{P}'}-splits{splits}"
            progs[name] = (decode.ours("pallas", splits), inputs)
    return progs


def _decode_inputs(B, S, P):
    q, k_cache, v_cache, table = decode.make_inputs(B, S, P, jnp.bfloat16)
    return q, k_cache, v_cache, jnp.full((B,), S, jnp.int32), table


def program(name: str, sds):
    """``(fn, args)`` of one suite program with ShapeDtypeStruct args (for deviceless compiles)."""
    if name.startswith("generate-"):
        from benchmarks import gpu_models

        return gpu_models.generate(dict(phase=name.split("-")[1]), sds, **GEN)
    fn, inputs = _programs()[name]
    args = jax.tree.map(lambda x: sds(x.shape, x.dtype), jax.eval_shape(inputs))
    return fn, args


def program_names() -> list[str]:
    return [*_programs(), "generate-prefill", "generate-loop"]


def _max_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    finite = np.isfinite(b)
    if not np.array_equal(np.isfinite(a), finite):
        return float("inf")
    return float(np.max(np.abs(np.where(finite, a - b, 0.0)), initial=0.0))


def run_checks(emit=print, only: str = "") -> list[dict]:
    """Each check: max error of the kernel, the same-precision reference's, and pass/fail.
    ``emit(row)`` sees each row as it lands; ``only``: comma-separated name parts to run."""
    rows = []
    wanted = lambda name: not only or any(p in name for p in only.split(","))  # noqa: E731
    for name, (case, dtype) in CHECKS.items():
        if not wanted(name):
            continue
        inputs = jax.jit(functools.partial(_check_inputs, case, dtype))()
        kernels = ("pallas", "mosaic") if mosaic_takes(case) else ("pallas",)
        got = {}
        for how in (*kernels, "same", "oracle"):  # the oracle at full float32 (not TF32) dots
            with jax.default_matmul_precision("highest" if how == "oracle" else None):
                got[how] = jax.jit(_attend_vjp(case, how))(*inputs)
        for kernel in kernels:
            ratios = {}
            for i, what in enumerate(("out", "lse", "dq", "dk", "dv")):
                factor, floor = (2, FLOOR[dtype]) if i < 2 else (3, 10 * FLOOR[dtype])
                err = _max_err(got[kernel][i], got["oracle"][i])
                base = _max_err(got["same"][i], got["oracle"][i])
                ratios[what] = err / (factor * base + floor)
            worst = max(ratios, key=ratios.get)
            value = ratios[worst]
            tag = "" if kernel == "pallas" else f"-{kernel}"
            rows.append(
                dict(
                    section="check",
                    name=name + tag,
                    value=value,
                    unit="err/bound",
                    ok=value <= 1,
                    worst=worst,
                )
            )
            emit(rows[-1])
    for name, case in KV_CHECKS.items():
        if not wanted(name):
            continue
        args = jax.jit(functools.partial(_kv_inputs, case))()
        out, _ = jax.jit(_kv_step("pallas"))(args)
        with jax.default_matmul_precision("highest"):
            ref, _ = jax.jit(_kv_step("reference"))(args)
        bound = {BF16: 3e-2, F16: 4e-3}[case["dtype"]]
        value = _max_err(out, ref) / bound
        rows.append(dict(section="check", name=name, value=value, unit="err/bound", ok=value <= 1))
        emit(rows[-1])
    return rows


def run_generate(runs: int) -> list[dict]:
    """tokens/s of ``decoding.generate`` on a random llama-3-8b-shaped bf16 model."""
    from flax import nnx

    import decoding
    from models import Transformer, TransformerConfig

    config = TransformerConfig.preset(GEN["preset"], attn_impl="pallas")
    model = Transformer(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, config.vocab_size, (GEN["batch"], GEN["prompt_len"]), dtype=np.int32)
    decoding.generate(model, prompts, max_new_tokens=GEN["new_tokens"])  # compile
    stats = [
        decoding.generate(model, prompts, max_new_tokens=GEN["new_tokens"]).stats
        for _ in range(runs)
    ]
    tok_s = float(np.median([s["tokens_per_s"] for s in stats]))
    decode_tok_s = float(np.median([s["decode_tokens_per_s"] for s in stats]))
    return [
        dict(
            section="generate",
            name=f"{GEN['preset']} B{GEN['batch']}",
            value=tok_s,
            unit="tok/s",
            ok=True,
            decode_tok_s=decode_tok_s,
        ),
    ]


SPEC_CASES = (
    ("prompt-lookup", 3),
    ("medusa", 3),
    ("medusa+lookup", 3),
    ("medusa-tree:4", None),
    ("code-draft", 3),
)


def run_speculative(runs: int, attn_impl: str = "pallas") -> list[dict]:
    """Greedy ``speculative_generate`` on the shipped code models (Pallas attention) against
    plain ``generate`` in the same run: 2 held-out code prompts, 128 new tokens, batch 1. On a
    GPU a verification of k + 1 tokens costs about what a decode step does, which is where
    speculative decoding is meant to pay (on the 2-core CPU it costs 1.4-2x a step)."""
    import decoding
    import models
    from benchmarks import speculative as spec

    target, tok = models.pretrained("code-target", attn_impl=attn_impl)
    draft = models.pretrained("code-draft", attn_impl=attn_impl)[0]
    ids = [[tok.bos_id] + tok.encode(t) for t in spec.code_prompts(2)]
    timing, new = (runs, 1), spec.NEW_TOKENS
    plain = dict(
        tokens=[decoding.generate(target, [row], max_new_tokens=new).tokens for row in ids]
    )
    rows = []
    for kind, k in SPEC_CASES:
        if kind.startswith("medusa-tree"):  # calibrated here, so its depth is this run's
            k = spec.medusa_tree(kind).depth
        r = spec.ours(target, draft, ids, kind, k, decoding.SamplingConfig(), new, timing, plain)
        rows.append(
            dict(
                section="speculative",
                name=f"{kind} k={k}",
                value=r["speedup"],
                unit="x plain",
                ok=True,
                match=r["match"],
                tokens_per_call=r["tokens_per_call"],
            )
        )
    return rows


def run_attention(runs: int) -> list[dict]:
    rows = []
    impls = {**attention.GPU_IMPLS, "mosaic": MOSAIC}
    attn_rows, _ = attention.run_gpu(runs, impls=impls, configs=ATTN_CONFIGS, tokens=ATTN_TOKENS)
    cudnn = {(r["T"], r["D"], r["causal"]): r for r in attn_rows if r["impl"] == "cudnn"}
    for r in attn_rows:
        if r["impl"] == "mosaic":  # run_gpu compares pallas with cudnn; mosaic is compared here
            ref = cudnn.get((r["T"], r["D"], r["causal"]), {})
            for key in ("fwd_TFLOPs", "fwd_bwd_TFLOPs"):
                if key in r and key in ref:
                    r[f"{key}_vs_cudnn"] = r[key] / ref[key]
    for r in attn_rows:
        tag = f"{r['impl']} T{r['T']} D{r['D']} {'causal' if r['causal'] else 'full'}"
        for key in ("fwd_TFLOPs", "fwd_bwd_TFLOPs"):
            value, ratio = r.get(key), r.get(f"{key}_vs_cudnn")
            err = {"error": r["error"]} if "error" in r else {}
            rows.append(
                dict(
                    section="attention",
                    name=f"{key[:-7]} {tag}",
                    value=value,
                    unit="TFLOP/s",
                    vs=ratio,
                    ok=not err,
                    **err,
                )
            )
    return rows


def run_decode(runs: int) -> list[dict]:
    rows = []
    for r in decode.run(DECODE_CONFIGS, "pallas", jnp.bfloat16, runs, bundled=False):
        name = f"B{r['B']} S{r['S']} {r['layout']} splits {r['num_splits']}"
        err = {"error": r["error"]} if "error" in r else {}
        rows.append(
            dict(
                section="decode",
                name=name,
                value=r.get("GB_per_s"),
                unit="GB/s",
                vs=r.get("vs_copy"),
                ok=not err,
                **err,
            )
        )
    return rows


SECTIONS = {
    "check": lambda runs, emit, only: run_checks(emit, only),
    "decode": lambda runs, emit, only: run_decode(runs),
    "attention": lambda runs, emit, only: run_attention(runs),
    "speculative": lambda runs, emit, only: run_speculative(runs),
    "generate": lambda runs, emit, only: run_generate(runs),
}


def run_section(name: str, runs: int, emit=print, only: str = "") -> list[dict]:
    """One section's rows; an exception becomes one failed row holding its traceback, so the
    sections after it still run and the JSON says what broke."""
    try:
        return SECTIONS[name](runs, emit, only)
    except Exception:  # noqa: BLE001 - reported in the results, not swallowed
        import traceback

        err = traceback.format_exc()
        print(err, file=sys.stderr, flush=True)
        return [dict(section=name, name="error", value=None, unit="", ok=False, error=err[-4000:])]


def run_deviceless(jobs: int) -> list[dict]:
    from benchmarks import deviceless

    cases = [dict(id=n, family="suite", program=n) for n in program_names()]
    rows = []
    for r in deviceless.run_cases("h200", cases, jobs=jobs, batch=8):
        needs_device = r["id"].startswith("attn-") and "-cudnn-" in r["id"] and r["error"]
        status = "needs_device" if needs_device else r["status"]
        regs = max((k.get("registers", 0) for k in r["kernels"]), default=None)
        rows.append(
            dict(
                section="deviceless h200",
                name=r["id"],
                value=r["compile_s"],
                unit="compile s",
                ok=status in ("ok", "needs_device"),
                status=status,
                max_regs=regs,
                error=r["error"],
                kernels=r["kernels"],
            )
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deviceless", action="store_true", help="compile only, for the H200 target")
    p.add_argument("--runs", type=int, default=3, help="timed runs per measurement (median)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated, from {','.join(SECTIONS)}; a new row replaces the "
        "JSON's row of the same section and name, the others stay",
    )
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    p.add_argument("--checks", default="", help="check: only names containing one of these")
    args = p.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    if bad := [s for s in sections if s not in SECTIONS]:
        p.error(f"--sections: unknown {bad}; choose from {list(SECTIONS)}")
    meta = dict(runs=args.runs, load_average_1min=os.getloadavg()[0])
    if args.deviceless:
        rows, name = run_deviceless(args.jobs), "gpu_suite_deviceless"
        path = common.write_results(name, rows, results_dir=args.out, **meta)
    elif jax.default_backend() != "gpu":
        p.error("no GPU visible: run on a GPU, or pass --deviceless")
    else:
        name = "gpu_suite_" + jax.devices()[0].device_kind.replace(" ", "_").lower()
        path = (common.RESULTS_DIR if args.out is None else Path(args.out)) / f"{name}.json"
        rows = json.loads(path.read_text())["rows"] if path.exists() else []
        emitted = []  # the row objects themselves (an id could be reused once one is freed)

        def emit(row):  # a row replaces the one of the same section and name; JSON rewritten
            nonlocal rows
            if any(r is row for r in emitted):  # run_checks emits its rows as they land
                return
            emitted.append(row)
            print(row, flush=True)
            key = (row["section"], row["name"])
            rows = [r for r in rows if (r["section"], r["name"]) != key] + [row]
            common.write_results(name, rows, results_dir=path.parent, **meta)

        for section in sections:
            print(f"== section {section}", flush=True)
            rows = [r for r in rows if (r["section"], r["name"]) != (section, "error")]
            for row in run_section(section, args.runs, emit, args.checks):
                emit(row)
    common.print_table(rows, ["section", "name", "value", "unit", "vs", "ok"])
    failed = [r["name"] for r in rows if not r["ok"]]
    print(f"wrote {path}; {len(rows) - len(failed)} ok, {len(failed)} failed {failed or ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
