"""The KV cache: an explicit pytree that goes into every cached forward and comes back out.

Two layouts (the FlashAttention / vLLM ones, what ``pallas_attn.attention_with_kvcache`` takes):

* contiguous: one ``[B, S_max, Hkv, D]`` array per layer for keys and one for values;
* paged: one ``[num_pages, P, Hkv, D]`` array per layer, shared by all rows, and a
  ``block_table [B, max_pages]`` int32 mapping row ``b``'s logical page ``i`` (cache positions
  ``i * P .. i * P + P - 1``) to a physical page. Entries past a row's length may be -1; they are
  never read.

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
from models.shard import cache_shardings, check_mesh


@struct.dataclass
class KVCache:
    """Per-layer keys and values plus per-row lengths (and a block table when paged).

    Attributes:
      k, v: tuples with one array per layer: ``[B, S_max, Hkv, D]`` (contiguous) or
        ``[num_pages, P, Hkv, D]`` (paged). Keys are stored after RoPE.
      lengths: [B] int32, tokens already in each row.
      block_table: [B, max_pages] int32 for a paged cache, else None.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    block_table: jax.Array | None = None

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
    ) -> KVCache:
        """An empty paged cache of ``num_pages`` pages of ``page_size`` tokens.

        ``block_table`` [B, max_pages] int32 assigns physical pages to each row's logical pages;
        the caller (a page allocator) owns it and may replace it with ``cache.replace``.
        ``mesh``: create the pool sharded for a model sharded over it (``models.shard``): heads
        over "model", every page on every "data" shard.
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
        return cls._empty(config, shape, lengths, block_table.astype(jnp.int32), dtype, mesh)

    @classmethod
    def _empty(cls, config, shape, lengths, block_table, dtype, mesh) -> KVCache:
        dtype = config.jnp_dtype if dtype is None else jnp.dtype(dtype)
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


@functools.lru_cache(maxsize=64)
def _zeros(shape, dtype, count: int, sharding):
    """A jitted ``() -> count`` zero arrays of ``shape``: one dispatch for a whole cache (a
    dispatch per layer's K and V cost about 1 ms of a generate call for code-target's 16)."""
    out = None if sharding is None else (sharding,) * count
    return jax.jit(lambda: tuple(jnp.zeros(shape, dtype) for _ in range(count)), out_shardings=out)
