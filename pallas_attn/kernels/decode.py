"""Split-KV decode attention (Flash-Decoding) with PackGQA over contiguous and paged KV caches.

Algorithm (Dao et al., "Flash-Decoding for long-context inference", 2023): the visible key range
of a batch row is cut into ``num_splits`` contiguous chunks; one program handles one
``(batch row b, KV head h, block of packed query rows, split s)``. Within its chunk a program runs
FlashAttention-2's online softmax (:mod:`pallas_attn.softmax`: base-2 running max ``m``, sum ``l``,
accumulator ``acc``) over key tiles of ``block_n`` keys, and writes the partial ``out_s = acc / l``
and natural-log ``lse_s`` (``-inf`` where it saw no key).
The combine step merges the splits: ``lse = logsumexp_s(lse_s)``,
``out = sum_s exp(lse_s - lse) * out_s``.

PackGQA: the ``G = Hq // Hkv`` query heads that read KV head ``h`` and the ``Tq`` queries are packed
into the rows of one tile (row ``r = t * G + g``), so each K/V tile is loaded once per KV group and
the matmuls have ``G * Tq`` rows instead of ``Tq``. Rows and the head dim are padded to powers of two
>= 16 (Triton's ``dot``); the cache itself is never padded or copied.

Keys are read one row of ``D`` values per key through :func:`pallas_attn.cache.locate`:
``(cache_batch_idx[b], pos)`` for a contiguous cache ``[Bc, S, Hkv, D]``, ``(block_table[b, pos // P],
pos % P)`` for a paged one ``[num_blocks, P, Hkv, D]``. Block-table entries are looked up inside the
kernel, only for blocks below the row's length; indices are clamped before every load and loads
outside ``[kv_start, kv_len)`` are masked to 0, so ``-1`` (or any) entries past a row's length, and
NaN in slots a row does not own, are never read.

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

from pallas_attn import cache, heuristics, masks, shapes, softmax
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
            num_splits=heuristics.choose_splits(num_splits, programs, capacity, block_n),
            num_warps=num_warps,
            num_stages=num_stages,
        )


def _split_keys(cfg: DecodeConfig, Tq: int, mi, split, kv_start, kv_len):
    """Positions [block_m] of the packed rows of block ``mi`` and the key tiles ``[j_start, j_end)``
    of split ``split`` (:func:`split_tiles`)."""
    rows = mi * cfg.block_m + jnp.arange(cfg.block_m, dtype=jnp.int32)
    q_pos = kv_len - Tq + jnp.minimum(rows // cfg.group, Tq - 1)
    return q_pos, *split_tiles(cfg, Tq, mi, split, kv_start, kv_len)


def split_tiles(cfg: DecodeConfig, Tq: int, mi, split, kv_start, kv_len):
    """Key tiles ``[j_start, j_end)`` of split ``split`` for the packed rows of block ``mi``: the
    visible key range of those rows cut into ``num_splits`` chunks."""
    block_m, G = cfg.block_m, cfg.group
    q_offset = kv_len - Tq  # query t sits at key position q_offset + t
    first_t = (mi * block_m) // G
    last_t = jnp.minimum((mi * block_m + block_m - 1) // G, Tq - 1)
    lo, hi = masks.key_range(
        q_offset + first_t, q_offset + last_t, window=cfg.window, kv_start=kv_start, kv_len=kv_len
    )
    j_lo = jnp.maximum(lo, 0) // cfg.block_n
    j_hi = jnp.where(hi > lo, pl.cdiv(hi, cfg.block_n), j_lo)
    per_split = pl.cdiv(j_hi - j_lo, cfg.num_splits)
    j_start = j_lo + split * per_split
    return j_start, jnp.minimum(j_start + per_split, j_hi)


def _load_keys(k_ref, v_ref, index_ref, b, h, pos, kv_start, kv_len, Dp: int, dtype, paged: bool):
    """K and V rows [block_n, Dp] (zero lanes past D) of key positions ``pos`` [block_n], in ``dtype``.

    Slots come from :func:`pallas_attn.cache.locate`; paged, only block-table entries of blocks
    below the row's length are looked up. Keys outside ``[kv_start, kv_len)`` (memory the row
    does not own) and lanes past D are not read and come back 0, so NaN there never reaches a dot.
    """
    D = k_ref.shape[-1]
    if paged:
        max_blocks = index_ref.shape[1]
        last_block = jnp.clip((kv_len - 1) // k_ref.shape[1], 0, max_blocks - 1)
        page_of = lambda blk: index_ref[b, jnp.minimum(blk, last_block)]  # noqa: E731
        idx0, idx1, _ = cache.locate(pos, k_ref.shape, page_of=page_of, max_blocks=max_blocks)
    else:
        idx0, idx1, _ = cache.locate(pos, k_ref.shape, row=index_ref[b])
    # Head-dim lanes: a plain arange when D is a power of two, so Triton sees contiguous
    # addresses along D and vectorises the loads; else padded lanes are clamped and masked.
    d = jnp.arange(Dp, dtype=jnp.int32)[None, :]
    ok = masks.key_owned(pos, kv_start, kv_len)[:, None]
    if D != Dp:
        ok = ok & (d < D)
        d = jnp.minimum(d, D - 1)
    ok = jnp.broadcast_to(ok, (pos.shape[0], Dp))
    at = (idx0[:, None], idx1[:, None], h, d)
    return tuple(
        jnp.where(ok, plgpu.load(ref.at[at], mask=ok).astype(dtype), 0) for ref in (k_ref, v_ref)
    )


def _kernel(
    q_ref,  # [block_m, Dp] packed query rows (row r = t * G + g)
    kv_len_ref,  # [B] keys [0, kv_len) exist
    kv_start_ref,  # [B] first valid key (leftpad)
    index_ref,  # contiguous: [B] cache row; paged: [B, max_blocks] block table
    descale_ref,  # [2, B, Hkv] float32 (k, v), FP8 caches only, else None
    tree_ref,  # [block_m, Tqp] int32 tree-mask row of each packed row, or None
    k_ref,  # [Bc, S, Hkv, D] or [num_pages, P, Hkv, D]: the whole cache
    v_ref,  # same as k_ref
    o_ref,  # [block_m, Dp] float32 partial output of this split
    lse_ref,  # [block_m] float32
    *,
    cfg: DecodeConfig,
    Tq: int,
    paged: bool,
):
    b, h, mi, split = (pl.program_id(i) for i in range(4))
    kv_len, kv_start = kv_len_ref[b], kv_start_ref[b]
    q_pos, j_start, j_end = _split_keys(cfg, Tq, mi, split, kv_start, kv_len)
    scale = cfg.softmax_scale
    if descale_ref is not None:
        scale = scale * descale_ref[0, b, h]  # k_descale folds into the softmax scale
    q = q_ref[...]
    Dp = q.shape[-1]

    def body(j, carry):
        pos = j * cfg.block_n + jnp.arange(cfg.block_n, dtype=jnp.int32)
        k, v = _load_keys(k_ref, v_ref, index_ref, b, h, pos, kv_start, kv_len, Dp, q.dtype, paged)
        s2, _ = softmax.scale_scores(flash_common.dot_nt(q, k), scale, cfg.softcap)
        mask = masks.visible(
            q_pos[:, None],
            pos[None, :],
            window=cfg.window,
            kv_start=kv_start,
            kv_len=kv_len,
            tree_rows=None if tree_ref is None else tree_ref[...],
            tree_start=kv_len - Tq,
        )
        return softmax.step(carry, s2, v, flash_common.pv, mask)

    init = softmax.init((cfg.block_m,), q.shape[-1])
    out, lse = softmax.finalize(*lax.fori_loop(j_start, j_end, body, init))
    if descale_ref is not None:
        out = out * descale_ref[1, b, h]
    o_ref[...] = out
    lse_ref[...] = lse


def combine(out_s, lse_s):
    """Merges split partials. out_s [..., n, M, Dp], lse_s [..., n, M] -> ([..., M, Dp], [..., M])."""
    if out_s.shape[-3] == 1:
        return out_s[..., 0, :, :], lse_s[..., 0, :]
    return softmax.combine(out_s, lse_s, axis=-2)


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


def pack_tree(tree, G: int, Mp: int):
    """tree [B, Tq, Tq] bool -> [B, Mp, Tqp] int32: packed row ``t * G + g`` gets tree row ``t``
    (padding rows repeat the last), columns zero padded to a power of two."""
    B, Tq, _ = tree.shape
    t = jnp.minimum(jnp.arange(Mp) // G, Tq - 1)
    Tqp = shapes.next_pow2(Tq, floor=16)
    return jnp.pad(tree[:, t].astype(jnp.int32), ((0, 0), (0, 0), (0, Tqp - Tq)))


@functools.partial(jax.jit, static_argnames=("cfg", "interpret"))
def decode(
    q,
    k_cache,
    v_cache,
    kv_len,
    kv_start,
    index,
    descale,
    tree=None,
    *,
    cfg: DecodeConfig,
    interpret,
):
    """Split-KV attention of q over a cache whose rows already hold every key.

    Args:
      q: [B, Tq, Hq, D] (rotary already applied).
      k_cache, v_cache: contiguous [Bc, S, Hkv, D] (``index`` = [B] cache rows) or paged
        [num_blocks, P, Hkv, D] (``index`` = [B, max_blocks] block table); q's dtype or FP8.
      kv_len, kv_start: [B] int32, keys ``[kv_start, kv_len)`` are valid; query ``t`` sits at
        position ``kv_len - Tq + t``.
      descale: [2, B, Hkv] float32 (k, v) for FP8 caches, else None.
      tree: [B, Tq, Tq] bool tree mask among the last Tq keys (``masks.tree_visible``), or None.

    Returns:
      out [B, Tq, Hq, D] in q's dtype, lse [B, Hq, Tq] float32.
    """
    B, Tq, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    Dp = shapes.next_pow2(D, floor=16)
    packed = pack_queries(q, Hkv, cfg.block_m, Dp)
    Mp = packed.shape[2]
    grid = (B, Hkv, Mp // cfg.block_m, cfg.num_splits)
    whole = lambda x: pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)  # noqa: E731
    kernel = functools.partial(_kernel, cfg=cfg, Tq=Tq, paged=index.ndim == 2)
    tree_spec = None
    if tree is not None:
        tree = pack_tree(tree, cfg.group, Mp)
        tree_spec = pl.BlockSpec((None, cfg.block_m, tree.shape[2]), lambda b, h, i, s: (b, i, 0))
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
            tree_spec,
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
    )(packed, kv_len, kv_start, index, descale, tree, k_cache, v_cache)
    out, lse = combine(out_s, lse_s)
    out, lse = unpack(out, lse, Tq, cfg.group, D)
    return out.astype(q.dtype), lse
