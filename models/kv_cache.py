"""The KV cache: an explicit pytree that goes into every cached forward and comes back out.

Two layouts (the FlashAttention / vLLM ones, what ``pallas_attn.attention_with_kvcache`` takes):

* contiguous: one ``[B, S_max, Hkv, D]`` array per layer for keys and one for values;
* paged: one ``[num_pages, P, Hkv, D]`` array per layer, shared by all rows, and a
  ``block_table [B, max_pages]`` int32 mapping row ``b``'s logical page ``i`` (cache positions
  ``i * P .. i * P + P - 1``) to a physical page. Entries past a row's length may be -1; they are
  never read.

Windowed layers of a paged cache (``ring_pages``): a layer that attends through a sliding window
of W keys never reads a key more than W - 1 positions behind its newest query, so it need not
keep every page the global layers keep. With ``KVCache.paged(..., ring_pages=R)`` each sliding
layer (``config.is_sliding``) gets its own pool of R pages per row, ``[B * R, P, Hkv, D]``,
addressed through a table derived from the logical one: row ``b``'s logical page ``i`` is
physical page ``b * R + i % R`` (:meth:`KVCache.ring_table`). Logical page ``i`` thus overwrites
page ``i - R``'s slot; with ``R >= ceil((W + T - 2) / P) + 1`` (:func:`ring_pages_for`, T the
most tokens of one call) every position a query of the call can see lives in a distinct slot,
and the older logical pages that alias newer keys are masked out by the window (applied by
logical position, whatever the slot holds). Global layers keep the caller's pages and block
table. A row's ring is private to it: prefix sharing between rows applies to the global layers
only. A caller that maps the rings itself passes ``window_table`` (the serving engine: a
request's ring is its batch slot's, whatever row of a step it is in, and padding writes go to a
scratch page after the rings, ``ring_scratch``); ``replay`` marks a call that rebuilds the rings
over positions whose global-layer keys are already cached (``decoding.engine``'s prefix hits):
the global layers then read their cached keys and write nothing.

``lengths [B]`` int32 counts the tokens already cached in each row. A cached forward of T tokens
writes them at positions ``lengths .. lengths + T - 1`` and returns ``lengths + T``; rolling back
(speculative decoding) or ignoring right padding (ragged prefill) is ``cache.replace(lengths=...)``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from models.config import TransformerConfig
from models.sharding import cache_shardings, check_mesh


@struct.dataclass
class KVCache:
    """Per-layer keys and values plus per-row lengths (and a block table when paged).

    Attributes:
      k, v: tuples with one array per layer: ``[B, S_max, Hkv, D]`` (contiguous) or
        ``[num_pages, P, Hkv, D]`` (paged; ``[B * ring_pages, P, Hkv, D]`` for a sliding layer
        of a ring cache). Keys are stored after RoPE.
      lengths: [B] int32, tokens already in each row.
      block_table: [B, max_pages] int32 for a paged cache, else None.
      ring_pages: R, pages per row of each sliding layer's ring (static), or None: every layer
        uses ``block_table`` (see the module docstring).
      window_table: [B, max_pages] int32, the sliding layers' table into their rings when the
        caller maps them (each entry a ring page), or None: :meth:`ring_table`.
      replay: (static) the call's T tokens at positions ``lengths .. lengths + T - 1`` are
        already in the global layers' pages: those layers attend over them (query ``i`` at
        position ``lengths + i``) and write nothing; the ring layers write theirs.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    block_table: jax.Array | None = None
    ring_pages: int | None = struct.field(pytree_node=False, default=None)
    window_table: jax.Array | None = None
    replay: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def contiguous(
        cls, config: TransformerConfig, batch: int, max_len: int, dtype=None, *, mesh=None
    ) -> KVCache:
        """An empty contiguous cache holding ``max_len`` tokens for each of ``batch`` rows.

        ``mesh``: create the arrays sharded for a model sharded over it (``models.shard``):
        heads over "model", rows over "data".
        """
        if batch < 1 or max_len < 1:
            raise ValueError(f"batch and max_len must be >= 1, got {batch} and {max_len}")
        shape = (batch, max_len, config.num_kv_heads, config.resolved_head_dim)
        return cls._empty(config, shape, jnp.zeros((batch,), jnp.int32), None, dtype, mesh)

    @classmethod
    def paged(
        cls,
        config: TransformerConfig,
        num_pages: int,
        page_size: int,
        block_table,
        dtype=None,
        *,
        mesh=None,
        ring_pages: int | None = None,
        ring_scratch: bool = False,
    ) -> KVCache:
        """An empty paged cache of ``num_pages`` pages of ``page_size`` tokens.

        ``block_table`` [B, max_pages] int32 assigns physical pages to each row's logical pages;
        the caller (a page allocator) owns it and may replace it with ``cache.replace``.
        ``mesh``: create the pool sharded for a model sharded over it (``models.shard``): heads
        over "model", every page on every "data" shard.
        ``ring_pages``: R, give each sliding-window layer a private ring of R pages per row
        instead (module docstring; :func:`ring_pages_for` gives the least R for a window and
        call length). ValueError when the config has no sliding layer or R < 1.
        ``ring_scratch``: one more page after the ``B * R`` ring pages of each sliding layer,
        ``[B * R + 1, P, Hkv, D]``, for the padding writes of a caller's ``window_table``.
        """
        block_table = jnp.asarray(block_table)
        if block_table.ndim != 2 or not jnp.issubdtype(block_table.dtype, jnp.integer):
            raise ValueError(
                f"block_table must be a [B, max_pages] int array, got {block_table.shape} "
                f"{block_table.dtype}"
            )
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        shape = (num_pages, page_size, config.num_kv_heads, config.resolved_head_dim)
        lengths = jnp.zeros((block_table.shape[0],), jnp.int32)
        cache = cls._empty(config, shape, lengths, block_table.astype(jnp.int32), dtype, mesh)
        if ring_pages is None:
            return cache
        if isinstance(ring_pages, bool) or not isinstance(ring_pages, int) or ring_pages < 1:
            raise ValueError(f"ring_pages must be an int >= 1 or None, got {ring_pages!r}")
        sliding = [i for i in range(config.num_layers) if config.is_sliding(i)]
        if not sliding:
            raise ValueError("ring_pages needs a config with sliding-window layers")
        ring_shape = (block_table.shape[0] * ring_pages + bool(ring_scratch), *shape[1:])
        ring = cls._empty(config, ring_shape, lengths, None, dtype, mesh)
        k, v = list(cache.k), list(cache.v)
        for i in sliding:
            k[i], v[i] = ring.k[i], ring.v[i]
        return cache.replace(k=tuple(k), v=tuple(v), ring_pages=ring_pages)

    @classmethod
    def _empty(cls, config, shape, lengths, block_table, dtype, mesh) -> KVCache:
        dtype = config.kv_jnp_dtype if dtype is None else jnp.dtype(dtype)
        mesh = None if mesh is None else check_mesh(config, mesh)
        layer, rows, table = cache_shardings(mesh, lengths.shape[0], block_table is not None)
        zeros = _zeros(tuple(shape), dtype, 2 * config.num_layers, layer)()
        k, v = zeros[: config.num_layers], zeros[config.num_layers :]
        if mesh is not None:
            lengths = jax.device_put(lengths, rows)
            block_table = None if block_table is None else jax.device_put(block_table, table)
        return cls(k=k, v=v, lengths=lengths, block_table=block_table)

    @property
    def is_paged(self) -> bool:
        return self.block_table is not None

    def ring_table(self) -> jax.Array:
        """The sliding layers' block table [B, max_pages] int32: ``b * R + i % R``."""
        B, max_pages = self.block_table.shape
        rows = jnp.arange(B, dtype=jnp.int32)[:, None] * self.ring_pages
        return rows + jnp.arange(max_pages, dtype=jnp.int32)[None, :] % self.ring_pages

    def layer_table(self, config: TransformerConfig, layer: int, num_tokens: int):
        """The block table layer ``layer`` reads and writes for a call of ``num_tokens`` tokens
        (``window_table``, else ``ring_table``, for a sliding layer of a ring cache); ValueError
        when the ring is too small for the call (an alias would be read)."""
        if self.ring_pages is None or not config.is_sliding(layer):
            return self.block_table
        need = ring_pages_for(config.sliding_window, num_tokens, self.page_size)
        if need > self.ring_pages:
            raise ValueError(
                f"a call of {num_tokens} tokens through a window of {config.sliding_window} needs "
                f"rings of {need} pages of {self.page_size}; the cache has {self.ring_pages}"
            )
        return self.ring_table() if self.window_table is None else self.window_table

    @property
    def batch(self) -> int:
        return self.lengths.shape[0]

    @property
    def page_size(self) -> int | None:
        """P for a paged cache, None for a contiguous one."""
        return self.k[0].shape[1] if self.is_paged else None

    @property
    def capacity(self) -> int:
        """Tokens one row can hold: S_max, or ``max_pages * P`` when paged."""
        if self.is_paged:
            return self.block_table.shape[1] * self.k[0].shape[1]
        return self.k[0].shape[1]


def ring_pages_for(window: int, max_tokens: int, page_size: int) -> int:
    """Least ring size R for a layer with a window of ``window`` keys fed at most
    ``max_tokens`` tokens per call: the most pages that the ``n = window - 1 + max_tokens``
    consecutive positions a call can see (its queries' windows and its new keys) can touch,
    ``ceil((n - 1) / page_size) + 1``; then no two of them share a slot."""
    return -(-(window + max_tokens - 2) // page_size) + 1


@functools.lru_cache(maxsize=64)
def _zeros(shape, dtype, count: int, sharding):
    """A jitted ``() -> count`` zero arrays of ``shape``: one dispatch for a whole cache (a
    dispatch per layer's K and V cost about 1 ms of a generate call for code-target's 16)."""
    out = None if sharding is None else (sharding,) * count
    return jax.jit(lambda: tuple(jnp.zeros(shape, dtype) for _ in range(count)), out_shardings=out)
