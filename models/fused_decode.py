"""One native call per decoder layer for decode steps on CPU (``pallas_attn/native/decode_layer.cc``).

A decode step of a small model on XLA:CPU is dominated by the dozens of small ops each layer
runs around its four few-row products (RMSNorm, RoPE, the cache scatter, the attention call,
residual adds, SiLU * up): each costs microseconds for a few thousand values. The fused layer
does all of it in one FFI call that reuses the packed-panel products of
:mod:`models.rows_matmul` and the KV attention of :mod:`pallas_attn.cpu`, writing the new keys
and values into the cache in place (the caches are aliased to the call's outputs).

It applies (:func:`applies`, decided at trace time) to a cached call of a plain Llama-family
layer: no per-head q/k norm, no sandwich norms, plain ``x * w`` RMSNorms, a SiLU MLP, the
default or native attention, every projection carrying a packed copy
(:func:`models.transformer.attach_decode_weights`: float32/bfloat16 panels or Q8_0/Q4_0/Q4_1
blocks) with a bias on the fused qkv projection only, float32/bfloat16 activations and caches,
at most ``MAX_TOKENS`` new tokens per row and ``MAX_ROWS`` rows, no tree mask, no sharding.
Sliding windows and score softcaps are passed to the attention. Everything else runs the layer's
modules unchanged. Contiguous and paged caches are both supported (a contiguous cache is row
``b`` = page ``b`` of ``S`` positions).

Switches: ``PALLAS_ATTN_FUSED_DECODE=0`` in the environment (read when a program is traced) or
``model.fused_decode = False`` on a :class:`models.Transformer` (part of its graph, so jitted
callers compile a separate program) turn it off.

Numerics: with float32 activations the layer computes what the unfused one does up to float32
reassociation (the products and attention are the same kernels); with bfloat16 it rounds to
bfloat16 at each point where the unfused layer stores a bfloat16 value.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from models import quant, rows_matmul
from pallas_attn import masks, native

ENV = "PALLAS_ATTN_FUSED_DECODE"
MAX_TOKENS = 8  # new tokens per row: a decode step (1) or a short speculative verification
MAX_ROWS = rows_matmul.MAX_ROWS  # B * T
_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def enabled() -> bool:
    """Whether the environment allows the fused path and the native kernels are built."""
    return os.environ.get(ENV, "1") != "0" and native.available()


def _weights(linear, dtype, *, bias_ok: bool):
    """``(panels, kind)`` of a projection that the fused layer can multiply, else None."""
    packed = getattr(linear, "packed_kernel", None)
    if packed is None:
        return None
    panels = packed[...]
    if isinstance(linear, quant.QuantLinear):
        if linear.dtype != dtype or (linear.bias is not None and not bias_ok):
            return None
        # The kernel's fmt code, as QuantLinear's own call passes it (same activations).
        return panels, rows_matmul.kernel_format(linear.fmt, linear.activations)
    if (linear.dtype or dtype) != dtype or (
        getattr(linear, "bias", None) is not None and not bias_ok
    ):
        return None
    fmt = jnp.dtype(panels.dtype).name
    # The layer's rows have the in_features stride; bfloat16 panels pad an odd K to even.
    if fmt not in ("float32", "bfloat16") or panels.shape[1] != linear.in_features:
        return None
    return panels, rows_matmul.kernel_format(fmt)  # as Linear's own call (default activations)


def applies(block, x, kv, *, tree_mask=None, segment_ids=None, mesh=None) -> bool:
    """Whether :func:`layer` can run ``block`` (a :class:`models.transformer.Block`) on
    ``x`` [B, T, dim] with ``kv = (k_cache, v_cache, lengths, block_table)``. Trace-time only:
    shapes, dtypes and the modules' structure."""
    if kv is None or tree_mask is not None or segment_ids is not None or mesh is not None:
        return False
    attn, mlp = block.attn, block.mlp
    c = attn.config
    B, T, _ = x.shape
    k_cache, v_cache = kv[0], kv[1]
    dtype = jnp.dtype(x.dtype)
    ok = (
        T <= MAX_TOKENS
        and B * T <= MAX_ROWS
        and dtype in _DTYPES
        and jnp.dtype(k_cache.dtype) in _DTYPES
        and k_cache.dtype == v_cache.dtype
        and k_cache.ndim == 4
        and attn.q_norm is None
        and attn.mesh is None
        and block.attn_out_norm is None
        and block.mlp_out_norm is None
        and not c.norm_plus_one
        and mlp.act != "gelu_tanh"
        and c.attn_impl in ("auto", "native")
        and c.resolved_head_dim % 2 == 0
        and jax.default_backend() == "cpu"
    )
    if not ok:
        return False
    weights = (
        _weights(attn.qkv_proj, dtype, bias_ok=True),
        _weights(attn.o_proj, dtype, bias_ok=False),
        _weights(mlp.gate_up_proj, dtype, bias_ok=False),
        _weights(mlp.down_proj, dtype, bias_ok=False),
    )
    return all(w is not None for w in weights) and enabled()


def layer(block, x, cos, sin, kv):
    """The fused layer: ``(x', (k_cache', v_cache'))`` as ``block(x, cos, sin, kv=kv)`` returns
    them. ``x`` [B, T, dim]; ``cos``/``sin`` [B, T, D/2] float32 (or :func:`rope_tables`' dict
    of two bases: the layer's own is taken); caches written at ``lengths[b] + t``. Call only
    where :func:`applies`; on another platform's lowering the modules run instead."""
    attn, mlp = block.attn, block.mlp
    c = attn.config
    if isinstance(cos, dict):
        cos, sin = cos[attn.rope_kind], sin[attn.rope_kind]
    k_cache, v_cache, lengths, table = kv
    B, T, _ = x.shape
    if table is None:  # contiguous: row b is page b, of all S positions
        table = jnp.arange(B, dtype=jnp.int32)[:, None]
    dtype = jnp.dtype(x.dtype)
    (w_qkv, k_qkv), (w_o, k_o), (w_gu, k_gu), (w_down, k_down) = (
        _weights(attn.qkv_proj, dtype, bias_ok=True),
        _weights(attn.o_proj, dtype, bias_ok=False),
        _weights(mlp.gate_up_proj, dtype, bias_ok=False),
        _weights(mlp.down_proj, dtype, bias_ok=False),
    )
    bias = getattr(attn.qkv_proj, "bias", None)
    bias = jnp.zeros((0,), dtype) if bias is None else bias[...]
    D = c.resolved_head_dim
    scale = c.softmax_scale
    left, right = masks.normalize_window(True, attn.window_size)

    def fused(x, k_cache, v_cache):
        return jax.ffi.ffi_call(
            native.DECODE_LAYER,
            (
                jax.ShapeDtypeStruct(x.shape, x.dtype),
                jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
            ),
            input_output_aliases={3: 1, 4: 2},
            vmap_method="sequential",
        )(
            x,
            cos.astype(jnp.float32),
            sin.astype(jnp.float32),
            k_cache,
            v_cache,
            jnp.asarray(table, jnp.int32),
            jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), (B,)),
            block.input_norm.weight[...],
            w_qkv,
            bias,
            w_o,
            block.post_attn_norm.weight[...],
            w_gu,
            w_down,
            eps=np.float32(c.norm_eps),
            scale=np.float32(D**-0.5 if scale is None else scale),
            softcap=np.float32(c.attn_softcap or 0.0),
            left=np.int64(left),
            right=np.int64(right),
            num_heads=np.int64(c.num_heads),
            kind_qkv=np.int32(k_qkv),
            kind_o=np.int32(k_o),
            kind_gu=np.int32(k_gu),
            kind_down=np.int32(k_down),
        )

    def plain(x, k_cache, v_cache):
        y, (k, v) = block(x, cos, sin, kv=(k_cache, v_cache, lengths, kv[3]))
        return y, k, v

    y, k_cache, v_cache = native.on_cpu(fused, plain, x, k_cache, v_cache)
    return y, (k_cache, v_cache)
