"""The public ``attention_with_kvcache``: validation, defaults, dispatch on ``impl``."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_attn import cache, cpu, heuristics, masks, native, reference, validation, xla

CACHE_DTYPES = (*validation.FLOAT_DTYPES, cache.FP8_DTYPE)


class KVCacheResult(NamedTuple):
    """``out`` [B, Tq, Hq, D] (q's dtype); ``lse`` [B, Hq, Tq] float32 or None; the caches."""

    out: jax.Array
    lse: jax.Array | None
    k_cache: jax.Array
    v_cache: jax.Array


def attention_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    *,
    cache_seqlens,
    block_table=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved: bool = True,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    softmax_scale: float | None = None,
    k_descale=None,
    v_descale=None,
    num_splits: int = 0,
    return_lse: bool = False,
    impl: str = "auto",
    tree_mask=None,
) -> KVCacheResult:
    """Attention of new queries over a KV cache, after appending new keys/values to it.

    Args:
      q: [B, Tq, Hq, D] float32 / bfloat16 / float16, ``Tq >= 1``.
      k_cache, v_cache: contiguous [Bc, S, Hkv, D] or, with ``block_table``, paged
        [num_blocks, P, Hkv, D]; q's dtype, ``float8_e4m3fn``, or ``bfloat16`` / ``float16``
        under float32 queries (a 16-bit cache for a float32 model: new keys are rounded to it on
        the write, keys are read back exactly into float32).
      k, v: optional [B, Tn, Hkv, D] new tokens in q's dtype, written at positions
        ``cache_seqlens[b] .. cache_seqlens[b] + Tn - 1`` of row ``cache_batch_idx[b]`` (or ``b``).
      cache_seqlens: int or [B] int, tokens already in each row (not changed by the call).
      block_table: [B, max_blocks] int32 page indices; entries past a row's length are ignored.
      cache_batch_idx: [B] int, the cache row of each batch row (contiguous caches only).
      cache_leftpad: [B] int, first valid key of each row (default 0).
      rotary_cos, rotary_sin: [max_pos, R/2], ``R`` even and ``<= D``: rotate the first ``R`` dims of
        q and of the new k before the write. New key ``t`` sits at position
        ``cache_seqlens - cache_leftpad + t``; query ``i`` at ``cache_seqlens - cache_leftpad + i``
        when causal or windowed, else at ``cache_seqlens - cache_leftpad``.
      rotary_interleaved: pairs ``(2i, 2i+1)`` if True, ``(i, i + R/2)`` (GPT-NeoX) if False.
      causal, window_size: bottom-right aligned: query ``i`` sits at key position
        ``cache_seqlens + Tn - Tq + i``; keys ``[cache_leftpad, cache_seqlens + Tn)`` are valid,
        every other slot is ignored whatever it holds (NaN included). For one row with
        ``cache_seqlens = 4``, ``Tn = Tq = 2``, ``cache_leftpad = 1``, causal (1 = visible)::

            key slot:  0 1 2 3 4 5 6 7
            query 0:   0 1 1 1 1 0 0 0     (sits at key 4, a new key)
            query 1:   0 1 1 1 1 1 0 0     (sits at key 5)
      softcap, softmax_scale: as in :func:`pallas_attn.flash_attention`.
      k_descale, v_descale: [B, Hkv] float32 for an FP8 cache (default 1): real = stored * descale.
      num_splits: KV splits of the decode kernel; 0 = heuristic. Results agree within rounding.
      return_lse: also return the float32 natural-log lse [B, Hq, Tq].
      impl: "reference", "xla" (blockwise jnp), "native" (the C++ kernel of the attention step
        on the CPU backend, :mod:`pallas_attn.cpu`: at most ``cpu.MAX_ROWS`` queries per KV
        head, built on first use), "pallas", "interpret", "mosaic" / "mosaic_interpret" (the
        Hopper kernel: TMA, wgmma; 16-bit queries, 16-bit or FP8 caches, D 64 or 128; the cache
        write is the jnp scatter) or "auto" (mosaic on sm_90+ where it applies, else pallas on GPU;
        native on CPU where it applies, else xla).
      tree_mask: [Tq, Tq] or [B, Tq, Tq] bool, tree attention (speculative token trees): among
        the last ``Tq`` keys (the queries' own positions ``cache_seqlens + Tn - Tq + j``) query
        ``i`` sees key ``j`` only where ``tree_mask[i, j]``; keys before them follow the other
        masks. With ``causal``, a tree whose parents precede their children, each node sees the
        cache and its ancestors (``tree_mask[i, j]`` = j is i or an ancestor of i)::

            tree 0 -> {1, 2}, 1 -> {3}     tree_mask   1 0 0 0
                                                       1 1 0 0
                                                       1 0 1 0
                                                       1 1 0 1

    Returns:
      :class:`KVCacheResult` ``(out, lse, k_cache, v_cache)``. Under ``jax.jit`` with the caches
      donated, the caches are updated in place (Pallas: aliased kernel outputs; "xla": a scatter.
      XLA's CPU backend scatters 16-bit and FP8 caches through a float32 copy; float32 caches,
      and the Pallas path, need no second cache buffer).
    """
    auto = impl == "auto"
    impl = validation.resolve_impl(impl, native=True)
    validation.check_array("q", q, ndim=4)
    validation.check_nonempty("q", q, "BTHD")
    _check_caches(q, k_cache, v_cache)
    Tn = _check_new(q, k_cache, k, v)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    B, Tq, _, D = q.shape
    block_table, cache_batch_idx = _check_index(B, k_cache, block_table, cache_batch_idx)
    seqlens = _per_row("cache_seqlens", cache_seqlens, B)
    leftpad = _per_row("cache_leftpad", 0 if cache_leftpad is None else cache_leftpad, B)
    static = cache.Static(
        softmax_scale=validation.softmax_scale_or_default(softmax_scale, D),
        window=masks.normalize_window(causal, validation.check_window(window_size)),
        softcap=validation.check_softcap(softcap),
        rotary_interleaved=bool(rotary_interleaved),
        capacity=cache.capacity(k_cache.shape, block_table),
    )
    _check_values(
        seqlens, leftpad, Tn, static.capacity, k_cache.shape, block_table, cache_batch_idx
    )
    cos, sin = _check_rotary(rotary_cos, rotary_sin, D)
    _check_rotary_length(cos, seqlens, leftpad, max(Tn, Tq if static.window != (-1, -1) else 1))
    fp8, descale_shape = cache.is_fp8(k_cache), (B, k_cache.shape[2])
    args = cache.CacheArgs(
        seqlens,
        leftpad,
        cache_batch_idx,
        block_table,
        cos,
        sin,
        _descale("k_descale", k_descale, fp8, descale_shape),
        _descale("v_descale", v_descale, fp8, descale_shape),
        _check_tree_mask(tree_mask, B, Tq),
    )
    new = (k, v) if Tn else (None, None)
    paged, tree = block_table is not None, tree_mask is not None
    if auto and validation.resolve_impl("auto", mosaic_dtype=q.dtype) == "mosaic":
        from pallas_attn.kernels.mosaic import decode  # sm_90+: the Mosaic kernel where it applies

        impl = "mosaic" if decode.supports(q, k_cache, paged=paged, fp8=fp8, tree=tree) else impl
    if auto and impl == "xla" and cpu.eligible(q, k_cache):
        impl = "native"
    elif impl == "native" and (why := _native_unsupported(q, k_cache)):
        raise ValueError(f'impl="native" {why}; impl="auto" falls back to "xla" where it does not')
    if impl in ("reference", "xla", "native"):
        out, lse, k_cache, v_cache = _jnp(impl, static, args, q, k_cache, v_cache, *new)
    elif impl in ("mosaic", "mosaic_interpret"):
        from pallas_attn.kernels.mosaic import decode  # imported only when asked for

        decode.check_supported(q, k_cache, paged=paged, fp8=fp8, tree=tree)
        out, lse, k_cache, v_cache = _mosaic(
            static,
            args,
            q,
            k_cache,
            v_cache,
            *new,
            num_splits=num_splits,
            interpret=impl == "mosaic_interpret",
        )
    else:
        out, lse, k_cache, v_cache = _pallas(
            static,
            args,
            q,
            k_cache,
            v_cache,
            *new,
            num_splits=num_splits,
            interpret=impl == "interpret",
        )
    return KVCacheResult(out, lse.astype(jnp.float32) if return_lse else None, k_cache, v_cache)


def _native_unsupported(q, k_cache) -> str | None:
    """Why an explicit ``impl="native"`` call cannot run (None when it can)."""
    if jax.default_backend() != "cpu":
        return f"runs on the CPU backend only, not {jax.default_backend()!r}"
    rows = q.shape[1] * (q.shape[2] // k_cache.shape[2])
    if rows > cpu.MAX_ROWS:
        return f"takes at most {cpu.MAX_ROWS} queries per KV head (Tq * Hq / Hkv), got {rows}"
    if not native.available():
        return "needs the native kernels, which are not built (see pallas_attn.native)"
    return None


@functools.partial(jax.jit, static_argnums=(0, 1))
def _jnp(impl: str, static: cache.Static, args: cache.CacheArgs, q, k_cache, v_cache, k, v):
    """The jnp paths: the cache write (:func:`cache.write`), then the native CPU kernel over the
    cache in place (``"native"``, see :mod:`pallas_attn.cpu`), or a gather of each
    row's keys and :func:`pallas_attn.reference.attention` (``"reference"``, the oracle) or the
    blockwise :func:`pallas_attn.xla.attention` (``"xla"``)."""
    q = cache.rotate_queries(static, args, q)
    Tn = 0
    if k is not None:
        Tn = k.shape[1]
        k_cache, v_cache = cache.write(static, args, k_cache, v_cache, k, v)
    if impl == "native":  # the blockwise path where the program is lowered for another platform
        out, lse = native.on_cpu(
            functools.partial(cpu.attention, static, args, Tn=Tn),
            functools.partial(_gathered, "xla", static, args, Tn=Tn),
            q,
            k_cache,
            v_cache,
        )
    else:
        out, lse = _gathered(impl, static, args, q, k_cache, v_cache, Tn=Tn)
    return out, lse, k_cache, v_cache


def _gathered(impl: str, static: cache.Static, args: cache.CacheArgs, q, k_cache, v_cache, *, Tn):
    """(out, lse) over a gather of each row's keys: the reference or the blockwise path."""
    k_rows, v_rows = cache.attention_inputs(args, k_cache, v_cache)
    if cache.is_narrow(q, k_cache):  # a 16-bit cache under float32 queries: exact upcast
        k_rows, v_rows = k_rows.astype(q.dtype), v_rows.astype(q.dtype)
    kw = dict(softmax_scale=static.softmax_scale, window=static.window, softcap=static.softcap)
    kw.update(cache.key_range(args, q.shape[1], Tn)._asdict(), tree_mask=args.tree_mask)
    if impl == "reference":
        return reference.attention(q, k_rows, v_rows, **kw)
    block_q = q.shape[1] if q.shape[1] <= 256 else None  # decode: no padding of Tq = 1
    block_k = heuristics.xla_cache_block(k_rows.shape[1])
    return xla.attention(q, k_rows, v_rows, block_q=block_q, block_k=block_k, **kw)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("num_splits", "interpret"))
def _pallas(static, args, q, k_cache, v_cache, k, v, *, num_splits: int, interpret: bool):
    """The Pallas kernels: append (fused rotary, FP8) in place, then split-KV decode."""
    from pallas_attn.kernels import append, decode  # imported only when asked for

    index = cache.row_index(args, q.shape[0])
    descale = _descales(args, k_cache)
    q = cache.rotate_queries(static, args, q)
    Tn = 0
    if k is not None:
        Tn = k.shape[1]
        k_cache, v_cache = append.append(
            k_cache,
            v_cache,
            k,
            v,
            args.cache_seqlens,
            args.cache_leftpad,
            index,
            args.rotary_cos,
            args.rotary_sin,
            descale,
            interleaved=static.rotary_interleaved,
            interpret=interpret,
        )
    cfg = decode.DecodeConfig.make(
        q.shape,
        k_cache.shape[2],
        static.capacity,
        q.dtype,
        softmax_scale=static.softmax_scale,
        window=static.window,
        softcap=static.softcap,
        num_splits=num_splits,
    )
    ranges = cache.key_range(args, q.shape[1], Tn)
    out, lse = decode.decode(
        q,
        k_cache,
        v_cache,
        ranges.kv_len,
        ranges.kv_start,
        index,
        descale,
        args.tree_mask,
        cfg=cfg,
        interpret=interpret,
    )
    return out, lse, k_cache, v_cache


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("num_splits", "interpret"))
def _mosaic(static, args, q, k_cache, v_cache, k, v, *, num_splits: int, interpret: bool):
    """The Mosaic GPU decode kernel after the jnp cache write (:func:`cache.write`: rotary and
    FP8 quantisation, in place under donation)."""
    from pallas_attn.kernels.mosaic import decode

    q = cache.rotate_queries(static, args, q)
    Tn = 0
    if k is not None:
        Tn = k.shape[1]
        k_cache, v_cache = cache.write(static, args, k_cache, v_cache, k, v)
    cfg = decode.DecodeStatic(static.softmax_scale, static.window, static.softcap, interpret)
    ranges = cache.key_range(args, q.shape[1], Tn)
    index = cache.row_index(args, q.shape[0])
    out, lse = decode.decode(
        q,
        k_cache,
        v_cache,
        ranges.kv_len,
        ranges.kv_start,
        index,
        _descales(args, k_cache),
        args.tree_mask,
        cfg=cfg,
        num_splits=num_splits,
    )
    return out, lse, k_cache, v_cache


def _descales(args: cache.CacheArgs, k_cache):
    """[2, B, Hkv] float32 ``(k_descale, v_descale)`` for an FP8 cache, else None."""
    if not cache.is_fp8(k_cache):
        return None
    return jnp.stack([args.k_descale, args.v_descale])


def _check_tree_mask(tree_mask, B: int, Tq: int):
    """None, or ``tree_mask`` as a [B, Tq, Tq] bool array (ValueError naming it otherwise)."""
    if tree_mask is None:
        return None
    shape = getattr(tree_mask, "shape", None)
    if shape not in ((Tq, Tq), (B, Tq, Tq)) or jnp.dtype(tree_mask.dtype) != jnp.bool_:
        raise ValueError(
            f"tree_mask must be a bool [Tq, Tq] or [B, Tq, Tq] array with Tq = {Tq}, B = {B}, "
            f"got {_shape(tree_mask)} {getattr(tree_mask, 'dtype', type(tree_mask).__name__)}"
        )
    return jnp.broadcast_to(jnp.asarray(tree_mask), (B, Tq, Tq))


def _shape(x):
    return tuple(getattr(x, "shape", ())) if hasattr(x, "shape") else type(x).__name__


def _check_index(B: int, k_cache, block_table, cache_batch_idx):
    """Checks ``block_table`` (paged) or ``cache_batch_idx`` (contiguous); returns both as int32."""
    if block_table is not None:
        if getattr(block_table, "ndim", None) != 2:
            raise ValueError(f"block_table must be [B, max_blocks], got {_shape(block_table)}")
        validation.check_int_array("block_table", block_table, (B, block_table.shape[1]))
        validation.check_nonempty("block_table", block_table, "BN")
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with a paged cache (block_table)")
        return jnp.asarray(block_table, jnp.int32), None
    if cache_batch_idx is not None:
        validation.check_int_array("cache_batch_idx", cache_batch_idx, (B,))
        return None, jnp.asarray(cache_batch_idx, jnp.int32)
    if k_cache.shape[0] != B:
        raise ValueError(
            f"k_cache has {k_cache.shape[0]} rows but q has batch {B}; "
            "pass cache_batch_idx or a block_table"
        )
    return None, None


def _check_caches(q, k_cache, v_cache):
    validation.check_array("k_cache", k_cache, ndim=4, dtypes=CACHE_DTYPES)
    validation.check_array("v_cache", v_cache, ndim=4, dtypes=CACHE_DTYPES)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"v_cache shape {v_cache.shape} must equal k_cache shape {k_cache.shape}")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache dtypes differ: {k_cache.dtype}, {v_cache.dtype}")
    if not cache.is_fp8(k_cache) and k_cache.dtype != q.dtype and not cache.is_narrow(q, k_cache):
        raise TypeError(
            f"k_cache dtype must be q's dtype ({q.dtype}), float8_e4m3fn, or bfloat16 / float16 "
            f"under float32 queries, got {k_cache.dtype}"
        )
    validation.check_nonempty("k_cache", k_cache, "BSHD")
    validation.check_heads(q.shape, k_cache.shape, k_name="k_cache")


def _check_new(q, k_cache, k, v) -> int:
    """Checks the new tokens; returns Tn (0 without them)."""
    if (k is None) != (v is None):
        raise ValueError("k and v (new tokens) must be given together, got only one of them")
    if k is None:
        return 0
    validation.check_array("k", k, ndim=4)
    validation.check_array("v", v, ndim=4)
    if k.shape != v.shape:
        raise ValueError(f"v shape {v.shape} must equal k shape {k.shape}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k and v must have q's dtype {q.dtype}, got {k.dtype}, {v.dtype}")
    want = (q.shape[0], k.shape[1], k_cache.shape[2], k_cache.shape[3])
    if k.shape != want:
        raise ValueError(f"k must have shape [B, Tn, Hkv, D] = {want}, got {k.shape}")
    return k.shape[1]


def _per_row(name: str, x, B: int):
    """An int or a [B] int array -> [B] int32."""
    if isinstance(x, int | np.integer) and not isinstance(x, bool):
        return jnp.full((B,), int(x), jnp.int32)
    validation.check_int_array(name, x, (B,))
    return jnp.asarray(x, jnp.int32)


def _concrete(x):
    """A NumPy copy of ``x`` when its values are known at trace time, else None."""
    if x is None:
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_values(seqlens, leftpad, Tn, capacity, cache_shape, block_table, batch_idx):
    """Range checks on values that are concrete (skipped for traced arguments)."""
    lens, pad = _concrete(seqlens), _concrete(leftpad)
    if lens is not None:
        if lens.min() < 0 or lens.max() + Tn > capacity:
            raise ValueError(
                f"cache_seqlens + Tn must lie in [0, {capacity}] (cache capacity), "
                f"got cache_seqlens={lens.tolist()}, Tn={Tn}"
            )
    if pad is not None and pad.min() < 0:
        raise ValueError(f"cache_leftpad must be >= 0, got {pad.tolist()}")
    rows = _concrete(batch_idx)
    if rows is not None and (rows.min() < 0 or rows.max() >= cache_shape[0]):
        raise ValueError(f"cache_batch_idx must lie in [0, {cache_shape[0]}), got {rows.tolist()}")
    table = _concrete(block_table)
    if table is not None and lens is not None:
        P, num_blocks = cache_shape[1], cache_shape[0]
        for b, length in enumerate(lens + Tn):
            used = table[b, : -(-int(length) // P)]
            if used.size and (used.min() < 0 or used.max() >= num_blocks):
                raise ValueError(
                    f"block_table row {b} must hold pages in [0, {num_blocks}) for its "
                    f"{int(length)} tokens (page size {P}), got {used.tolist()}; "
                    "is k_cache paged [num_blocks, P, Hkv, D]?"
                )


def _check_rotary(cos, sin, D: int):
    if (cos is None) != (sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if cos is None:
        return None, None
    validation.check_array("rotary_cos", cos, ndim=2)
    validation.check_array("rotary_sin", sin, ndim=2)
    if cos.shape != sin.shape:
        raise ValueError(f"rotary_sin shape {sin.shape} must equal rotary_cos shape {cos.shape}")
    if cos.shape[0] == 0 or cos.shape[1] == 0 or 2 * cos.shape[1] > D:
        raise ValueError(
            f"rotary_cos must be [max_pos, R/2] with 0 < R <= D={D}, got shape {cos.shape}"
        )
    return cos, sin


def _check_rotary_length(cos, seqlens, leftpad, span: int):
    """The tables must cover every rotary position used, ``cache_seqlens - cache_leftpad + t`` for
    ``t < span``. Checked when both are concrete; under ``jax.jit`` with traced lengths it cannot
    be, and positions past the table are clamped to its last row (the caller's contract)."""
    lens, pad = _concrete(seqlens), _concrete(leftpad)
    if cos is None or lens is None or pad is None:
        return
    last = int((lens - pad).max()) + span - 1
    if last >= cos.shape[0]:
        raise ValueError(
            f"rotary_cos has {cos.shape[0]} rows but position {last} is used "
            f"(cache_seqlens - cache_leftpad + {span - 1}); it needs at least {last + 1} rows"
        )


def _descale(name: str, x, fp8: bool, shape):
    if not fp8:
        if x is not None:
            raise ValueError(f"{name} is only valid with a float8_e4m3fn cache")
        return None
    if x is None:
        return jnp.ones(shape, jnp.float32)
    validation.check_array(name, x, ndim=2)
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape [B, Hkv] = {shape}, got {tuple(x.shape)}")
    return jnp.asarray(x, jnp.float32)
