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

import ctypes
import functools
import math
import os
import sys
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn import native

PANEL = 32  # columns per panel (kNB in rows_matmul.cc)
MAX_ROWS = 64
ROW_BLOCK = 8  # rows a panel pass holds in registers (kMaxRows in rows.h): a 9th starts another


def available() -> bool:
    """Whether the kernel is built and registered (:func:`pallas_attn.native.available`)."""
    return native.available()


def pack(w, transpose: bool = False) -> jax.Array:
    """Weights ``w [K, N]`` (``[N, K]`` with ``transpose``) -> panels, float32 or bfloat16
    (other dtypes are stored as float32), zero-padded columns:

    * float32: ``[ceil(N / PANEL), K, PANEL]``, panel ``p`` row ``k`` = ``w[k, 32 p : 32 p + 32]``;
    * bfloat16: ``[ceil(N / PANEL), K2, PANEL]`` with ``K2`` = K rounded up to even (a zero pad
      row), rows in pairs: the ``2 PANEL`` values of rows ``2 j, 2 j + 1`` are stored as
      ``[PANEL columns, 2]`` (the operand layout of the bfloat16 pair dot products).
    """
    if transpose:
        w = w.T
    K, N = w.shape
    if w.dtype not in (jnp.float32, jnp.bfloat16):
        w = w.astype(jnp.float32)
    P = -(-N // PANEL)
    if w.dtype == jnp.bfloat16:
        K2 = K + K % 2
        w = jnp.pad(w, ((0, K2 - K), (0, P * PANEL - N)))
        return w.reshape(K2 // 2, 2, P, PANEL).transpose(2, 0, 3, 1).reshape(P, K2, PANEL)
    w = jnp.pad(w, ((0, 0), (0, P * PANEL - N)))
    return w.reshape(K, P, PANEL).transpose(1, 0, 2)


HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25  # Linux 6.1+


@functools.cache
def _madvise():
    if not sys.platform.startswith("linux") or os.environ.get("PALLAS_ATTN_HUGE_PAGES") == "0":
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_pages(a: jax.Array) -> bool:
    """Asks Linux to back ``a``'s buffer with 2 MiB transparent huge pages now
    (``MADV_COLLAPSE``, Linux 6.1+; best effort: False where the platform or the array does not
    allow it, or the kernel reports an error, e.g. ENOMEM where the rounded range reaches unmapped
    memory, after collapsing the mapped part; ``PALLAS_ATTN_HUGE_PAGES=0`` turns it off). The range
    is rounded out to whole huge pages, whose other bytes keep their contents. A decode step streams every packed weight once:
    over 4 KiB pages each page costs a TLB walk and restarts the hardware prefetcher, and the
    few-row product read float32 panels at 18 GB/s against 21 GB/s over huge pages on the AMX
    development VM (``benchmarks/results`` holds the decode figures)."""
    madvise = _madvise()
    if madvise is None or a.nbytes < HUGE_PAGE:
        return False
    try:
        ptr = a.unsafe_buffer_pointer()
    except Exception:  # sharded, deleted, or not a host buffer
        return False
    lo = ptr // HUGE_PAGE * HUGE_PAGE
    hi = -(-(ptr + a.nbytes) // HUGE_PAGE) * HUGE_PAGE
    return madvise(lo, hi - lo, MADV_COLLAPSE) == 0


_pack = jax.jit(pack, static_argnums=1)
_PACKED: dict[tuple[int, bool], jax.Array] = {}


def packed(w: jax.Array, transpose: bool = False) -> jax.Array:
    """``pack(w, transpose)`` for a concrete array, made once while ``w`` lives: repeated decode
    calls on the same weights pack them once (an updated weight is a new array, packed anew)."""
    key = (id(w), transpose)
    if (hit := _PACKED.get(key)) is None:
        hit = _PACKED[key] = _pack(w, transpose)
        huge_pages(hit.block_until_ready())
        weakref.finalize(w, _PACKED.pop, key, None)
    return hit


def matmul(x, panels, n: int, activations: str | None = None) -> jax.Array:
    """``x [..., K] @ W`` -> float32 ``[..., n]`` for ``panels = pack(W)``, ``W [K, n]``; at most
    MAX_ROWS rows, accumulated in float32. Needs :func:`available`.

    ``activations`` (bfloat16 panels; float32 panels take only ``"f32"`` or None):

    * ``"f32"``: each weight widened to float32 and multiplied by the float32 activation: the
      sums of float32 panels of the same values, bit for bit;
    * ``"bf16"``: bfloat16 pair dot products (AVX-512 BF16 ``vdpbf16ps``, where
      :func:`bf16_dot_available`; elsewhere the same as ``"f32"``). Each activation is split as
      ``x = hi + lo``, both bfloat16, and multiplied in two passes; activations that are already
      bfloat16 (every bfloat16 model's) have ``lo = 0`` and take one pass, with exact products.
      Otherwise ``|x - hi - lo| <= 2^-17 |x|``, so an output moves by at most
      ``2^-17 sum_k |x_k w_k|`` beyond float32 rounding (tests/models/test_rows_matmul.py);
    * None: :data:`DEFAULT_BF16_ACTIVATIONS`.
    """
    lead, K = x.shape[:-1], x.shape[-1]
    P, Kp, panel = panels.shape
    bf16 = panels.dtype == jnp.bfloat16
    if Kp != K + (K % 2 if bf16 else 0) or panel != PANEL or -(-n // PANEL) != P:
        raise ValueError(f"panels {panels.shape} do not fit x [..., {K}] and n = {n}")
    code = kernel_format("bfloat16" if bf16 else "float32", activations)
    M = math.prod(lead)
    if not available():
        raise RuntimeError("the native CPU kernels are not built (pallas_attn.native.available)")
    if M > max_rows(panels):
        raise ValueError(f"x has {M} rows; rows_matmul is for at most {MAX_ROWS}")
    y = jax.ffi.ffi_call(native.ROWS_MATMUL, jax.ShapeDtypeStruct((M, n), jnp.float32))(
        x.reshape(M, K).astype(jnp.float32), panels, kind=np.int32(code)
    )
    return y.reshape(*lead, n)


def max_rows(panels) -> int | float:
    """The most rows :func:`matmul` takes over ``panels``: MAX_ROWS (past it XLA's own GEMM
    is the faster on float32), any number for bfloat16 panels where :func:`amx_available` (the
    tile products stay faster than XLA:CPU's bfloat16 GEMM, which widens the weights to float32
    on every call: SmolLM2's 128-token prefill chunks ran 1.7x slower in bfloat16 than in
    float32 that way)."""
    return math.inf if panels.dtype == jnp.bfloat16 and amx_available() else MAX_ROWS


def bf16_dot_available() -> bool:
    """Whether the kernels run AVX-512 BF16 dot products (``avx512_bf16`` built for and on this
    CPU: :func:`pallas_attn.native.features`), which the ``"bf16"`` activations of
    :func:`matmul` need to differ from ``"f32"``."""
    return "avx512_bf16" in native.features()


def amx_available() -> bool:
    """Whether ``"bf16"`` products run on the AMX tile unit (``amx_bf16`` built for and on this
    CPU: Sapphire Rapids and later; Linux grants the tile state per process): bound by reading the weights up to 16 rows
    and beyond, where ``vdpbf16ps`` is compute-bound from about 8 rows (batched decode steps,
    verification, prefill chunks). ``PALLAS_ATTN_AMX=0`` turns it off for a process. Each row's
    sums still do not depend on the rows beside it; they differ from ``vdpbf16ps``'s in the last
    bits."""
    return "amx_bf16" in native.features() and os.environ.get("PALLAS_ATTN_AMX") != "0"


# Block-quantized weights (models/quant.py): the same product over panels of GGUF-style blocks.
FORMATS = ("q8_0", "q4_0", "q4_1")  # the kernel's format numbers are indices here
BLOCK = 32  # weights per block along K
ACTIVATIONS = ("f32", "q8")
# The default of matmul_quantized's ``activations``: the faster of the two on SmolLM2 decoding
# (docs/quantization.md has the figures and the error the 8-bit blocks add).
DEFAULT_ACTIVATIONS = "q8"
_Q8_ACTIVATIONS = 16  # added to the kernel's format number (kQ8Activations in rows_matmul.cc)
BF16_ACTIVATIONS = ("f32", "bf16")
DEFAULT_BF16_ACTIVATIONS = "bf16"  # exact for bfloat16 activations, and half the instructions
# rows_matmul.h WeightKind: float32 panels, bfloat16 with pair dot products, bfloat16 widened.
_FLOAT_KINDS = {("float32", "f32"): 3, ("bfloat16", "bf16"): 4, ("bfloat16", "f32"): 5}


def kernel_format(fmt: str, activations: str | None = None) -> int:
    """The native kernels' number for weights of ``fmt`` (``"float32"``, ``"bfloat16"`` or one
    of :data:`FORMATS`) multiplied with ``activations`` (None: the format's default, as
    :func:`matmul` and :func:`matmul_quantized` take it): the ``kind`` the fused decode layer
    passes for each product. ValueError naming a bad ``fmt`` or ``activations``."""
    if fmt in FORMATS:
        q8 = check_activations(activations) == "q8"
        return FORMATS.index(fmt) + (_Q8_ACTIVATIONS if q8 else 0)
    if fmt == "float32":
        if activations not in (None, "f32"):
            raise ValueError(f"activations must be 'f32' for float32 weights, got {activations!r}")
        return _FLOAT_KINDS[fmt, "f32"]
    if fmt == "bfloat16":
        if activations is None:
            activations = DEFAULT_BF16_ACTIVATIONS
        if activations not in BF16_ACTIVATIONS:
            raise ValueError(
                f"activations must be one of {BF16_ACTIVATIONS} for bfloat16 weights, "
                f"got {activations!r}"
            )
        return _FLOAT_KINDS[fmt, activations]
    raise ValueError(f"fmt must be 'float32', 'bfloat16' or one of {FORMATS}, got {fmt!r}")


def block_bytes(fmt: str) -> int:
    """Bytes of one (panel, block) of :func:`pack_quantized`: float16 scales [32], float16
    minimums [32] (q4_1), then the quants in groups of 4 consecutive weights per column,
    ``[groups, 32 columns, 4]``: q8_0 8 groups, byte ``q + 128`` of weight ``4 g + i``; q4 4
    groups, weight ``4 g + i`` in the low nibble and ``16 + 4 g + i`` in the high one."""
    return {"q8_0": 64 + 1024, "q4_0": 64 + 512, "q4_1": 128 + 512}[fmt]


def _bytes(a, pad: int):
    """a [R, N] (float16) -> uint8 [P, R, PANEL * itemsize]: column panels."""
    R, N = a.shape
    a = jnp.pad(a, ((0, 0), (0, pad)))
    P = a.shape[1] // PANEL
    a = a.reshape(R, P, PANEL).transpose(1, 0, 2)
    return jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(P, R, -1)


def pack_quantized(fmt: str, quants, scales, mins=None) -> jax.Array:
    """Quantized weights (the layout of :class:`models.quant.QuantLinear`: ``quants`` [K, N]
    int8 (q8_0) or [K / 2, N] uint8 (q4: block b's rows 16 b + j hold weights 32 b + j and
    32 b + 16 + j in the low and high nibble), ``scales`` and ``mins`` [K / 32, N] float16) ->
    panels uint8 [ceil(N / PANEL), K / 32, block_bytes(fmt)] (zero columns padded). Each column's
    quants come in groups of 4 consecutive weights: one 32-bit lane of the kernel's 4-way
    integer dot products (and of its float path's unpacking)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    nb, N = scales.shape
    pad = -N % PANEL
    P = (N + pad) // PANEL
    groups = 8 if fmt == "q8_0" else 4
    q = jnp.pad(quants.reshape(nb, groups, 4, N), ((0, 0), (0, 0), (0, 0), (0, pad)))
    if fmt == "q8_0":  # offset binary: the unsigned operand of the integer products
        q = jax.lax.bitcast_convert_type(q, jnp.uint8) ^ np.uint8(0x80)
    q = q.reshape(nb, groups, 4, P, PANEL).transpose(3, 0, 1, 4, 2).reshape(P, nb, -1)
    parts = [_bytes(scales, pad)]
    if fmt == "q4_1":
        parts.append(_bytes(mins, pad))
    parts.append(q)
    return jnp.concatenate(parts, axis=-1)


_pack_quantized = jax.jit(pack_quantized, static_argnums=0)


def packed_quantized(fmt: str, quants, scales, mins=None) -> jax.Array:
    """:func:`pack_quantized` for concrete arrays, made once while ``quants`` lives (as
    :func:`packed`)."""
    key = (id(quants), fmt)
    if (hit := _PACKED.get(key)) is None:
        hit = _PACKED[key] = _pack_quantized(fmt, quants, scales, mins)
        huge_pages(hit.block_until_ready())
        weakref.finalize(quants, _PACKED.pop, key, None)
    return hit


def check_activations(activations) -> str:
    """``activations`` itself, or ValueError naming it; None means :data:`DEFAULT_ACTIVATIONS`."""
    if activations is None:
        return DEFAULT_ACTIVATIONS
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    return activations


def matmul_quantized(x, panels, n: int, fmt: str, activations: str | None = None) -> jax.Array:
    """``x [..., K] @ W`` -> float32 ``[..., n]`` for ``panels = pack_quantized(fmt, ...)`` of
    ``W [K, n]``. At most MAX_ROWS rows. Needs :func:`available`.

    ``activations``:

    * ``"f32"``: float32 activations, each weight dequantized in registers: equal bit for bit to
      :func:`matmul` over ``pack(dequantized W)``;
    * ``"q8"``: each row's activations quantized per block of 32 (``d = max |x| / 127``,
      ``q = round-half-even(x / d)`` int8, float32 ``d``), int32 dot products per block, scaled
      and summed in float32. Relative to ``"f32"`` each activation moves by at most ``d / 2``,
      so an output moves by at most ``sum over blocks of d_x / 2 * sum |w|`` of the block
      (tests/models/test_quant_q8act.py checks that bound and the exact integer arithmetic);
    * None: :data:`DEFAULT_ACTIVATIONS`.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    activations = check_activations(activations)
    lead, K = x.shape[:-1], x.shape[-1]
    P, nb, bb = panels.shape
    if K != nb * BLOCK or bb != block_bytes(fmt) or -(-n // PANEL) != P:
        raise ValueError(f"{fmt} panels {panels.shape} do not fit x [..., {K}] and n = {n}")
    M = math.prod(lead)
    if not available():
        raise RuntimeError("the native CPU kernels are not built (pallas_attn.native.available)")
    if M > MAX_ROWS:
        raise ValueError(f"x has {M} rows; rows_matmul is for at most {MAX_ROWS}")
    code = kernel_format(fmt, activations)
    y = jax.ffi.ffi_call(native.ROWS_MATMUL_Q, jax.ShapeDtypeStruct((M, n), jnp.float32))(
        x.reshape(M, K).astype(jnp.float32), panels, fmt=np.int32(code)
    )
    return y.reshape(*lead, n)
