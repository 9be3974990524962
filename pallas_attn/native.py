"""Native CPU kernels for decoding, as XLA FFI handlers (``pallas_attn/native/*.cc``).

XLA:CPU runs a decode step as hundreds of small ops, each a few microseconds, and its products
of a few rows read weights at about half the memory's rate. Two kernels take that work where it
dominates: ``kv_attention.cc`` (attention of a few queries over a KV cache, one pass, in place;
``impl="native"`` of :func:`pallas_attn.attention_with_kvcache` on CPU, see
:mod:`pallas_attn.cpu`) and ``rows_matmul.cc`` (few-row products over packed float or
block-quantized weights, see :mod:`models.rows_matmul` and :mod:`models.quant`); a third,
``decode_layer.cc``, runs a whole Llama decoder layer of a decode step on them as one call
(:mod:`models.fused_decode`).

They are compiled on first use with the system C++ compiler (``$CXX`` or ``c++``, ``-O3
-march=native``; ``$PALLAS_ATTN_MARCH`` names another target, see :func:`flags`) into one library under ``$PALLAS_ATTN_CACHE`` (default
``~/.cache/pallas_attn``), keyed by the sources, the flags, jaxlib's FFI headers and the CPU's
features, and registered with XLA's CPU backend. Where that fails (no compiler)
:func:`available` warns once and returns False, and callers keep their XLA paths;
``PALLAS_ATTN_NATIVE=0`` turns the kernels off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

SOURCES = Path(__file__).with_name("native")
FLAGS = ("-O3", "-std=gnu++17", "-fPIC", "-shared", "-w")
ROWS_MATMUL = "pallas_attn_rows_matmul"  # FFI target names (jax.ffi.ffi_call)
ROWS_MATMUL_Q = "pallas_attn_rows_matmul_q"
KV_ATTENTION = "pallas_attn_kv_attention"
DECODE_LAYER = "pallas_attn_decode_layer"
CACHE_WRITE = "pallas_attn_cache_write"
TARGETS = {  # target -> symbol
    ROWS_MATMUL: "PallasAttnRowsMatmul",
    ROWS_MATMUL_Q: "PallasAttnRowsMatmulQ",
    KV_ATTENTION: "PallasAttnKVAttention",
    DECODE_LAYER: "PallasAttnDecodeLayer",
    CACHE_WRITE: "PallasAttnCacheWrite",
}


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


def flags() -> tuple[str, ...]:
    """The compiler flags: ``-march=$PALLAS_ATTN_MARCH`` (default ``native``: this CPU's
    instructions). ``PALLAS_ATTN_MARCH=haswell`` builds the AVX2 + FMA kernels an AVX-512 host
    never runs otherwise (the tests do, to check them; a benchmark to time them)."""
    march = os.environ.get("PALLAS_ATTN_MARCH") or "native"
    return (*FLAGS, f"-march={march}")


def build() -> Path:
    """Compiles the kernels for this machine (once; cached) and returns the library's path."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler (set $CXX or install g++)")
    files = sorted(SOURCES.glob("*.cc")) + sorted(SOURCES.glob("*.h"))
    parts = [f.name + "\0" + f.read_text() for f in files]
    parts += [cxx, *flags(), jaxlib.__version__, jax.ffi.include_dir(), _cpu_features()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    out = cache_dir() / f"pallas_attn_native-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [cxx, *flags(), f"-I{jax.ffi.include_dir()}", f"-I{SOURCES}"]
    cmd += [str(f) for f in files if f.suffix == ".cc"] + ["-o", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-2000:]}")
    os.replace(tmp, out)  # atomic: concurrent builders (pytest workers) each land a whole file
    return out


@functools.cache
def available() -> bool:
    """Whether the kernels are built and registered with XLA's CPU backend (the first call
    builds them: a few seconds, once per machine)."""
    if os.environ.get("PALLAS_ATTN_NATIVE", "1") == "0":
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(str(build()))
        for target, symbol in TARGETS.items():
            capsule = jax.ffi.pycapsule(getattr(lib, symbol))
            jax.ffi.register_ffi_target(target, capsule, platform="cpu")
    except Exception as e:  # noqa: BLE001 -- any failure means: keep the XLA paths
        warnings.warn(f"pallas_attn.native: CPU kernels unavailable, using XLA ({e})", stacklevel=2)
        return False
    return True


def widened_on_cpu(dtype) -> bool:
    """A 16-bit float (bfloat16, float16): XLA:CPU computes a gather from or a scatter into an
    array of it in float32, widening and narrowing the whole array, which the native cache write
    and the embedding's bit gather avoid."""
    dtype = np.dtype(dtype)  # bfloat16 too: ml_dtypes registers it with numpy
    return dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)


# What PallasAttnBuiltFeatures (rows_matmul.cc) reports, bit i for entry i, in /proc/cpuinfo's
# names.
BUILT_FEATURES = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "amx_bf16",
)


@functools.cache
def features() -> frozenset[str]:
    """The instruction sets the kernels run with: built for (``-march``, see :func:`flags`) and
    present on this CPU (the kernels check the CPU as well). Empty where they are unavailable."""
    if not available():
        return frozenset()
    bits = ctypes.cdll.LoadLibrary(str(build())).PallasAttnBuiltFeatures()
    cpu = set(_cpu_features().partition(":")[2].split())
    return frozenset(f for i, f in enumerate(BUILT_FEATURES) if bits >> i & 1 and f in cpu)


def on_cpu(native_fn, default_fn, *args):
    """``native_fn(*args)`` in programs that run on CPU, ``default_fn(*args)`` in programs lowered
    for another platform (a GPU program compiled from this CPU without a GPU: the native FFI
    targets exist for CPU only). Both are traced; only the platform's branch is lowered."""
    return jax.lax.platform_dependent(*args, cpu=native_fn, default=default_fn)
