"""Few-row products on CPU: ``x [M, K] @ W [K, N]`` for 1 <= M <= 64 with packed weights.

Decoding multiplies every weight matrix by a handful of rows per step (one per sequence; k + 1
per sequence when verifying a speculation), so a step streams all weights once and its speed is
the rate at which the product reads them. XLA:CPU's product reads [K, N] weights at 13-22 GB/s
for 4 <= M <= 16 on the 2-core development VM; the kernel in ``rows_matmul.cc`` reads weights
packed as panels [ceil(N / 32), K, 32] (one contiguous stream per 32 columns, every row's
accumulators in registers) at 32-50 GB/s: 1.6-2.4x at M = 4..8, 1.0-1.5x at M = 1 (K = 256..2048,
N = 256..4096; ``python -m benchmarks.generate`` measures it on the models).

It is an XLA FFI handler, compiled on first use with the system C++ compiler (``$CXX`` or
``c++``, ``-O3 -march=native``) into ``$PALLAS_ATTN_CACHE`` (default ``~/.cache/pallas_attn``),
keyed by the source, the flags, jaxlib's FFI headers and the CPU's features. Where it cannot be
built (no compiler) :func:`available` says so once with a warning and callers keep XLA's product;
``PALLAS_ATTN_ROWS_MATMUL=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
import warnings
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib

PANEL = 32  # columns per panel (kNB in rows_matmul.cc)
MAX_ROWS = 64
SOURCE = Path(__file__).with_name("rows_matmul.cc")
TARGET = "pallas_attn_rows_matmul"
FLAGS = ("-O3", "-march=native", "-std=gnu++17", "-fPIC", "-shared", "-w")


def cache_dir() -> Path:
    if d := os.environ.get("PALLAS_ATTN_CACHE"):
        return Path(d)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pallas_attn"


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build() -> Path:
    """Compiles ``rows_matmul.cc`` for this machine (once; cached) and returns the library."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler (set $CXX or install g++)")
    key = hashlib.sha256(
        "\0".join(
            [
                SOURCE.read_text(),
                cxx,
                *FLAGS,
                jaxlib.__version__,
                jax.ffi.include_dir(),
                _cpu_features(),
            ]
        ).encode()
    ).hexdigest()[:16]
    out = cache_dir() / f"rows_matmul-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    os.replace(tmp, out)  # atomic: concurrent builders (pytest workers) each land a whole file
    return out


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA's CPU backend (first call builds)."""
    if os.environ.get("PALLAS_ATTN_ROWS_MATMUL", "1") == "0":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        jax.ffi.register_ffi_target(
            TARGET, jax.ffi.pycapsule(lib.PallasAttnRowsMatmul), platform="cpu"
        )
    except Exception as e:  # noqa: BLE001 -- any failure means: use XLA's product
        warnings.warn(
            f"models.rows_matmul: CPU kernel unavailable, using XLA's product ({e})", stacklevel=2
        )
        return False
    return True


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
    if M > MAX_ROWS:
        raise ValueError(f"x has {M} rows; rows_matmul is for at most {MAX_ROWS}")
    y = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((M, n), jnp.float32))(
        x.reshape(M, K).astype(jnp.float32), panels
    )
    return y.reshape(*lead, n)
