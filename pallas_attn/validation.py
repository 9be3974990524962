"""Input checks shared by the public entry points. Each raises naming the argument and its value."""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp

# The ``impl`` values (exported as ``pallas_attn.IMPLS``). "native" (the C++ kernel of the cached
# attention step on CPU, :mod:`pallas_attn.cpu`) is taken by ``attention_with_kvcache`` only.
IMPLS = ("auto", "reference", "xla", "native", "pallas", "interpret", "mosaic", "mosaic_interpret")
NATIVE_OPS = ("attention_with_kvcache",)
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
MOSAIC_MIN_CC = 9  # Hopper (sm_90) and newer: TMA and wgmma


def resolve_impl(impl, *, mosaic_dtype=None, native: bool = False) -> str:
    """Checks ``impl`` and turns ``"auto"`` into ``"mosaic"`` on sm_90+ GPUs for 16-bit inputs of
    an op with Mosaic kernels (``mosaic_dtype`` given), ``"pallas"`` (Triton) on other GPUs,
    ``"xla"`` elsewhere (an op with a native CPU kernel, ``native=True``, then picks it per call).
    ``"native"`` is accepted only by such an op."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "native" and not native:
        raise ValueError(
            f'impl="native" (a CPU kernel of {", ".join(NATIVE_OPS)}) is not an implementation '
            'of this op; "auto" picks the fastest one it has'
        )
    if impl != "auto":
        return impl
    if jax.default_backend() != "gpu":
        return "xla"
    half = mosaic_dtype is not None and jnp.dtype(mosaic_dtype).itemsize == 2
    return "mosaic" if half and _compute_capability() >= MOSAIC_MIN_CC else "pallas"


def _compute_capability() -> int:
    """Major compute capability of the first GPU (0 when unknown)."""
    cc = getattr(jax.devices()[0], "compute_capability", "0")
    return int(str(cc).split(".")[0] or 0)


def check_array(name: str, x, *, ndim: int, dtypes=FLOAT_DTYPES):
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if len(shape) != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(shape)}")
    if dtypes is not None and not any(jnp.dtype(x.dtype) == jnp.dtype(d) for d in dtypes):
        names = ", ".join(jnp.dtype(d).name for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {jnp.dtype(x.dtype).name}")


def check_nonempty(name: str, x, letters: str):
    """Every dim of ``x`` >= 1; ``letters`` names the dims (``"BTHD"``) in the message."""
    for letter, n in zip(letters, x.shape, strict=True):
        if n == 0:
            raise ValueError(f"{name} must have {letter} >= 1, got shape {tuple(x.shape)}")


def check_qkv(q, k, v, *, letters: str):
    """q, k, v of rank ``len(letters)`` (``"BTHD"``, or ``"THD"`` packed), no empty dim, one float
    dtype, k and v of one shape, head dim equal and ``Hq % Hkv == 0``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x, ndim=len(letters))
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, x in (("q", q), ("k", k)):
        check_nonempty(name, x, letters.replace("T", "S") if name == "k" else letters)
    check_heads(q.shape, k.shape)


def check_int_array(name: str, x, shape: tuple[int, ...]):
    if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {getattr(x, 'dtype', type(x))}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def check_heads(q_shape, k_shape, *, q_name="q", k_name="k"):
    """Head dim equal, ``Hq % Hkv == 0``."""
    if q_shape[-1] != k_shape[-1]:
        raise ValueError(
            f"head dim of {q_name} ({q_shape[-1]}) must equal head dim of {k_name} ({k_shape[-1]})"
        )
    hq, hkv = q_shape[-2], k_shape[-2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"query heads ({q_name}: Hq={hq}) must be a multiple of KV heads ({k_name}: Hkv={hkv})"
        )


def check_window(window_size) -> tuple[int, int]:
    try:
        left, right = window_size
        ok = all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in (left, right))
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"window_size must be a pair of ints >= -1, got {window_size!r}")
    return int(left), int(right)


def _real_scalar(name: str, x, what: str) -> float:
    """A finite Python or NumPy real scalar (not bool) as a float, else ValueError."""
    ok = isinstance(x, numbers.Real) and not isinstance(x, bool | jax.Array)
    if not ok or not math.isfinite(float(x)):
        raise ValueError(f"{name} must be {what}, got {x!r}")
    return float(x)


def check_softcap(softcap) -> float:
    value = _real_scalar("softcap", softcap, "a finite float >= 0 (0 = off)")
    if value < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {softcap!r}")
    return value


def softmax_scale_or_default(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim**-0.5
    value = _real_scalar("softmax_scale", softmax_scale, "a finite float > 0")
    if value <= 0:
        raise ValueError(f"softmax_scale must be a finite float > 0, got {softmax_scale!r}")
    return value


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def first_order_only(impl: str, xs):
    """Identity on ``xs``, placed on what a ``custom_vjp`` backward reads: differentiating that
    backward (a second derivative, forward or reverse) raises a clear error instead of failing deep
    inside JAX (Pallas calls and loops with traced bounds have no derivative of their own)."""
    return xs


@first_order_only.defjvp
def _first_order_only_jvp(impl, primals, tangents):
    raise ValueError(
        f"second derivatives are not supported by impl={impl!r} (its backward is a custom kernel); "
        'use impl="reference" for higher-order derivatives'
    )
