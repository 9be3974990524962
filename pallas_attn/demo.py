"""A short attention demo: ``python -m pallas_attn.demo``."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

import pallas_attn


def main() -> None:
    B, T, Hq, Hkv, D = 1, 2048, 8, 2, 64
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (B, T, Hq, D), jnp.float32)
    k = jax.random.normal(kk, (B, T, Hkv, D), jnp.float32)
    v = jax.random.normal(kv, (B, T, Hkv, D), jnp.float32)
    print(f"backend={jax.default_backend()}  q={q.shape} k/v={k.shape} causal, GQA {Hq}/{Hkv}")
    for impl in ("reference", "xla"):
        f = jax.jit(
            lambda q, k, v, impl=impl: pallas_attn.flash_attention(
                q, k, v, causal=True, return_lse=True, impl=impl
            )
        )
        out, lse = jax.block_until_ready(f(q, k, v))
        start = time.perf_counter()
        out, lse = jax.block_until_ready(f(q, k, v))
        ms = (time.perf_counter() - start) * 1e3
        print(
            f"  {impl:9s} {ms:8.1f} ms  out[0,-1,0,:4]={out[0, -1, 0, :4]}  lse[0,0,-1]={lse[0, 0, -1]:.4f}"
        )
        if impl == "reference":
            ref = out
    print(f"max |xla - reference| = {float(jnp.max(jnp.abs(out - ref))):.2e}")


if __name__ == "__main__":
    main()
