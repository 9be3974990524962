"""Input checks shared by the public entry points. Each raises naming the argument and its value."""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("auto", "reference", "xla", "pallas", "interpret")
FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def resolve_impl(impl) -> str:
    """Checks ``impl`` and turns ``"auto"`` into ``"pallas"`` on GPU, ``"xla"`` elsewhere."""
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


def check_array(name: str, x, *, ndim: int, dtypes=FLOAT_DTYPES):
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if len(shape) != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(shape)}")
    if dtypes is not None and not any(jnp.dtype(x.dtype) == jnp.dtype(d) for d in dtypes):
        names = ", ".join(jnp.dtype(d).name for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {jnp.dtype(x.dtype).name}")


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


def check_softcap(softcap) -> float:
    if not isinstance(softcap, int | float) or softcap < 0:
        raise ValueError(f"softcap must be a float >= 0, got {softcap!r}")
    return float(softcap)


def softmax_scale_or_default(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim**-0.5
    if not isinstance(softmax_scale, int | float) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale must be a positive float, got {softmax_scale!r}")
    return float(softmax_scale)
