"""What the Mosaic GPU kernels share: the static config, SMEM tiles, wgmma helpers, the interpreter.

The kernels are ``plgpu.kernel`` bodies (grid axes by name, ``lax.axis_index``), written to what
both the sm_90a compiler and JAX's GPU interpreter accept, so one kernel body is what CI tests
(``impl="mosaic_interpret"``) and what an H100/H200 runs (``impl="mosaic"``).

What the GPU interpreter of JAX 0.10.2 (``jax._src.pallas.mosaic_gpu.interpret``) supports, found
by running kernels under it (each a rule of how the kernels here are written):

* Grid: ``plgpu.kernel`` with named grid axes read by ``lax.axis_index``. ``pl.program_id``
  always returns 0, BlockSpecs must be trivial (whole arrays in GMEM), no scalar prefetch and no
  dynamic grid bounds: every tile is moved by hand with TMA (``copy_gmem_to_smem`` + barrier).
* Memory ops: ``ref[...]`` reads and writes (state ``get``/``swap``), ``copy_gmem_to_smem``,
  ``copy_smem_to_gmem``, ``barrier_arrive``/``barrier_wait``, ``wgmma`` into an accumulator and
  reading it back. ``plgpu.load`` and Pallas ``load``/``store`` (masked) have no rule.
* ``plgpu.ACC`` must be allocated in its own ``pl.run_scoped`` (one holding only accumulators,
  not collective); SMEM and barriers go in another. ``pl.run_state`` (``plgpu.ACC.init``) has no
  rule, so an accumulator never carries across loop iterations: each wgmma group runs into a
  fresh zeroed accumulator and the result is added in registers (:func:`matmul`; compiled,
  :func:`matmul_acc` accumulates in place instead).
* ``wgmma`` operands must be refs (a register LHS is rejected: P goes through SMEM) whose
  transforms are only slices: ``plgpu.transpose_ref`` is rejected, so under the interpreter a
  transposed operand is copied into a transposed SMEM scratch first (:func:`matmul`); compiled,
  the transpose is a free descriptor flag. Tiling and swizzle transforms on SMEM allocations are
  undone by the interpreter (it allocates the logical shape).
* ``plgpu.layout_cast`` has no CPU rule: layouts are cast only when compiling (:func:`cast`).
* ``wgmma`` runs synchronously and ``commit_smem``/``wgmma_wait``/``wait_smem_to_gmem`` are
  no-ops, so the interpreter checks barriers and TMA ordering but not wgmma asynchrony.
* With several warpgroups (``num_threads``, ``thread_name``) every SMEM or barrier allocation
  must be collective over the thread axis (``pl.run_scoped(..., collective_axes=...)``, shared
  by all), so interpreter-only scratch (the transposed operands above) is allocated up front.
* When a barrier is freed, every thread that observed one of its phases must have observed all
  of them: a producer that waits on "slot free" barriers also waits for the last releases.
* Its race detector (``InterpretGPUParams(detect_races=True)``) works on these kernels and
  reports, e.g., a consumer reading a ring slot without waiting on its barrier.
* After an exception inside an interpreted kernel, JAX's interpreter state must be reset
  (``reset_gpu_interpret_mode_state``) before the next interpreted kernel in the same process;
  the checks that raise (:mod:`pallas_attn.mosaic`) therefore run before any kernel is traced.

What the sm_90a compiler adds (``make gpu-compile``): the operands of one wgmma share one swizzle
(:func:`smem`), a TMA copy moves a multiple of 128 bytes (small int32 rows are padded to 32), and
an accumulator carried in registers next to a fresh one spills at D = 128 (:func:`matmul_acc`).

Scores are base 2 inside the kernels, as in :mod:`pallas_attn.softmax`.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import masks

try:  # JAX >= 0.11 exposes the GPU interpreter publicly
    from jax.experimental.pallas.mosaic_gpu import InterpretGPUParams
except ImportError:  # JAX 0.10.x: the same class under jax._src
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

# wgmma's operand types (Hopper): 16-bit floats here; float32 inputs go to the Triton kernels.
DTYPES = (jnp.bfloat16, jnp.float16)
# Rows of one warpgroup's wgmma tile: every row block is a multiple of it.
WGMMA_ROWS = 64
# The head dim is padded to a multiple of this (one 128-byte swizzled row of 16-bit values).
HEAD_DIM_MULTIPLE = 64
MAX_HEAD_DIM = 128  # D = 256: the float32 accumulators spill on sm_90a (make gpu-compile)
# Per-row int32 metadata ``[q_offset, kv_start, kv_len, 0, ...]`` (varlen; the decode kernel's
# ``[kv_start, kv_len, cache row, ...]``) and block-table rows are padded to 32 int32s: Mosaic's
# TMA copies move multiples of 128 bytes (one per thread of the warpgroup).
META_WIDTH = 32


class Mode(Protocol):
    """What the helpers here read of a kernel's static config: compiled or interpreted."""

    interpret: bool


@dataclasses.dataclass(frozen=True)
class Config:
    """Static (hashable) parameters of the Mosaic flash kernels; jit caches by it.

    ``T`` and ``S`` are the true lengths (the arrays are padded to the tiles): query row ``i``
    sits at key position ``S - T + i`` and keys ``>= S`` are padding. ``segments``: segment-id
    refs are passed (the block-range helpers of :mod:`pallas_attn.kernels.flash_common` read it
    too: no tile is then known to be fully visible).
    """

    softmax_scale: float
    window: tuple[int, int]
    softcap: float
    T: int
    S: int
    block_q: int
    block_k: int
    block_q_bwd: int
    block_k_bwd: int
    interpret: bool
    segments: bool = False
    varlen: bool = False

    @property
    def q_offset(self) -> int:
        return self.S - self.T


def row_ranges(cfg: Config, meta_s):
    """``(q_offset, kv_start, kv_len)`` of the CTA's batch row: query row ``i`` sits at key
    position ``q_offset + i``, keys outside ``[kv_start, kv_len)`` are hidden. With ``cfg.varlen``
    they are read from the row's metadata in SMEM (``meta_s`` [META_WIDTH] int32), else static:
    ``(S - T, None, S)`` (``None``: no lower bound to mask)."""
    if cfg.varlen:
        return meta_s[0], meta_s[1], meta_s[2]
    return cfg.q_offset, None, cfg.S


def block_start(kv_start):
    """``kv_start`` for the block-range helpers, which take a number (0 when it is static)."""
    return 0 if kv_start is None else kv_start


def zero_unowned(cfg: Mode, first, kv_start, kv_len, src, dst=None):
    """Copies the key tile ``src`` [N, D] (keys ``first + [0, N)``) to ``dst`` (default: in
    place) with the rows outside ``[kv_start, kv_len)`` zeroed: memory a row does not own may
    hold NaN (:func:`pallas_attn.masks.key_owned`), and a masked probability of 0 times NaN is
    NaN."""
    k_rows = first + iota(cfg, src.shape, 0)
    owned = masks.key_owned(k_rows, kv_start, kv_len)
    store_tile(src if dst is None else dst, jnp.where(owned, load_tile(cfg, src), 0))


def with_optional(refs, fixed: int, present: tuple[bool, ...]):
    """Kernel refs with ``None`` for the optional inputs that were not passed: ``refs`` holds
    ``fixed`` inputs, then the optional ones passed (``present`` says which), then the rest."""
    rest = iter(refs[fixed:])
    return (*refs[:fixed], *(next(rest) if p else None for p in present), *rest)


def interpret_params(cfg: Mode):
    """The ``interpret`` argument of ``plgpu.kernel``: the GPU interpreter, or None (compile)."""
    return InterpretGPUParams() if cfg.interpret else None


def smem(shape: tuple[int, ...], dtype, minor: int | None = None) -> plgpu.SMEM:
    """An SMEM tile laid out for TMA and wgmma: 8-row tiles of one swizzle width, the widest a row
    of ``minor`` values (default: the tile's last dim) takes: 128 bytes for >= 64 16-bit values.
    The operands of one wgmma must share a swizzle: a kernel with a narrow tile passes its width
    as ``minor`` for all of them."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(min(shape[-1], minor or shape[-1]) * itemsize * 8)
    tiling = plgpu.TilingTransform((8, swizzle // itemsize))
    return plgpu.SMEM(shape, dtype, transforms=(tiling, plgpu.SwizzleTransform(swizzle)))


def cast(cfg: Mode, x, layout):
    """``plgpu.layout_cast`` when compiling; identity under the interpreter (no CPU rule)."""
    return x if cfg.interpret else plgpu.layout_cast(x, layout)


def rows(cfg: Mode, x):
    """A per-row statistic ([M]) in the layout of a wgmma accumulator's row reduction."""
    return cast(cfg, x, plgpu.Layout.WGMMA.reduce(1))


def tile(cfg: Mode, x):
    """An [M, N] value in the wgmma accumulator layout."""
    return cast(cfg, x, plgpu.Layout.WGMMA)


def iota(cfg: Mode, shape: tuple[int, int], dim: int):
    """``broadcasted_iota`` in the wgmma accumulator layout (a row or column index per element)."""
    return tile(cfg, jax.lax.broadcasted_iota(jnp.int32, shape, dim))


def load_vector(cfg: Mode, ref, dim: int):
    """An SMEM vector [N] as the row (``dim=1``) or column (``dim=0``) statistic of an [M, N] or
    [N, M] accumulator tile (``plgpu.load`` with that layout; a plain read when interpreted)."""
    if cfg.interpret:
        return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA.reduce(dim))


def load_tile(cfg: Mode, ref):
    """An [M, N] SMEM tile into registers in the wgmma accumulator layout."""
    if cfg.interpret:
        return ref[...]
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)


def matmul(cfg: Mode, a, b, *, transpose_b: bool = False, scratch=None):
    """``a @ b`` (or ``a @ b.T``) of SMEM refs by wgmma, float32 [M, N] in registers.

    ``a``: [M, K]; ``b``: [K, N], or [N, K] with ``transpose_b``. Compiled, the transpose is the
    wgmma descriptor's; interpreted, ``b`` is first copied transposed into ``scratch`` [K, N]
    (warp-specialised kernels pass one: there every SMEM allocation must be shared by all
    warpgroups), else into a tile allocated here.
    """
    M = a.shape[0]
    N = b.shape[0] if transpose_b else b.shape[1]

    def run(acc):
        if not transpose_b:
            plgpu.wgmma(acc, a, b)
        elif not cfg.interpret:
            plgpu.wgmma(acc, a, plgpu.transpose_ref(b, (1, 0)))
        else:

            def transposed(bt):
                bt[...] = b[...].T
                plgpu.wgmma(acc, a, bt)

            if scratch is None:
                pl.run_scoped(transposed, plgpu.SMEM(b.shape[::-1], b.dtype))
            else:
                transposed(scratch)
        return acc[...]

    return pl.run_scoped(run, plgpu.ACC((M, N), jnp.float32))


def matmul_acc(cfg: Mode, acc, a, b):
    """``acc + a @ b`` (SMEM refs ``a`` [M, K], ``b`` [K, N]; ``acc`` float32 [M, N] registers).

    Compiled, wgmma accumulates into ``acc`` in place (``pl.run_state``): no second [M, N]
    accumulator is live, which is what keeps the dK/dV kernel's two accumulators from spilling at
    D = 128. The interpreter has no ``run_state`` rule: there it is ``acc + matmul(a, b)``, the
    same sum.
    """
    if cfg.interpret:
        return acc + matmul(cfg, a, b)
    return pl.run_state(lambda ref: plgpu.wgmma(ref, a, b))(plgpu.ACC.init(acc))


def store_tile(ref, x):
    """Writes registers to an SMEM tile and fences them for the async proxy (TMA, wgmma)."""
    ref[...] = x.astype(ref.dtype)
    plgpu.commit_smem()


def bcast(x, shape: tuple[int, ...], dim: int):
    """Broadcasts a vector along the other axis of a 2-D ``shape`` (``dim``: the axis it keeps)."""
    return jax.lax.broadcast_in_dim(x, shape, (dim,))
