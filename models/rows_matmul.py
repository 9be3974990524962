"""Few-row products on CPU: ``x [M, K] @ W [K, N]`` for 1 <= M <= 64 with packed weights.

Decoding multiplies every weight matrix by a handful of rows per step (one per sequence; k + 1
per sequence when verifying a speculation), so a step streams all weights once and its speed is
the rate at which the product reads them. XLA:CPU's product reads [K, N] weights at 13-22 GB/s
for 4 <= M <= 16 on the 2-core development VM; the kernel in ``rows_matmul.cc`` reads weights
packed as panels [ceil(N / 32), K, 32] (one contiguous stream per 32 columns, every row's
accumulators in registers) at 32-50 GB/s: 1.6-2.4x at M = 4..8, 1.0-1.5x at M = 1 (K = 256..2048,
N = 256..4096; ``python -m benchmarks.generate`` measures it on the models).

The kernel is ``pallas_attn/native/rows_matmul.cc``, built and registered by
:mod:`pallas_attn.native` (where it cannot be, :func:`available` is False and callers keep
XLA's product).
"""

from __future__ import annotations

import math
import weakref

import jax
import jax.numpy as jnp

from pallas_attn import native

PANEL = 32  # columns per panel (kNB in rows_matmul.cc)
MAX_ROWS = 64


def available() -> bool:
    """Whether the kernel is built and registered (:func:`pallas_attn.native.available`)."""
    return native.available()


def pack(w, transpose: bool = False) -> jax.Array:
    """Weights ``w [K, N]`` (``[N, K]`` with ``transpose``) -> panels ``[ceil(N / PANEL), K,
    PANEL]`` (zero-padded columns), float32 or bfloat16 (other dtypes are stored as float32)."""
    if transpose:
        w = w.T
    K, N = w.shape
    if w.dtype not in (jnp.float32, jnp.bfloat16):
        w = w.astype(jnp.float32)
    P = -(-N // PANEL)
    w = jnp.pad(w, ((0, 0), (0, P * PANEL - N)))
    return w.reshape(K, P, PANEL).transpose(1, 0, 2)


_pack = jax.jit(pack, static_argnums=1)
_PACKED: dict[tuple[int, bool], jax.Array] = {}


def packed(w: jax.Array, transpose: bool = False) -> jax.Array:
    """``pack(w, transpose)`` for a concrete array, made once while ``w`` lives: repeated decode
    calls on the same weights pack them once (an updated weight is a new array, packed anew)."""
    key = (id(w), transpose)
    if (hit := _PACKED.get(key)) is None:
        hit = _PACKED[key] = _pack(w, transpose)
        weakref.finalize(w, _PACKED.pop, key, None)
    return hit


def matmul(x, panels, n: int) -> jax.Array:
    """``x [..., K] @ W`` -> float32 ``[..., n]`` for ``panels = pack(W)``, ``W [K, n]``; at most
    MAX_ROWS rows, accumulated in float32. Needs :func:`available`."""
    lead, K = x.shape[:-1], x.shape[-1]
    P, Kp, panel = panels.shape
    if Kp != K or panel != PANEL or -(-n // PANEL) != P:
        raise ValueError(f"panels {panels.shape} do not fit x [..., {K}] and n = {n}")
    M = math.prod(lead)
    if not available():
        raise RuntimeError("the native CPU kernels are not built (pallas_attn.native.available)")
    if M > MAX_ROWS:
        raise ValueError(f"x has {M} rows; rows_matmul is for at most {MAX_ROWS}")
    y = jax.ffi.ffi_call(native.ROWS_MATMUL, jax.ShapeDtypeStruct((M, n), jnp.float32))(
        x.reshape(M, K).astype(jnp.float32), panels
    )
    return y.reshape(*lead, n)
