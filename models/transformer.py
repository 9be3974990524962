"""A Llama-family decoder as Flax NNX modules; every attention call goes through ``pallas_attn``.

Token embedding -> ``num_layers`` x [x + Attn(RMSNorm(x)); x + SwiGLU(RMSNorm(x))] -> RMSNorm ->
LM head. Attention is GQA with RoPE (rotate-half / GPT-NeoX pairing, as Hugging Face Llama),
optional q/k/v bias (Qwen2), sliding window (Mistral) and score softcap (Gemma-2).

The other families are the same skeleton with pieces switched on by the config (each a
trace-time branch: a Llama layer runs none of their code): per-head q/k RMSNorm before RoPE
(Qwen3, Gemma 3); Gemma's ``(1 + w)`` norms, four per layer, ``sqrt(dim)``-scaled embedding,
GeGLU MLP and ``query_pre_attn_scalar`` softmax scale; per-layer sliding / global attention with
a RoPE base of each kind (Gemma 3, ``config.layer_types`` / ``local_rope_theta``).

Fused projections: each attention layer has one ``qkv_proj`` (dim -> (Hq + 2 Hkv) D) and each MLP
one ``gate_up_proj`` (dim -> 2 mlp_dim), so a decode step runs 4 matrix-vector products per layer
instead of 7. Their output features are grouped so that any contiguous split into ``tp`` equal
blocks (``models.shard``'s column parallelism) gives every device whole units: ``qkv_proj``
features are ``[Hkv, G + 2, D]`` (per KV head: its G query heads, its key, its value; query head
``h`` is ``(h // G, h % G)``), ``gate_up_proj`` features are ``[mlp_dim, 2]`` (gate, up of each
hidden unit). :func:`fuse_qkv` / :func:`split_qkv` and :func:`fuse_gate_up` /
:func:`split_gate_up` convert to and from the separate Hugging Face tensors.

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
import numpy as np
from flax import nnx
from jax import lax

import pallas_attn
from models import fused_decode as fused
from models import quant, rows_matmul
from models.config import TransformerConfig, kv_dtype_name
from models.kv_cache import KVCache
from models.linear import (  # also importable from here
    DECODE_MIN_WEIGHTS,
    Linear,
    PackedWeights,
    few_rows,
)
from models.sharding import constrain_batch, local_heads
from pallas_attn import native

_INIT = nnx.initializers.normal(stddev=0.02)


class RMSNorm(nnx.Module):
    """``x / rms(x) * weight``, statistics in float32 (as Hugging Face's ``LlamaRMSNorm``: the
    normalized x is cast back to x's dtype, then scaled).

    ``plus_one`` (Gemma): ``x / rms(x) * (1 + weight)``, the product in float32 and then cast
    (as ``Gemma3RMSNorm``); the weight starts at zero."""

    def __init__(self, dim: int, *, eps: float, dtype, plus_one: bool = False):
        self.weight = nnx.Param((jnp.zeros if plus_one else jnp.ones)((dim,), dtype))
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.plus_one:
            return (x32 * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * x32.astype(x.dtype)


def _norm(config: TransformerConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, eps=config.norm_eps, dtype=config.jnp_dtype, plus_one=config.norm_plus_one)


class Embed(nnx.Embed):
    """``nnx.Embed`` whose lookup is multiplied by ``scale`` (Gemma's ``sqrt(dim)``, rounded to
    the activation dtype first, as transformers does) when it is not None; ``attend`` (the tied
    LM head) is unscaled."""

    scale: float | None = None

    def __call__(self, inputs):
        table = self.embedding[...]
        if (
            native.widened_on_cpu(table.dtype)
            and self.dtype in (None, table.dtype)
            and self.num_embeddings > 1
            and jnp.issubdtype(inputs.dtype, jnp.integer)
        ):
            # XLA:CPU widens the table to float32 whole before gathering from it (113 MB
            # written per step for SmolLM2 in bfloat16); the rows' bits gather as
            # integers. Out-of-range ids: the unsigned fill 0xffff is a NaN, as jnp.take's.
            bits = jax.lax.bitcast_convert_type(table, jnp.uint16)
            x = jax.lax.bitcast_convert_type(jnp.take(bits, inputs, axis=0), table.dtype)
        else:
            x = super().__call__(inputs)
        if self.scale is None:
            return x
        return x * jnp.asarray(np.float32(self.scale)).astype(x.dtype)  # float32 first, as HF


def rope_frequencies(config: TransformerConfig, *, local: bool = False):
    """Inverse frequencies [D/2] float32, with Llama-3 scaling when ``config.rope_scaling``;
    ``local``: those of the sliding layers' own base ``config.local_rope_theta`` (unscaled)."""
    D = config.resolved_head_dim
    theta = config.local_rope_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))
    s = None if local else config.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "linear":
        return inv_freq / s.factor
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
    """``(cos, sin)``, each [B, T, D/2] float32, for integer ``positions`` [B, T].

    With ``config.local_rope_theta`` (layers of two RoPE bases) each is instead a dict
    ``{"global": [B, T, D/2], "local": [B, T, D/2]}``; every :class:`Block` takes its own."""
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(config)
    if config.local_rope_theta is None:
        return jnp.cos(angles), jnp.sin(angles)
    local = positions.astype(jnp.float32)[..., None] * rope_frequencies(config, local=True)
    return (
        {"global": jnp.cos(angles), "local": jnp.cos(local)},
        {"global": jnp.sin(angles), "local": jnp.sin(local)},
    )


def apply_rope(x, cos, sin):
    """Rotates dims ``(i, i + D/2)`` of x [B, T, H, D] by the angles of ``cos``/``sin`` [B, T, D/2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def fuse_qkv(q, k, v, num_kv_heads: int):
    """Separate q [..., Hq D], k, v [..., Hkv D] features (last axis) -> fused [..., Hkv (G+2) D]."""
    lead, Hkv = q.shape[:-1], num_kv_heads
    D = k.shape[-1] // Hkv
    parts = (q.reshape(*lead, Hkv, -1, D), k.reshape(*lead, Hkv, 1, D), v.reshape(*lead, Hkv, 1, D))
    return jnp.concatenate(parts, axis=-2).reshape(*lead, -1)


def split_qkv(w, num_kv_heads: int, head_dim: int):
    """Inverse of :func:`fuse_qkv`: fused [..., Hkv (G+2) D] -> (q, k, v) features."""
    lead = w.shape[:-1]
    g = w.reshape(*lead, num_kv_heads, -1, head_dim)
    return tuple(x.reshape(*lead, -1) for x in (g[..., :-2, :], g[..., -2, :], g[..., -1, :]))


def fuse_gate_up(gate, up):
    """gate, up [..., mlp_dim] features (last axis) -> fused [..., mlp_dim * 2], interleaved."""
    return jnp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


def split_gate_up(w):
    """Inverse of :func:`fuse_gate_up`: fused [..., mlp_dim * 2] -> (gate, up)."""
    g = w.reshape(*w.shape[:-1], -1, 2)
    return g[..., 0], g[..., 1]


def _packable(w) -> bool:
    return w.size >= DECODE_MIN_WEIGHTS and w.dtype in (jnp.float32, jnp.bfloat16)


def pack_decode_weights(model: nnx.Module, params=None) -> dict[str, jax.Array]:
    """Packed copies of ``model``'s weights for few-row products, by module path: each
    :class:`Linear` kernel of at least DECODE_MIN_WEIGHTS float32/bfloat16 weights, each
    :class:`models.quant.QuantLinear`'s blocks (:func:`models.rows_matmul.pack_quantized`), and a
    tied LM head's embedding (transposed) under ``"embed.T"``. Eager (outside jit), on CPU when
    :func:`models.rows_matmul.available`, else ``{}``. Cached per weight array
    (:func:`models.rows_matmul.packed`), so a model decoded again is not packed again. Pass the
    result into the jitted decode loop and attach it there with :func:`attach_decode_weights`.

    ``params``: ``nnx.split(model)[1]`` when the caller has it. The walk is over that state's
    flat paths (about 0.06 ms for the shipped target, where walking the modules takes 2.5 ms and
    this runs once per ``generate`` call)."""
    if jax.default_backend() != "cpu" or getattr(model, "mesh", None) is not None:
        return {}
    if not rows_matmul.available():
        return {}
    flat = dict(nnx.to_flat_state(nnx.state(model) if params is None else params))
    out = {}
    for path, var in flat.items():
        w = var[...]
        if path[-1] == "kernel" and w.ndim == 2 and _packable(w):  # a Linear's kernel
            out["/".join(map(str, path[:-1]))] = rows_matmul.packed(w)
        elif path[-1] == "quants" and (*path[:-1], "scales") in flat:  # a QuantLinear's blocks
            mins = flat.get((*path[:-1], "mins"))
            fmt = "q8_0" if w.dtype == jnp.int8 else "q4_0" if mins is None else "q4_1"
            scales = flat[(*path[:-1], "scales")][...]
            mins = None if mins is None else mins[...]
            out["/".join(map(str, path[:-1]))] = rows_matmul.packed_quantized(fmt, w, scales, mins)
        elif path[-2:] == ("embed", "embedding") and _packable(w):
            head = (*path[:-2], "lm_head")
            if (*head, "kernel") not in flat and (*head, "quants") not in flat:  # tied LM head
                out["/".join(map(str, (*path[:-2], "embed.T")))] = rows_matmul.packed(w, True)
    return out


def attach_decode_weights(model: nnx.Module, kernels: dict[str, jax.Array]) -> nnx.Module:
    """Attaches :func:`pack_decode_weights`' copies to ``model``'s modules (inside the jitted decode
    loop, where ``kernels`` is an argument); few-row calls then use them."""
    for path, m in nnx.iter_modules(model):
        key = "/".join(map(str, path))
        if isinstance(m, (Linear, quant.QuantLinear)) and key in kernels:
            m.packed_kernel = PackedWeights(kernels[key])
        elif (
            isinstance(m, Transformer)
            and (head := "/".join(map(str, (*path, "embed.T")))) in kernels
        ):
            m.packed_head = PackedWeights(kernels[head])
    return model


def _linear(d_in: int, d_out: int, *, bias: bool, dtype, rngs: nnx.Rngs) -> Linear:
    return Linear(
        d_in, d_out, use_bias=bias, dtype=dtype, param_dtype=dtype, kernel_init=_INIT, rngs=rngs
    )


class Attention(nnx.Module):
    """GQA self-attention: q/k/v projections, (per-head q/k RMSNorm,) RoPE, ``pallas_attn``,
    output projection. ``layer``: its index, for the per-layer window and RoPE base."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, layer: int = 0):
        self.config = config
        D, dt = config.resolved_head_dim, config.jnp_dtype
        features = (config.num_heads + 2 * config.num_kv_heads) * D
        self.qkv_proj = _linear(config.dim, features, bias=config.qkv_bias, dtype=dt, rngs=rngs)
        self.o_proj = _linear(config.num_heads * D, config.dim, bias=False, dtype=dt, rngs=rngs)
        self.q_norm = _norm(config, D) if config.qk_norm else None
        self.k_norm = _norm(config, D) if config.qk_norm else None
        self.window_size = config.layer_window(layer)
        self.rope_kind = (
            "local" if config.layer_rope_theta(layer) != config.rope_theta else "global"
        )
        self.mesh = None  # set by models.shard

    def __call__(self, x, cos, sin, *, segment_ids=None, kv=None, tree_mask=None, append=True):
        """x: [B, T, dim]. ``kv`` is ``(k_cache, v_cache, lengths, block_table)`` for a cached
        call; returns ``(y, (k_cache, v_cache))`` then, else ``y`` [B, T, dim]. ``tree_mask``
        [B, T, T] bool (cached calls): ``attention_with_kvcache``'s tree attention.
        ``append=False``: the cache already holds these T keys (its ``lengths`` count them);
        attend over it and write nothing (``KVCache.replay``)."""
        c = self.config
        B, T, _ = x.shape
        D = c.resolved_head_dim
        if isinstance(cos, dict):  # two RoPE bases (rope_tables): this layer's
            cos, sin = cos[self.rope_kind], sin[self.rope_kind]
        qkv = self.qkv_proj(x).reshape(B, T, c.num_kv_heads, -1, D)  # [B, T, Hkv, G + 2, D]
        q = qkv[:, :, :, :-2].reshape(B, T, c.num_heads, D)
        k = qkv[:, :, :, -2]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        v = qkv[:, :, :, -1]
        attend = self._attend
        if tree_mask is not None:
            if self.mesh is not None:
                raise ValueError("tree_mask is not supported on a sharded model (mesh)")
            attend = functools.partial(self._attend, tree_mask=tree_mask)
        if not append:
            if self.mesh is not None:
                raise ValueError("a replay (KVCache.replay) is not supported on a sharded model")
            attend = functools.partial(attend, append=False)
        if self.mesh is not None:  # models.shard: per device, on its local heads
            paged = kv is not None and kv[3] is not None
            attend = local_heads(attend, self.mesh, batch=B, cached=kv is not None, paged=paged)
        res = attend(q, k, v, segment_ids, kv)
        out, new_kv = res if kv is not None else (res, None)
        y = self.o_proj(out.reshape(B, T, c.num_heads * D))
        return y if kv is None else (y, new_kv)

    def _attend(self, q, k, v, segment_ids, kv, tree_mask=None, append=True):
        """``pallas_attn`` on q [B, T, Hq, D], k/v [B, T, Hkv, D] -> out [B, T, Hq, D], or
        ``(out, (k_cache, v_cache))`` for a cached call."""
        c = self.config
        common = dict(
            causal=True,
            window_size=self.window_size,
            softcap=c.attn_softcap,
            softmax_scale=c.softmax_scale,
        )
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
            k if append else None,
            v if append else None,
            cache_seqlens=lengths,
            block_table=block_table,
            impl=c.attn_impl,
            tree_mask=tree_mask,
            **common,
        )
        return res.out, (res.k_cache, res.v_cache)


class MLP(nnx.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``, gate and up as one fused ``gate_up_proj``;
    ``act`` is SiLU (SwiGLU) or tanh-approximated GELU (GeGLU, ``config.mlp_act``)."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        dt, M = config.jnp_dtype, config.mlp_dim
        self.gate_up_proj = _linear(config.dim, 2 * M, bias=False, dtype=dt, rngs=rngs)
        self.down_proj = _linear(M, config.dim, bias=False, dtype=dt, rngs=rngs)
        self.act = config.mlp_act

    def __call__(self, x):
        gate, up = split_gate_up(self.gate_up_proj(x))
        if self.act == "gelu_tanh":
            return self.down_proj(jax.nn.gelu(gate, approximate=True) * up)
        return self.down_proj(jax.nn.silu(gate) * up)


class Block(nnx.Module):
    """Pre-norm residual block: attention then MLP. With ``config.sandwich_norm`` (Gemma) the
    attention and MLP outputs are normed too (``attn_out_norm``, ``mlp_out_norm``) before their
    residual adds; ``post_attn_norm`` is always the norm in front of the MLP."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs, layer: int = 0):
        self.input_norm = _norm(config, config.dim)
        self.attn = Attention(config, rngs=rngs, layer=layer)
        self.post_attn_norm = _norm(config, config.dim)
        self.mlp = MLP(config, rngs=rngs)
        self.attn_out_norm = _norm(config, config.dim) if config.sandwich_norm else None
        self.mlp_out_norm = _norm(config, config.dim) if config.sandwich_norm else None

    def __call__(self, x, cos, sin, *, segment_ids=None, kv=None, tree_mask=None, append=True):
        h = self.attn(
            self.input_norm(x),
            cos,
            sin,
            segment_ids=segment_ids,
            kv=kv,
            tree_mask=tree_mask,
            append=append,
        )
        h, new_kv = h if kv is not None else (h, None)
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        x = x + h
        h = self.mlp(self.post_attn_norm(x))
        if self.mlp_out_norm is not None:
            h = self.mlp_out_norm(h)
        return x + h, new_kv


def positions_from_segments(segment_ids):
    """Position of each token inside its segment: [B, T] -> [B, T] int32 (0 at each start)."""
    T = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), segment_ids.shape)
    start = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )
    return idx - lax.cummax(jnp.where(start, idx, 0), axis=1)


def _rows_at(x, index):
    """x [B, T, dim] at position ``index[b]`` of each row -> [B, 1, dim]; ``index`` [B] int."""
    B = x.shape[0]
    index = jnp.asarray(index)
    if index.shape != (B,) or not jnp.issubdtype(index.dtype, jnp.integer):
        raise ValueError(
            f"logits_at must be a [B] = [{B}] int array, got {index.shape} {index.dtype}"
        )
    return x[jnp.arange(B), index][:, None]


class Transformer(nnx.Module):
    """The decoder. ``model.config`` is its :class:`~models.config.TransformerConfig`."""

    packed_head: PackedWeights | None = None  # tied LM head packed by attach_decode_weights
    fused_decode: bool = True  # False: cached calls never take models.fused_decode's layer

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        dt = config.jnp_dtype
        self.embed = Embed(
            config.vocab_size,
            config.dim,
            dtype=dt,
            param_dtype=dt,
            embedding_init=_INIT,
            rngs=rngs,
        )
        if config.embed_scale:
            self.embed.scale = config.dim**0.5
        self.layers = nnx.List(
            [Block(config, rngs=rngs, layer=i) for i in range(config.num_layers)]
        )
        self.norm = _norm(config, config.dim)
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
        logits_at=None,
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
          logits_at: [B] int, compute the LM head only at position ``logits_at[b]`` of each row
            (e.g. a prompt's last token): logits are then [B, 1, V], and a prefill does no
            vocabulary-sized work for the other T - 1 positions (``return_hidden`` still gives
            every position's hidden state, [B, T, dim]).
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
            kv, append = None, True
            if cache is not None:
                table = cache.block_table
                if cache.ring_pages is not None:  # trace time: only ring caches pay for it
                    table = cache.layer_table(self.config, i, T)
                kv = (cache.k[i], cache.v[i], cache.lengths, table)
                if cache.replay and not self.config.is_sliding(i):  # its keys are cached
                    kv, append = (cache.k[i], cache.v[i], cache.lengths + T, table), False
            if (
                append
                and self.fused_decode
                and fused.applies(
                    layer, x, kv, tree_mask=tree_mask, segment_ids=segment_ids, mesh=self.mesh
                )
            ):  # a decode step's layer as one native call on CPU (models/fused_decode.py)
                x, layer_kv = fused.layer(layer, x, cos, sin, kv)
            else:
                x, layer_kv = layer(
                    x, cos, sin, segment_ids=segment_ids, kv=kv, tree_mask=tree_mask, append=append
                )
            if layer_kv is not None:
                new_k.append(layer_kv[0])
                new_v.append(layer_kv[1])
        if logits_at is not None and return_hidden:
            hidden = self.norm(x)  # every position's: a draft's prefill reads them all
            out = (self.logits(_rows_at(hidden, logits_at)),)
        else:
            if logits_at is not None:
                x = _rows_at(x, logits_at)
            hidden = self.norm(x)
            out = (self.logits(hidden),)
        if cache is not None:
            out += (cache.replace(k=tuple(new_k), v=tuple(new_v), lengths=cache.lengths + T),)
        if return_hidden:
            out += (hidden,)
        return out if len(out) > 1 else out[0]

    def logits(self, h):
        """LM head on final hidden states h [B, T, dim] -> [B, T, V] float32 (with softcap)."""
        if self.packed_head is not None and few_rows(h, self.packed_head[...]):
            packed = lambda h: rows_matmul.matmul(  # noqa: E731
                h.astype(self.embed.dtype), self.packed_head[...], self.config.vocab_size
            )
            plain = lambda h: self.embed.attend(h).astype(jnp.float32)  # noqa: E731
            logits = native.on_cpu(packed, plain, h)  # both branches float32 (packed sums so)
        elif self.lm_head is None:
            logits = self.embed.attend(h)
        else:
            logits = self.lm_head(h)
        logits = logits.astype(jnp.float32)
        c = self.config.final_softcap
        return c * jnp.tanh(logits / c) if c > 0 else logits


RUNTIME_FIELDS = ("attn_impl", "kv_dtype")


def configure(model: nnx.Module, **changes) -> nnx.Module:
    """A copy of ``model`` (sharing its arrays) whose config, and every submodule's, has the
    runtime fields in ``changes`` replaced: ``attn_impl`` (the ``pallas_attn`` implementation)
    and ``kv_dtype`` (the dtype of the caches made for it from now on, e.g. ``"bfloat16"`` for a
    float32 or quantized model). Weights and shapes cannot change this way: any other field is a
    ValueError, as is a value :class:`TransformerConfig` rejects."""
    bad = sorted(set(changes) - set(RUNTIME_FIELDS))
    if bad:
        raise ValueError(f"configure: can only change {RUNTIME_FIELDS}, got {bad}")
    config = getattr(model, "config", None)
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"configure: model must have a TransformerConfig, got {type(model)}")
    if "kv_dtype" in changes:  # a name, a dtype or None, as the loaders take it
        changes["kv_dtype"] = kv_dtype_name(changes["kv_dtype"])
    new = config.replace(**changes)  # validates
    model = nnx.merge(*nnx.split(model))
    for _, m in nnx.iter_modules(model):
        if isinstance(getattr(m, "config", None), TransformerConfig):
            m.config = m.config.replace(**changes)
    assert model.config == new
    return model
