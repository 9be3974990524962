"""The programs ``make gpu-compile`` compiles for CUDA targets, as JSON-able case dicts.

A case is ``{"id", "family", ...parameters}``; :func:`build` turns it into ``(fn, args)`` with
``args`` as ``ShapeDtypeStruct`` placed on a deviceless target
(:mod:`benchmarks.deviceless`). Families:

* ``flash``: ``flash_attention`` forward + backward (``jax.grad``: the forward, dK/dV and dQ
  kernels) at the default tiles, B = 1, T = S = 1024, Hq = 16, Hkv = 4; ``mask`` one of causal,
  window (256, 256), softcap (30, causal), segments (causal), varlen (``flash_attention_varlen``,
  4 sequences, max 512).
* ``mosaic_flash``: the same forward + backward with ``impl="mosaic"`` (the Mosaic GPU kernels:
  TMA, wgmma; sm_90+ only, 16-bit), ``mask`` one of causal, window, softcap, segments, varlen.
* ``kvcache``: one ``attention_with_kvcache`` step: append ``Tq`` new tokens (optionally rotary,
  FP8 cache, a tree mask among them) then split-KV decode over S = 4096 keys (contiguous or paged, P = 16), B = 2,
  Hkv = 2, G query heads per KV head; ``num_splits`` 0 (heuristic) splits here, so the combine
  runs too.
* ``model_decode`` / ``model_train``: the ``code-target`` preset's cached forward of one token
  (paged cache, B = 8) and its optax train step (B = 16, T = 256, packed segments).
* ``generate``: a llama-3-8b-shaped model's (bf16, weights as ``nnx.eval_shape`` shapes) jitted
  ``lax.while_loop`` decode (``decoding.generate``'s loop, B = 8, paged cache of 4096 positions)
  and its prefill (512-token prompts).
* ``suite``: a program of :mod:`benchmarks.gpu_suite`, by name.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

HEAD_DIMS = (32, 40, 64, 80, 96, 128, 160, 192, 256)
DTYPES = ("bfloat16", "float16", "float32")
MASKS = ("causal", "window", "softcap", "segments", "varlen")


def flash_case(D: int, dtype: str, mask: str) -> dict:
    return dict(id=f"flash-D{D}-{dtype}-{mask}", family="flash", D=D, dtype=dtype, mask=mask)


MOSAIC_HEAD_DIMS = (64, 80, 128)
MOSAIC_MASKS = ("causal", "window", "softcap", "segments", "varlen")


def mosaic_flash_case(D: int, dtype: str, mask: str) -> dict:
    return dict(
        id=f"mosaic_flash-D{D}-{dtype}-{mask}",
        family="mosaic_flash",
        D=D,
        dtype=dtype,
        mask=mask,
        mosaic=True,
    )


def mosaic_kvcache_case(D, dtype, G, Tq, layout, *, rotary=False, fp8=False, tree=False) -> dict:
    case = kvcache_case(D, dtype, G, Tq, layout, rotary=rotary, fp8=fp8, tree=tree)
    return {**case, "id": "mosaic_" + case["id"], "mosaic": True}


def mosaic_cases() -> list[dict]:
    """Every Mosaic head dim, both 16-bit dtypes and every mask in turn; decode at D 64 and 128,
    paged and contiguous, Tq 1 and 5, G 8 and 4, an FP8 cache in each 16-bit dtype (bfloat16
    upcasts through float32, float16 directly), a tree mask at Tq = 16."""
    return [
        mosaic_flash_case(D, ("bfloat16", "float16")[i % 2], mask)
        for i, (D, mask) in enumerate(zip((*MOSAIC_HEAD_DIMS, 128, 64), MOSAIC_MASKS, strict=True))
    ] + [
        mosaic_kvcache_case(128, "bfloat16", 8, 1, "paged", rotary=True),
        mosaic_kvcache_case(64, "float16", 4, 5, "contiguous"),
        mosaic_kvcache_case(128, "bfloat16", 4, 5, "paged", fp8=True, rotary=True),
        mosaic_kvcache_case(64, "float16", 8, 1, "contiguous", fp8=True),
        mosaic_kvcache_case(128, "bfloat16", 4, 16, "paged", tree=True),
    ]


def kvcache_case(
    D, dtype, G, Tq, layout, *, fp8=False, rotary=False, num_splits=0, tree=False
) -> dict:
    tags = (
        [layout]
        + ["fp8"] * fp8
        + ["rotary"] * rotary
        + ["tree"] * tree
        + [f"splits{num_splits}"] * (num_splits > 0)
    )
    return dict(
        id=f"kvcache-D{D}-{dtype}-G{G}-Tq{Tq}-" + "-".join(tags),
        family="kvcache",
        D=D,
        dtype=dtype,
        G=G,
        Tq=Tq,
        layout=layout,
        fp8=fp8,
        rotary=rotary,
        num_splits=num_splits,
        tree=tree,
    )


MODEL_CASES = [
    dict(id="model_decode-code-target", family="model_decode"),
    *(
        dict(id=f"model_decode-code-target-{fmt}", family="model_decode_quantized", fmt=fmt)
        for fmt in ("q8_0", "q4_0", "q4_1")
    ),
    dict(id="model_train-code-target", family="model_train"),
    dict(id="generate-llama-3-8b-loop", family="generate", phase="loop"),
    dict(id="generate-llama-3-8b-prefill", family="generate", phase="prefill"),
]


def ci_cases() -> list[dict]:
    """Every kernel family, every D, each dtype class (16-bit, float32), every mask, all Tq.

    Per D: the softcap mask (the most live tiles in the backward) in a 16-bit dtype (bf16 and f16
    alternate over D) and in float32, plus one more mask in turn; decode with append in a 16-bit
    and in float32, Tq and G in turn, contiguous and paged, rotary, FP8 for D in {64, 128, 256}.
    """
    cases = []
    for i, D in enumerate(HEAD_DIMS):
        half = DTYPES[i % 2]
        other = MASKS[[0, 1, 3, 4][i % 4]]
        cases += [flash_case(D, half, "softcap"), flash_case(D, "float32", "softcap")]
        cases.append(flash_case(D, DTYPES[(i + 1) % 3], other))
        Tq, G = (1, 5, 16)[i % 3], (1, 4, 8)[i % 3]
        cases.append(kvcache_case(D, half, G, Tq, "paged", rotary=True))
        cases.append(kvcache_case(D, "float32", 8, 16, "contiguous", num_splits=1))
        if D in (64, 128, 256):
            cases.append(kvcache_case(D, "bfloat16", 4, 5, "paged", fp8=True, rotary=True))
    return cases + mosaic_cases() + MODEL_CASES


def smoke_cases() -> list[dict]:
    """A few cases per kernel family, for a target whose code generation another target already
    covers (H100 beside H200: same sm_90, SM count and shared memory)."""
    return [
        flash_case(64, "bfloat16", "causal"),
        flash_case(256, "bfloat16", "softcap"),
        flash_case(128, "float32", "segments"),
        flash_case(40, "float16", "varlen"),
        kvcache_case(128, "bfloat16", 4, 5, "paged", fp8=True, rotary=True),
        kvcache_case(256, "float32", 8, 16, "contiguous", num_splits=1),
        mosaic_flash_case(128, "bfloat16", "causal"),
        mosaic_kvcache_case(128, "bfloat16", 8, 1, "paged", rotary=True),
        MODEL_CASES[0],
        MODEL_CASES[1],  # the Q8_0 decode step
    ]


def full_cases() -> list[dict]:
    """The whole cross: flash D x dtype x mask; kvcache D x dtype x G x Tq x layout, FP8."""
    cases = [flash_case(D, dt, m) for D in HEAD_DIMS for dt in DTYPES for m in MASKS]
    for D in HEAD_DIMS:
        for dt in DTYPES:
            for G in (1, 4, 8):
                for Tq in (1, 5, 16):
                    layout = "paged" if (G + Tq) % 2 else "contiguous"
                    cases.append(kvcache_case(D, dt, G, Tq, layout, rotary=Tq == 5))
        cases.append(kvcache_case(D, "bfloat16", 4, 16, "paged", fp8=True, rotary=True))
    mosaic = [
        mosaic_flash_case(D, dt, m)
        for D in MOSAIC_HEAD_DIMS
        for dt in ("bfloat16", "float16")
        for m in MOSAIC_MASKS
    ]
    mosaic += [
        mosaic_kvcache_case(D, dt, G, Tq, layout, rotary=Tq == 5)
        for D in (64, 128)
        for dt in ("bfloat16", "float16")
        for G, Tq, layout in ((1, 1, "contiguous"), (4, 5, "paged"), (8, 16, "paged"))
    ]
    mosaic += [
        mosaic_kvcache_case(D, dt, 4, 5, "paged", fp8=True, rotary=True)
        for D in (64, 128)
        for dt in ("bfloat16", "float16")
    ]
    return cases + mosaic + MODEL_CASES


def build(case: dict, where):
    """``(fn, args)`` for a case; ``where`` is the target's sharding."""
    sds = functools.partial(_sds, where=where)
    family = case["family"]
    if family in ("flash", "mosaic_flash"):
        return _flash(case, sds)
    if family == "kvcache":
        return _kvcache(case, sds)
    if family in ("model_decode", "model_decode_quantized", "model_train", "generate"):
        from benchmarks import gpu_models

        return getattr(gpu_models, family)(case, sds)
    if family == "suite":
        from benchmarks import gpu_suite

        return gpu_suite.program(case["program"], sds)
    raise ValueError(f"unknown case family {family!r}")


def _sds(shape, dtype, *, where):
    dtype = jnp.dtype(dtype) if isinstance(dtype, str) else dtype  # PRNG key dtypes pass through
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=where)


def _flash(case, sds):
    from pallas_attn import flash_attention, flash_attention_varlen

    D, dtype, mask = case["D"], case["dtype"], case["mask"]
    B, T, Hq, Hkv = 1, 1024, 16, 4
    impl = "mosaic" if case["family"] == "mosaic_flash" else "pallas"
    if mask == "varlen":
        q, kv = sds((T, Hq, D), dtype), sds((T, Hkv, D), dtype)
        cu = sds((5,), jnp.int32)
        attend = functools.partial(
            flash_attention_varlen, max_seqlen_q=512, max_seqlen_k=512, causal=True, impl=impl
        )

        def loss(q, k, v, cu):
            return jnp.sum(attend(q, k, v, cu, cu).astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2)), (q, kv, kv, cu)
    opts = dict(
        causal=dict(causal=True),
        window=dict(window_size=(256, 256)),
        softcap=dict(causal=True, softcap=30.0),
        segments=dict(causal=True),
    )[mask]
    q, kv = sds((B, T, Hq, D), dtype), sds((B, T, Hkv, D), dtype)
    seg = sds((B, T), jnp.int32)

    def loss(q, k, v, seg):
        if mask == "segments":
            opts.update(q_segment_ids=seg, kv_segment_ids=seg)
        out = flash_attention(q, k, v, **opts, impl=impl)
        return jnp.sum(out.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2)), (q, kv, kv, seg)


def _kvcache(case, sds):
    from pallas_attn import attention_with_kvcache

    D, dtype, G, Tq = case["D"], case["dtype"], case["G"], case["Tq"]
    B, Hkv, S, P = 2, 2, 4096, 16
    cache_dtype = jnp.float8_e4m3fn if case["fp8"] else dtype
    paged = case["layout"] == "paged"
    shape = (B * S // P, P, Hkv, D) if paged else (B, S, Hkv, D)
    args = dict(
        q=sds((B, Tq, G * Hkv, D), dtype),
        k_cache=sds(shape, cache_dtype),
        v_cache=sds(shape, cache_dtype),
        k=sds((B, Tq, Hkv, D), dtype),
        v=sds((B, Tq, Hkv, D), dtype),
        cache_seqlens=sds((B,), jnp.int32),
    )
    if paged:
        args["block_table"] = sds((B, S // P), jnp.int32)
    if case["fp8"]:
        args["k_descale"] = args["v_descale"] = sds((B, Hkv), jnp.float32)
    if case["rotary"]:
        args["rotary_cos"] = args["rotary_sin"] = sds((S, D // 4), dtype)
    if case.get("tree"):
        args["tree_mask"] = sds((B, Tq, Tq), jnp.bool_)

    def step(a):
        a = dict(a)
        res = attention_with_kvcache(
            a.pop("q"),
            a.pop("k_cache"),
            a.pop("v_cache"),
            a.pop("k"),
            a.pop("v"),
            **a,
            causal=True,
            num_splits=case["num_splits"],
            return_lse=True,
            impl="mosaic" if case.get("mosaic") else "pallas",
        )
        return res.out, res.lse, res.k_cache, res.v_cache

    return step, (args,)
