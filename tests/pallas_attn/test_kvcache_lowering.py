"""impl="pallas" KV-cache attention lowers for CUDA (Triton) from a CPU-only machine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_attn import attention_with_kvcache

B, Hq, Hkv = 2, 8, 2


def lower_decode_step(
    *, Tq, paged, D=128, dtype=jnp.bfloat16, fp8=False, rotary=False, Tn=None, **opts
):
    """Lowers one decode step (append Tn new tokens, attend Tq queries) to CUDA; returns the text."""
    Tn = Tq if Tn is None else Tn
    S, P = 1024, 16
    cache_dtype = jnp.float8_e4m3fn if fp8 else dtype
    shape = (B * S // P, P, Hkv, D) if paged else (B, S, Hkv, D)
    args = dict(
        q=jax.ShapeDtypeStruct((B, Tq, Hq, D), dtype),
        k_cache=jax.ShapeDtypeStruct(shape, cache_dtype),
        v_cache=jax.ShapeDtypeStruct(shape, cache_dtype),
        k=jax.ShapeDtypeStruct((B, Tn, Hkv, D), dtype),
        v=jax.ShapeDtypeStruct((B, Tn, Hkv, D), dtype),
        cache_seqlens=jax.ShapeDtypeStruct((B,), jnp.int32),
    )
    if paged:
        args["block_table"] = jax.ShapeDtypeStruct((B, S // P), jnp.int32)
    if fp8:
        args["k_descale"] = args["v_descale"] = jax.ShapeDtypeStruct((B, Hkv), jnp.float32)
    if rotary:
        args["rotary_cos"] = args["rotary_sin"] = jax.ShapeDtypeStruct((S, 32), dtype)

    caches = (args.pop("k_cache"), args.pop("v_cache"))

    def step(caches, a):
        return attention_with_kvcache(
            a.pop("q"), *caches, a.pop("k"), a.pop("v"), **a, impl="pallas", return_lse=True, **opts
        )

    lowered = jax.jit(step, donate_argnums=0).trace(caches, args)
    lowered = lowered.lower(lowering_platforms=("cuda",))
    return lowered.as_text()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("Tq", [1, 5])
def test_lowers_for_cuda(Tq, paged):
    text = lower_decode_step(Tq=Tq, paged=paged, causal=True)
    assert "kvcache_decode" in text and "kvcache_append" in text
    # In place: both donated caches alias outputs of the program, and the append kernel's
    # outputs alias its cache operands (no copy of the cache on the way).
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    assert main.count("tf.aliasing_output") == 2
    assert text.count("stablehlo.output_operand_alias<") == 2


@pytest.mark.parametrize(
    "opts",
    [
        dict(Tq=1, paged=True, fp8=True, rotary=True, causal=True),
        dict(Tq=5, paged=False, fp8=True, window_size=(64, 0), softcap=30.0),
        dict(Tq=5, paged=True, rotary=True, rotary_interleaved=False, causal=True, D=80),
        dict(Tq=64, paged=True, Tn=0, causal=True, dtype=jnp.float16),
        dict(Tq=1, paged=False, dtype=jnp.float32, num_splits=3, D=64),
    ],
    ids=["fp8-rotary-paged", "fp8-window-softcap", "neox-D80", "chunked-no-append", "f32-split3"],
)
def test_option_mixes_lower_for_cuda(opts):
    text = lower_decode_step(**opts)
    assert "kvcache_decode" in text
    assert ("kvcache_append" in text) == (opts.get("Tn", 1) != 0)
