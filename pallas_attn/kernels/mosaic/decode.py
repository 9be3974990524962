"""Split-KV decode attention (Flash-Decoding) with PackGQA on Mosaic GPU (Hopper): TMA and wgmma.

The algorithm of :mod:`pallas_attn.kernels.decode` (the Triton kernel): the visible keys of a
batch row are cut into ``num_splits`` chunks; one CTA (one warpgroup) handles one (split and
block of 64 packed query rows, KV head, batch row), runs FlashAttention-2's online softmax
(:mod:`pallas_attn.softmax`) over its chunk in tiles of 64 keys, and writes the partial
``out_s = acc / l`` and natural-log ``lse_s``; :func:`pallas_attn.kernels.decode.combine` merges
the splits. PackGQA: the ``G`` query heads of a KV group and the ``Tq`` queries are the rows of
one 64-row wgmma tile (row ``r = t * G + g``), so each K/V tile is loaded once per group.

Keys arrive by TMA, double-buffered (tile ``j + 1`` in flight while ``j`` is computed), straight
from the cache, which is never padded or copied: a contiguous tile is 64 consecutive slots of
the row's cache row; a paged tile is the 64 keys of one page (``P % 64 == 0``) or ``64 / P``
whole pages (``64 % P == 0``), one copy per page into one barrier that expects them all. The
block table row and the per-row ``(kv_start, kv_len, cache row)`` come into SMEM by TMA first;
block-table entries are read only for pages below the row's length (later entries may hold
anything, e.g. -1). Slots of a tile outside ``[kv_start, kv_len)`` are memory the row does not
own (:func:`pallas_attn.masks.key_owned`): their scores are masked, and on edge tiles their V
rows are zeroed in SMEM before ``P V``, so NaN there never reaches an output.

FP8 caches (``float8_e4m3fn``, ``real = stored * descale``): TMA moves the 8-bit tiles (half the
bytes of a 16-bit cache: decode is bound by HBM bandwidth), and each tile is upcast to q's dtype
in SMEM (registers in between) before its wgmma; ``k_descale`` folds into the softmax scale and
``v_descale`` multiplies the output, as in the Triton kernel. Not e4m3 wgmma operands, which
sm_90 has: it multiplies two e4m3 operands only, so Q and P would be quantised to 3 mantissa bits
(other numerics than the Triton and XLA paths, which attend in q's dtype), and 8-bit operands
must be K-major, which V (the B operand of ``P V``, keys major) is not without a transpose.

Tree masks (token-tree verification, ``Tq > 1``): the ``[Tq, Tq]`` mask of each row comes as bits,
one int32 word per 32 tree keys and packed row (:func:`pack_tree_bits`), TMA-loaded once per CTA;
a score tile tests its keys' bits with shifts (:func:`tree_visible`), the rule of
:func:`pallas_attn.masks.tree_visible`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_attn import heuristics, masks, softmax
from pallas_attn.kernels import decode as triton_decode
from pallas_attn.kernels.mosaic import common as mc

BLOCK_N = 64  # keys per tile
META_WIDTH = mc.META_WIDTH  # [kv_start, kv_len, cache row, 0...] and block-table rows


@dataclasses.dataclass(frozen=True)
class DecodeStatic:
    """Static parameters of the Mosaic decode kernel besides its tiles (hashable)."""

    softmax_scale: float
    window: tuple[int, int]
    softcap: float
    interpret: bool


def _kernel(
    q_ref,  # [B, Hkv, Mp, D] GMEM, packed query rows
    meta_ref,  # [B, META_WIDTH] int32 GMEM
    table_ref,  # [B, max_blocks_p] int32 GMEM (paged) or [B, 32] (contiguous: unused)
    k_ref,  # [Bc, S, Hkv, D] or [num_pages, P, Hkv, D] GMEM: the whole cache
    v_ref,  # same as k_ref
    desc_ref,  # [B, Hkv, META_WIDTH] float32 GMEM: k_descale, v_descale, 0... (FP8 only)
    tree_ref,  # [B, W, Mp] int32 GMEM: tree-mask bits of each packed row (tree only)
    o_ref,  # [B, Hkv, n, Mp, D] float32 GMEM, partial outputs per split
    lse_ref,  # [B, Hkv, n, Mp] float32 GMEM
    q_s,  # [64, D] SMEM
    k_s,  # [2, 64, D] SMEM, double-buffered, in the cache's dtype
    v_s,  # [2, 64, D] SMEM
    kc_s,  # [64, D] SMEM, the K tile converted to q's dtype (FP8 only)
    vc_s,  # [64, D] SMEM, the V tile converted (FP8 only)
    p_s,  # [64, 64] SMEM, probabilities in q's dtype
    o_s,  # [64, D] float32 SMEM
    lse_s,  # [64] float32 SMEM
    meta_s,  # [META_WIDTH] int32 SMEM
    table_s,  # [max_blocks_p] int32 SMEM
    desc_s,  # [META_WIDTH] float32 SMEM (FP8 only)
    tree_s,  # [W, 64] int32 SMEM, the block's tree-mask bits (tree only)
    in_bar,  # [5] barriers: meta, block table, q, descales, tree bits
    k_bar,  # [2] barriers (one per slot), each expecting one copy per page of a tile
    v_bar,  # [2] barriers
    *,
    cfg: DecodeStatic,
    dcfg: triton_decode.DecodeConfig,
    Tq: int,
    paged: bool,
    fp8: bool,
    tree: bool,
    W: int,
):
    rows = mc.WGMMA_ROWS
    s_axis, h, b = (lax.axis_index(n) for n in ("s", "h", "b"))
    mi, split = lax.div(s_axis, dcfg.num_splits), lax.rem(s_axis, dcfg.num_splits)
    plgpu.copy_gmem_to_smem(meta_ref.at[b], meta_s, in_bar.at[0])
    if paged:
        plgpu.copy_gmem_to_smem(table_ref.at[b], table_s, in_bar.at[1])
    plgpu.copy_gmem_to_smem(
        q_ref.at[b, h, pl.ds(pl.multiple_of(mi * rows, rows), rows)], q_s, in_bar.at[2]
    )
    block = pl.ds(pl.multiple_of(mi * rows, rows), rows)
    if tree:
        plgpu.copy_gmem_to_smem(tree_ref.at[b, :, block], tree_s, in_bar.at[4])
    scale = cfg.softmax_scale
    if fp8:  # k_descale folds into the softmax scale, v_descale multiplies the output
        plgpu.copy_gmem_to_smem(desc_ref.at[b, h], desc_s, in_bar.at[3])
        plgpu.barrier_wait(in_bar.at[3])
        scale = scale * desc_s[0]
    plgpu.barrier_wait(in_bar.at[0])
    if paged:
        plgpu.barrier_wait(in_bar.at[1])
    kv_start, kv_len, cache_row = meta_s[0], meta_s[1], meta_s[2]
    j_start, j_end = triton_decode.split_tiles(dcfg, Tq, mi, split, kv_start, kv_len)
    P = k_ref.shape[1]
    chunk = min(P, BLOCK_N) if paged else BLOCK_N
    last_page = jnp.maximum(kv_len - 1, 0) // P

    def fetch(j):
        slot = lax.rem(j, 2)
        for c in range(BLOCK_N // chunk):
            pos = j * BLOCK_N + c * chunk
            if paged:  # entries past the row's last page are never read
                src = (table_s[jnp.minimum(pos // P, last_page)], pl.ds(lax.rem(pos, P), chunk), h)
            else:
                src = (cache_row, pl.ds(pos, chunk), h)
            dst = pl.ds(c * chunk, chunk)
            plgpu.copy_gmem_to_smem(k_ref.at[src], k_s.at[slot, dst], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[src], v_s.at[slot, dst], v_bar.at[slot])

    pl.when(j_start < j_end)(lambda: fetch(j_start))
    plgpu.barrier_wait(in_bar.at[2])
    shape = (rows, BLOCK_N)
    t = jnp.minimum(lax.div(mi * rows + mc.iota(cfg, shape, 0), dcfg.group), Tq - 1)
    q_pos = kv_len - Tq + t  # query t sits at key position kv_len - Tq + t
    words = None
    if tree:
        plgpu.barrier_wait(in_bar.at[4])
        words = [mc.bcast(mc.load_vector(cfg, tree_s.at[w], 1), shape, 0) for w in range(W)]

    def pv(p, v_tile, acc):
        mc.store_tile(p_s, p)
        return mc.matmul_acc(cfg, acc, p_s, v_tile)

    def body(j, carry):
        slot = lax.rem(j, 2)
        pl.when(j + 1 < j_end)(lambda: fetch(j + 1))
        plgpu.barrier_wait(k_bar.at[slot])
        plgpu.barrier_wait(v_bar.at[slot])
        k_tile, v_tile = k_s.at[slot], v_s.at[slot]
        if fp8:  # upcast both tiles to q's dtype in SMEM: the wgmma operands are 16-bit
            for src, dst in ((k_tile, kc_s), (v_tile, vc_s)):
                x = mc.load_tile(cfg, src)
                if dst.dtype != jnp.float16:  # sm_90 converts e4m3 to f16 only (exact via f32)
                    x = x.astype(jnp.float32)
                mc.store_tile(dst, x.astype(dst.dtype))
            k_tile, v_tile = kc_s, vc_s
        first = j * BLOCK_N
        edge = (first < kv_start) | (first + BLOCK_N > kv_len)
        # Zero the V rows of slots the row does not own (they may hold NaN).
        pl.when(edge)(lambda: mc.zero_unowned(cfg, first, kv_start, kv_len, v_tile))
        s = mc.matmul(cfg, q_s, k_tile, transpose_b=True)  # [64 rows, 64 keys]
        s2, _ = softmax.scale_scores(s, scale, cfg.softcap)
        k_pos = first + mc.iota(cfg, shape, 1)
        mask = masks.visible(q_pos, k_pos, window=cfg.window, kv_start=kv_start, kv_len=kv_len)
        if tree:
            mask = mask & tree_visible(words, k_pos - (kv_len - Tq), Tq)
        return softmax.step(carry, s2, v_tile, pv, mask, accumulate=True)

    m, l, acc = softmax.init((rows,), q_s.shape[-1])
    carry = (mc.rows(cfg, m), mc.rows(cfg, l), mc.tile(cfg, acc))
    out, lse = softmax.finalize(*lax.fori_loop(j_start, j_end, body, carry))
    if fp8:
        out = out * desc_s[1]
    mc.store_tile(o_s, out)
    mc.store_tile(lse_s, lse)
    plgpu.copy_smem_to_gmem(o_s, o_ref.at[b, h, split, block])
    plgpu.copy_smem_to_gmem(lse_s, lse_ref.at[b, h, split, block])
    plgpu.wait_smem_to_gmem(0)


def pack_tree_bits(tree_mask, G: int, Mp: int):
    """tree_mask [B, Tq, Tq] bool -> [B, W, Mp] int32, ``W = ceil(Tq / 32)``: bit ``c % 32`` of
    word ``c // 32`` of packed row ``r = t * G + g`` is ``tree_mask[b, t, c]`` (padding rows
    repeat the last query). A [64]-row vector per word, not [64, Tq] rows: the kernel's score
    tiles are in the wgmma layout, where a gather along keys has no form."""
    B, Tq, _ = tree_mask.shape
    W = -(-Tq // 32)
    t = jnp.minimum(jnp.arange(Mp) // G, Tq - 1)
    rows = jnp.pad(tree_mask[:, t].astype(jnp.uint32), ((0, 0), (0, 0), (0, 32 * W - Tq)))
    rows = rows.reshape(B, Mp, W, 32) << jnp.arange(32, dtype=jnp.uint32)
    return lax.bitcast_convert_type(jnp.sum(rows, -1, dtype=jnp.uint32), jnp.int32).swapaxes(1, 2)


def tree_visible(words, c, Tq: int):
    """:func:`pallas_attn.masks.tree_visible` on bit-packed rows: ``words`` the W [64, N] int32
    tiles of :func:`pack_tree_bits` (broadcast along keys), ``c`` [64, N] the key columns among
    the tree keys (``k_pos - tree_start``). Keys outside ``[0, Tq)`` follow the other masks."""
    hit = jnp.zeros(c.shape, jnp.int32)
    for w, word in enumerate(words):
        shift = jnp.clip(c - 32 * w, 0, 31)
        bit = lax.shift_right_logical(word, shift) & 1
        hit = jnp.where((c >= 32 * w) & (c < 32 * w + 32), bit, hit)
    return (hit != 0) | (c < 0) | (c >= Tq)


def check_supported(q, k_cache, *, paged: bool, fp8: bool, tree: bool):
    """What the Mosaic decode kernel takes (ValueError / TypeError otherwise, before tracing)."""
    D = q.shape[-1]
    if not any(jnp.dtype(q.dtype) == jnp.dtype(d) for d in mc.DTYPES):
        raise TypeError(
            'impl="mosaic" decodes bfloat16 or float16 queries (caches in q\'s dtype or FP8), '
            f"got q {jnp.dtype(q.dtype).name}, cache {jnp.dtype(k_cache.dtype).name}; "
            'use impl="pallas"'
        )
    del fp8  # float8_e4m3fn caches: tiles upcast to q's dtype in SMEM
    if D % mc.HEAD_DIM_MULTIPLE or D > mc.MAX_HEAD_DIM:
        raise ValueError(
            f'impl="mosaic" decodes head dims 64 or 128 (TMA tiles of the unpadded cache), got '
            f'D={D}; use impl="pallas"'
        )
    P = k_cache.shape[1]
    if paged and P % BLOCK_N and BLOCK_N % P:
        raise ValueError(
            f'impl="mosaic" needs a page size dividing {BLOCK_N} or a multiple of it, got P={P}'
        )
    if not paged and P % BLOCK_N:
        raise ValueError(
            f'impl="mosaic" needs a contiguous cache length that is a multiple of {BLOCK_N}, '
            f"got S={P}"
        )
    del tree  # tree masks: bit-packed rows (:func:`pack_tree_bits`)


def supports(q, k_cache, *, paged: bool, fp8: bool, tree: bool) -> bool:
    """Whether :func:`check_supported` accepts these inputs (what ``impl="auto"`` asks)."""
    try:
        check_supported(q, k_cache, paged=paged, fp8=fp8, tree=tree)
    except (TypeError, ValueError):
        return False
    return True


def decode(
    q,
    k_cache,
    v_cache,
    kv_len,
    kv_start,
    index,
    descale=None,
    tree_mask=None,
    *,
    cfg: DecodeStatic,
    num_splits: int,
):
    """Split-KV attention of q over a cache whose rows already hold every key.

    Args:
      q: [B, Tq, Hq, D] (rotary applied), bfloat16 or float16.
      k_cache, v_cache: contiguous [Bc, S, Hkv, D] (``index`` = [B] cache rows) or paged
        [num_pages, P, Hkv, D] (``index`` = [B, max_blocks] block table), q's dtype or
        ``float8_e4m3fn``.
      kv_len, kv_start: [B] int32, keys ``[kv_start, kv_len)`` are valid; query ``t`` sits at
        position ``kv_len - Tq + t``.
      descale: [2, B, Hkv] float32 ``(k_descale, v_descale)`` for FP8 caches, else None.
      tree_mask: [B, Tq, Tq] bool tree mask among the last Tq keys
        (:func:`pallas_attn.masks.tree_visible`), or None.
      cfg: softmax scale, window (normalised), softcap, and whether to interpret.
      num_splits: KV splits; 0 = :func:`pallas_attn.heuristics.choose_splits`.

    Returns:
      out [B, Tq, Hq, D] in q's dtype, lse [B, Hq, Tq] float32.
    """
    B, Tq, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    rows = mc.WGMMA_ROWS
    paged = index.ndim == 2
    capacity = k_cache.shape[1] * (index.shape[1] if paged else 1)
    packed = triton_decode.pack_queries(q, Hkv, rows, D)  # [B, Hkv, Mp, D]
    Mp = packed.shape[2]
    m_blocks = Mp // rows
    n = heuristics.choose_splits(num_splits, B * Hkv * m_blocks, capacity, BLOCK_N)
    dcfg = triton_decode.DecodeConfig(
        softmax_scale=cfg.softmax_scale,
        window=cfg.window,
        softcap=cfg.softcap,
        group=G,
        block_m=rows,
        block_n=BLOCK_N,
        num_splits=n,
    )
    row = jnp.zeros_like(kv_len) if paged else index
    meta = jnp.stack([kv_start, kv_len, row], 1).astype(jnp.int32)
    meta = jnp.pad(meta, ((0, 0), (0, META_WIDTH - 3)))
    table = index if paged else jnp.zeros((B, META_WIDTH), jnp.int32)
    table = jnp.pad(table, ((0, 0), (0, -table.shape[1] % META_WIDTH)))
    fp8, tree = descale is not None, tree_mask is not None
    inputs = (packed, meta, table, k_cache, v_cache)
    if fp8:  # [B, Hkv, META_WIDTH] rows (k_descale, v_descale, 0...): one 128-byte TMA copy
        desc = jnp.moveaxis(descale.astype(jnp.float32), 0, -1)
        inputs += (jnp.pad(desc, ((0, 0), (0, 0), (0, META_WIDTH - 2))),)
    W = 0
    if tree:
        bits = pack_tree_bits(tree_mask, G, Mp)  # [B, W, Mp]
        W = bits.shape[1]
        inputs += (bits,)

    def mosaic_decode(*refs):  # the kernel's name in compile reports
        refs = mc.with_optional(refs, 5, (fp8, tree))
        _kernel(*refs, cfg=cfg, dcfg=dcfg, Tq=Tq, paged=paged, fp8=fp8, tree=tree, W=W)

    chunks = BLOCK_N // min(k_cache.shape[1], BLOCK_N) if paged else 1
    out_s, lse_s = plgpu.kernel(
        mosaic_decode,
        out_type=(
            jax.ShapeDtypeStruct((B, Hkv, n, Mp, D), jnp.float32),
            jax.ShapeDtypeStruct((B, Hkv, n, Mp), jnp.float32),
        ),
        scratch_types=[
            mc.smem((rows, D), q.dtype),
            mc.smem((2, BLOCK_N, D), k_cache.dtype),
            mc.smem((2, BLOCK_N, D), k_cache.dtype),
            mc.smem((BLOCK_N, D), q.dtype) if fp8 else None,
            mc.smem((BLOCK_N, D), q.dtype) if fp8 else None,
            mc.smem((rows, BLOCK_N), q.dtype),
            mc.smem((rows, D), jnp.float32),
            plgpu.SMEM((rows,), jnp.float32),
            plgpu.SMEM((META_WIDTH,), jnp.int32),
            plgpu.SMEM((table.shape[1],), jnp.int32),
            plgpu.SMEM((META_WIDTH,), jnp.float32) if fp8 else None,
            plgpu.SMEM((W, rows), jnp.int32) if tree else None,
            plgpu.Barrier(num_barriers=5),
            plgpu.Barrier(num_arrivals=chunks, num_barriers=2),
            plgpu.Barrier(num_arrivals=chunks, num_barriers=2),
        ],
        grid=(m_blocks * n, Hkv, B),
        grid_names=("s", "h", "b"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mc.interpret_params(cfg),
    )(*inputs)
    out, lse = triton_decode.combine(out_s, lse_s)
    out, lse = triton_decode.unpack(out, lse, Tq, G, D)
    return out.astype(q.dtype), lse
