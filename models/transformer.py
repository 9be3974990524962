"""A Llama-family decoder as Flax NNX modules; every attention call goes through ``pallas_attn``.

Token embedding -> ``num_layers`` x [x + Attn(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] -> RMSNorm ->
LM head. Attention is GQA with RoPE (rotate-half / GPT-NeoX pairing, as Hugging Face Llama),
optional q/k/v bias (Qwen2), sliding window (Mistral) and score softcap (Gemma-2).

Two call forms:

* ``logits = model(tokens, positions=None, segment_ids=None)``: full causal forward through
  ``pallas_attn.flash_attention`` (differentiable; packed sequences via ``segment_ids``).
* ``logits, cache = model(tokens, positions=None, cache=cache)``: writes the T new keys/values
  into the :class:`~models.kv_cache.KVCache` and attends over ``[0, lengths + T)`` through
  ``pallas_attn.attention_with_kvcache``; returns the cache with ``lengths + T``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

import pallas_attn
from models.config import TransformerConfig
from models.kv_cache import KVCache
from models.shard import constrain_batch, local_heads

_INIT = nnx.initializers.normal(stddev=0.02)


class RMSNorm(nnx.Module):
    """``x / rms(x) * weight``, statistics in float32 (as Hugging Face's ``LlamaRMSNorm``)."""

    def __init__(self, dim: int, *, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


def rope_frequencies(config: TransformerConfig):
    """Inverse frequencies [D/2] float32, with Llama-3 scaling when ``config.rope_scaling``."""
    D = config.resolved_head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    wavelen = 2 * jnp.pi / inv_freq
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / s.factor, interpolated)
    return jnp.where(wavelen < high_wavelen, inv_freq, scaled)


def rope_tables(config: TransformerConfig, positions):
    """``(cos, sin)``, each [B, T, D/2] float32, for integer ``positions`` [B, T]."""
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(config)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotates dims ``(i, i + D/2)`` of x [B, T, H, D] by the angles of ``cos``/``sin`` [B, T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _linear(d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=dtype, kernel_init=_INIT, rngs=rngs
    )


class Attention(nnx.Module):
    """GQA self-attention: q/k/v projections, RoPE, ``pallas_attn``, output projection."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        D, dt = config.resolved_head_dim, config.jnp_dtype
        bias = config.qkv_bias
        self.q_proj = _linear(config.dim, config.num_heads * D, bias=bias, dtype=dt, rngs=rngs)
        self.k_proj = _linear(config.dim, config.num_kv_heads * D, bias=bias, dtype=dt, rngs=rngs)
        self.v_proj = _linear(config.dim, config.num_kv_heads * D, bias=bias, dtype=dt, rngs=rngs)
        self.o_proj = _linear(config.num_heads * D, config.dim, bias=False, dtype=dt, rngs=rngs)
        self.mesh = None  # set by models.shard

    def __call__(self, x, cos, sin, *, segment_ids=None, kv=None, tree_mask=None):
        """x: [B, T, dim]. ``kv`` is ``(k_cache, v_cache, lengths, block_table)`` for a cached
        call; returns ``(y, (k_cache, v_cache))`` then, else ``y`` [B, T, dim]. ``tree_mask``
        [B, T, T] bool (cached calls): ``attention_with_kvcache``'s tree attention."""
        c = self.config
        B, T, _ = x.shape
        D = c.resolved_head_dim
        q = apply_rope(self.q_proj(x).reshape(B, T, c.num_heads, D), cos, sin)
        k = apply_rope(self.k_proj(x).reshape(B, T, c.num_kv_heads, D), cos, sin)
        v = self.v_proj(x).reshape(B, T, c.num_kv_heads, D)
        attend = self._attend
        if tree_mask is not None:
            if self.mesh is not None:
                raise ValueError("tree_mask is not supported on a sharded model (mesh)")
            attend = functools.partial(self._attend, tree_mask=tree_mask)
        if self.mesh is not None:  # models.shard: per device, on its local heads
            paged = kv is not None and kv[3] is not None
            attend = local_heads(attend, self.mesh, batch=B, cached=kv is not None, paged=paged)
        res = attend(q, k, v, segment_ids, kv)
        out, new_kv = res if kv is not None else (res, None)
        y = self.o_proj(out.reshape(B, T, c.num_heads * D))
        return y if kv is None else (y, new_kv)

    def _attend(self, q, k, v, segment_ids, kv, tree_mask=None):
        """``pallas_attn`` on q [B, T, Hq, D], k/v [B, T, Hkv, D] -> out [B, T, Hq, D], or
        ``(out, (k_cache, v_cache))`` for a cached call."""
        c = self.config
        common = dict(causal=True, window_size=c.window_size, softcap=c.attn_softcap)
        if kv is None:
            return pallas_attn.flash_attention(
                q,
                k,
                v,
                q_segment_ids=segment_ids,
                kv_segment_ids=segment_ids,
                impl=c.attn_impl,
                **common,
            )
        k_cache, v_cache, lengths, block_table = kv
        res = pallas_attn.attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens=lengths,
            block_table=block_table,
            impl=c.attn_impl,
            tree_mask=tree_mask,
            **common,
        )
        return res.out, (res.k_cache, res.v_cache)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        dt = config.jnp_dtype
        self.gate_proj = _linear(config.dim, config.mlp_dim, bias=False, dtype=dt, rngs=rngs)
        self.up_proj = _linear(config.dim, config.mlp_dim, bias=False, dtype=dt, rngs=rngs)
        self.down_proj = _linear(config.mlp_dim, config.dim, bias=False, dtype=dt, rngs=rngs)

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """Pre-norm residual block: attention then MLP."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        dt = config.jnp_dtype
        self.input_norm = RMSNorm(config.dim, eps=config.norm_eps, dtype=dt)
        self.attn = Attention(config, rngs=rngs)
        self.post_attn_norm = RMSNorm(config.dim, eps=config.norm_eps, dtype=dt)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, cos, sin, *, segment_ids=None, kv=None, tree_mask=None):
        h = self.attn(
            self.input_norm(x), cos, sin, segment_ids=segment_ids, kv=kv, tree_mask=tree_mask
        )
        h, new_kv = h if kv is not None else (h, None)
        x = x + h
        x = x + self.mlp(self.post_attn_norm(x))
        return x, new_kv


def positions_from_segments(segment_ids):
    """Position of each token inside its segment: [B, T] -> [B, T] int32 (0 at each start)."""
    T = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), segment_ids.shape)
    start = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )
    return idx - lax.cummax(jnp.where(start, idx, 0), axis=1)


class Transformer(nnx.Module):
    """The decoder. ``model.config`` is its :class:`~models.config.TransformerConfig`."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        dt = config.jnp_dtype
        self.embed = nnx.Embed(
            config.vocab_size,
            config.dim,
            dtype=dt,
            param_dtype=dt,
            embedding_init=_INIT,
            rngs=rngs,
        )
        self.layers = nnx.List([Block(config, rngs=rngs) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.dim, eps=config.norm_eps, dtype=dt)
        self.lm_head = (
            None
            if config.tie_embeddings
            else _linear(config.dim, config.vocab_size, bias=False, dtype=dt, rngs=rngs)
        )
        self.mesh = None  # set by models.shard (jax.sharding.Mesh)

    def __call__(
        self,
        tokens,
        positions=None,
        *,
        segment_ids=None,
        cache: KVCache | None = None,
        return_hidden: bool = False,
        tree_mask=None,
    ):
        """Logits [B, T, V] float32 for tokens [B, T] int32.

        Args:
          tokens: [B, T] int32.
          positions: [B, T] int RoPE positions. Default: ``arange(T)`` restarted at every
            segment start (full forward) or ``cache.lengths[:, None] + arange(T)`` (cached).
          segment_ids: [B, T] int, packed sequences; a token only attends to its own segment.
            Not allowed with ``cache``.
          cache: a :class:`KVCache`; when given the call returns ``(logits, new_cache)``.
          return_hidden: also return the last hidden state [B, T, dim] (after the final norm,
            what the LM head reads) as the last element: ``(logits, [new_cache,] hidden)``.
          tree_mask: [B, T, T] bool, with ``cache``: token i attends to the cache and to the new
            tokens j with ``tree_mask[b, i, j]`` (a speculative token tree: itself and its
            ancestors; pass their depths in ``positions``).
        """
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be a [B, T] int array, got {tokens.shape} {tokens.dtype}"
            )
        B, T = tokens.shape
        if cache is not None and segment_ids is not None:
            raise ValueError("segment_ids cannot be combined with cache")
        if positions is None:
            if cache is not None:
                positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)
            elif segment_ids is not None:
                positions = positions_from_segments(jnp.asarray(segment_ids))
            else:
                positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        cos, sin = rope_tables(self.config, jnp.broadcast_to(positions, (B, T)))
        x = constrain_batch(self.embed(tokens), self.mesh)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            kv = None
            if cache is not None:
                kv = (cache.k[i], cache.v[i], cache.lengths, cache.block_table)
            x, layer_kv = layer(x, cos, sin, segment_ids=segment_ids, kv=kv, tree_mask=tree_mask)
            if layer_kv is not None:
                new_k.append(layer_kv[0])
                new_v.append(layer_kv[1])
        hidden = self.norm(x)
        out = (self.logits(hidden),)
        if cache is not None:
            out += (cache.replace(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths + T),)
        if return_hidden:
            out += (hidden,)
        return out if len(out) > 1 else out[0]

    def logits(self, h):
        """LM head on final hidden states h [B, T, dim] -> [B, T, V] float32 (with softcap)."""
        if self.lm_head is None:
            logits = self.embed.attend(h)
        else:
            logits = self.lm_head(h)
        logits = logits.astype(jnp.float32)
        c = self.config.final_softcap
        return c * jnp.tanh(logits / c) if c > 0 else logits
