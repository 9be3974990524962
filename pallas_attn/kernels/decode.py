"""Split-KV decode attention (Flash-Decoding) with PackGQA over contiguous and paged KV caches.

Algorithm (Dao et al., "Flash-Decoding for long-context inference", 2023): the visible key range
of a batch row is cut into ``num_splits`` contiguous chunks; one program handles one
``(batch row b, KV head h, block of packed query rows, split s)``. Within its chunk a program runs
FlashAttention-2's online softmax over key tiles of ``block_n`` keys, keeping per packed row a running
max ``m`` of the scaled scores, a running sum ``l`` of ``exp(s - m)`` and ``acc = sum exp(s - m) v``;
it writes the partial ``out_s = acc / l`` and ``lse_s = m + log(l)`` (``-inf`` where it saw no key).
The combine step merges the splits: ``lse = logsumexp_s(lse_s)``,
``out = sum_s exp(lse_s - lse) * out_s``.

PackGQA: the ``G = Hq // Hkv`` query heads that read KV head ``h`` and the ``Tq`` queries are packed
into the rows of one tile (row ``r = t * G + g``), so each K/V tile is loaded once per KV group and
the matmuls have ``G * Tq`` rows instead of ``Tq``. Rows and the head dim are padded to powers of two
>= 16 (Triton's ``dot``); the cache itself is never padded or copied.

Keys are read one row of ``D`` values per key through an index pair ``(idx0, idx1)`` into the cache:
``(cache_batch_idx[b], pos)`` for a contiguous cache ``[Bc, S, Hkv, D]``, ``(block_table[b, pos // P],
pos % P)`` for a paged one ``[num_blocks, P, Hkv, D]``. Block-table entries are looked up inside the
kernel, only for blocks below the row's length; indices are clamped before every load and loads
past the length are masked, so ``-1`` (or any) entries past a row's length are never read.

FP8 caches (``float8_e4m3fn``) are converted to q's dtype after the load; ``k_descale`` folds into the
softmax scale and ``v_descale`` multiplies the output.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_attn import heuristics, masks
from pallas_attn.kernels import flash_common


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Static parameters of one decode kernel launch (hashable: a jit static argument)."""

    softmax_scale: float
    window: tuple[int, int]
    softcap: float
    group: int  # G = Hq // Hkv
    block_m: int  # packed rows per program (power of two >= 16)
    block_n: int  # keys per tile (power of two >= 16)
    num_splits: int
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def make(cls, q_shape, Hkv, capacity, dtype, *, softmax_scale, window, softcap, num_splits):
        """Tiles for q [B, Tq, Hq, D] over ``capacity`` keys per row; ``num_splits`` 0 = heuristic."""
        B, Tq, Hq, D = q_shape
        G = Hq // Hkv
        block_m, block_n, num_warps, num_stages = heuristics.decode_blocks(G * Tq, D, dtype)
        programs = B * Hkv * pl.cdiv(G * Tq, block_m)
        return cls(
            softmax_scale=softmax_scale,
            window=window,
            softcap=softcap,
            group=G,
            block_m=block_m,
            block_n=block_n,
            num_splits=choose_splits(num_splits, programs, capacity, block_n),
            num_warps=num_warps,
            num_stages=num_stages,
        )


def next_pow2(x: int, floor: int = 16) -> int:
    """Smallest power of two >= max(x, floor) (Triton block dims; ``dot`` needs >= 16)."""
    return max(floor, 1 << max(0, (x - 1).bit_length()))


def num_sms() -> int:
    """Streaming multiprocessors of the first GPU, or the heuristics' default off GPU."""
    device = jax.devices()[0]
    return getattr(device, "core_count", None) or heuristics.DEFAULT_NUM_SMS


def choose_splits(num_splits: int, programs: int, capacity: int, block_n: int) -> int:
    """``num_splits`` as asked, or FlashAttention's heuristic for 0, capped by the key blocks."""
    n_blocks = pl.cdiv(capacity, block_n)
    if num_splits == 0:
        num_splits = heuristics.num_splits_heuristic(programs, num_sms(), n_blocks)
    return max(1, min(num_splits, n_blocks))


def _kernel(
    q_ref,  # [block_m, Dp]
    kv_len_ref,  # [B] keys [0, kv_len) exist
    kv_start_ref,  # [B] first valid key (leftpad)
    index_ref,  # contiguous: [B] cache row; paged: [B, max_blocks] block table
    descale_ref,  # [2, B, Hkv] float32 (k, v), FP8 caches only, else None
    k_ref,  # whole cache
    v_ref,
    o_ref,  # [block_m, Dp] float32 partial output of this split
    lse_ref,  # [block_m] float32
    *,
    cfg: DecodeConfig,
    Tq: int,
    D: int,
    paged: bool,
):
    b, h, mi, split = (pl.program_id(i) for i in range(4))
    block_m, block_n, G = cfg.block_m, cfg.block_n, cfg.group
    Dp = q_ref.shape[-1]
    kv_len, kv_start = kv_len_ref[b], kv_start_ref[b]
    q_offset = kv_len - Tq  # query t sits at key position q_offset + t

    rows = mi * block_m + jnp.arange(block_m, dtype=jnp.int32)
    q_pos = q_offset + jnp.minimum(rows // G, Tq - 1)
    first_t = (mi * block_m) // G
    last_t = jnp.minimum((mi * block_m + block_m - 1) // G, Tq - 1)
    lo, hi = masks.key_range(
        q_offset + first_t, q_offset + last_t, window=cfg.window, kv_start=kv_start, kv_len=kv_len
    )
    j_lo = jnp.maximum(lo, 0) // block_n
    j_hi = jnp.where(hi > lo, pl.cdiv(hi, block_n), j_lo)
    per_split = pl.cdiv(j_hi - j_lo, cfg.num_splits)
    j_start = j_lo + split * per_split
    j_end = jnp.minimum(j_start + per_split, j_hi)

    scale = cfg.softmax_scale
    if descale_ref is not None:
        scale = scale * descale_ref[0, b, h]
    q = q_ref[...]
    # Head-dim lanes: a plain arange when D is a power of two, so Triton sees contiguous
    # addresses along D and vectorises the loads; else padded lanes are clamped and masked.
    d = jnp.arange(Dp, dtype=jnp.int32)[None, :]
    d_idx = d if D == Dp else jnp.minimum(d, D - 1)

    def key_index(pos):
        """(idx0, idx1) [block_n] into the cache for key positions ``pos``, clamped in bounds.

        Paged: only block-table entries of blocks below the row's length are looked up.
        """
        if paged:
            P, max_blocks = k_ref.shape[1], index_ref.shape[1]
            last_block = jnp.clip((kv_len - 1) // P, 0, max_blocks - 1)
            page = index_ref[b, jnp.clip(pos // P, 0, last_block)]
            return jnp.clip(page, 0, k_ref.shape[0] - 1), pos % P
        row = jnp.full((block_n,), index_ref[b], jnp.int32)
        return row, jnp.clip(pos, 0, k_ref.shape[1] - 1)

    def load(ref, at, ok):
        """Masked gather; lanes past the length or D are zeroed (no NaN from unwritten slots)."""
        x = plgpu.load(ref.at[at], mask=ok)
        return jnp.where(ok, x.astype(q.dtype), 0)

    def body(j, carry):
        m, l, acc = carry
        pos = j * block_n + jnp.arange(block_n, dtype=jnp.int32)
        idx0, idx1 = key_index(pos)
        load_ok = (pos < kv_len)[:, None]
        if D != Dp:
            load_ok = load_ok & (d < D)
        load_ok = jnp.broadcast_to(load_ok, (block_n, Dp))
        at = (idx0[:, None], idx1[:, None], h, d_idx)
        k, v = load(k_ref, at, load_ok), load(v_ref, at, load_ok)
        s = flash_common.dot_nt(q, k) * scale  # [block_m, block_n] float32
        if cfg.softcap > 0:
            s = cfg.softcap * jnp.tanh(s / cfg.softcap)
        visible = masks.visible(
            q_pos[:, None], pos[None, :], window=cfg.window, kv_start=kv_start, kv_len=kv_len
        )
        s = jnp.where(visible, s, masks.MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = acc * alpha[:, None] + flash_common.dot_nn(p.astype(v.dtype), v)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    init = (
        jnp.full((block_m,), masks.MASK_VALUE, jnp.float32),
        jnp.zeros((block_m,), jnp.float32),
        jnp.zeros((block_m, Dp), jnp.float32),
    )
    m, l, acc = lax.fori_loop(j_start, j_end, body, init)
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)[:, None]
    if descale_ref is not None:
        out = out * descale_ref[1, b, h]
    o_ref[...] = out
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def combine(out_s, lse_s):
    """Merges split partials. out_s [..., n, M, Dp], lse_s [..., n, M] -> ([..., M, Dp], [..., M])."""
    if out_s.shape[-3] == 1:
        return out_s[..., 0, :, :], lse_s[..., 0, :]
    m = jnp.max(lse_s, axis=-2, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse_s - m_safe)  # 0 for splits that saw nothing
    total = jnp.sum(w, axis=-2)
    out = jnp.sum(w[..., None] * out_s, axis=-3) / jnp.where(total > 0, total, 1.0)[..., None]
    lse = jnp.where(
        total > 0, m_safe[..., 0, :] + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf
    )
    return out, lse


def pack_queries(q, Hkv: int, block_m: int, Dp: int):
    """q [B, Tq, Hq, D] -> [B, Hkv, Mp, Dp], packed row ``t * G + g``, zero padded."""
    B, Tq, Hq, D = q.shape
    G = Hq // Hkv
    packed = q.reshape(B, Tq, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, Tq * G, D)
    Mp = pl.cdiv(Tq * G, block_m) * block_m
    return jnp.pad(packed, ((0, 0), (0, 0), (0, Mp - Tq * G), (0, Dp - D)))


def unpack(out, lse, Tq: int, G: int, D: int):
    """[B, Hkv, Mp, Dp], [B, Hkv, Mp] -> out [B, Tq, Hq, D], lse [B, Hq, Tq]."""
    B, Hkv = out.shape[:2]
    out = out[:, :, : Tq * G, :D].reshape(B, Hkv, Tq, G, D).transpose(0, 2, 1, 3, 4)
    lse = lse[:, :, : Tq * G].reshape(B, Hkv, Tq, G).transpose(0, 1, 3, 2)
    return out.reshape(B, Tq, Hkv * G, D), lse.reshape(B, Hkv * G, Tq)


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def decode(q, k_cache, v_cache, kv_len, kv_start, index, descale, *, cfg: DecodeConfig, interpret):
    """Split-KV attention of q over a cache whose rows already hold every key.

    Args:
      q: [B, Tq, Hq, D] (rotary already applied).
      k_cache, v_cache: contiguous [Bc, S, Hkv, D] (``index`` = [B] cache rows) or paged
        [num_blocks, P, Hkv, D] (``index`` = [B, max_blocks] block table); q's dtype or FP8.
      kv_len, kv_start: [B] int32, keys ``[kv_start, kv_len)`` are valid; query ``t`` sits at
        position ``kv_len - Tq + t``.
      descale: [2, B, Hkv] float32 (k, v) for FP8 caches, else None.

    Returns:
      out [B, Tq, Hq, D] in q's dtype, lse [B, Hq, Tq] float32.
    """
    B, Tq, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    Dp = next_pow2(D)
    packed = pack_queries(q, Hkv, cfg.block_m, Dp)
    Mp = packed.shape[2]
    grid = (B, Hkv, Mp // cfg.block_m, cfg.num_splits)
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    kernel = functools.partial(_kernel, cfg=cfg, Tq=Tq, D=D, paged=index.ndim == 2)
    n = cfg.num_splits
    out_s, lse_s = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, None, cfg.block_m, Dp), lambda b, h, i, s: (b, h, i, 0)),
            whole(kv_len),
            whole(kv_start),
            whole(index),
            None if descale is None else whole(descale),
            whole(k_cache),
            whole(v_cache),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, cfg.block_m, Dp), lambda b, h, i, s: (b, h, s, i, 0)),
            pl.BlockSpec((None, None, None, cfg.block_m), lambda b, h, i, s: (b, h, s, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Hkv, n, Mp, Dp), jnp.float32),
            jax.ShapeDtypeStruct((B, Hkv, n, Mp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        name="kvcache_decode",
    )(packed, kv_len, kv_start, index, descale, k_cache, v_cache)
    out, lse = combine(out_s, lse_s)
    out, lse = unpack(out, lse, Tq, cfg.group, D)
    return out.astype(q.dtype), lse
