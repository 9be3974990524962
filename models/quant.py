"""Block-quantized linear layers: GGUF's Q8_0, Q4_0 and Q4_1 weights, for decoding.

A decode step reads every weight once, so its speed is set by the bytes per weight. Each format
cuts a weight column (one output feature) into blocks of :data:`BLOCK` = 32 consecutive input
features with one float16 scale ``d`` per block (and a float16 minimum ``m`` for Q4_1):

* ``q8_0``: ``w = d * q``, ``q`` int8 in [-127, 127], ``d = max|w| / 127``; 8.5 bits per weight.
* ``q4_0``: ``w = d * (q - 8)``, ``q`` in [0, 15], ``d = -(the weight of largest |w|) / 8``; 4.5.
* ``q4_1``: ``w = d * q + m``, ``q`` in [0, 15], ``d = (max - min) / 15``, ``m = min``; 5 bits.

The arithmetic is that of GGUF's reference (``gguf.quants``, itself bit-exact with
``ggml-quants.c``): :func:`quantize_array` produces the same blocks and :func:`dequantize_array`
the same float32 values, so the blocks of a GGUF file survive dequantization and quantization
unchanged (tests/models/test_quant.py checks both against ``gguf.quants`` on random data and on
the shipped file).

:func:`quantize` replaces a model's :class:`~models.linear.Linear` layers (and a tied LM
head, as a separate quantized copy of the embedding: the embedding gather and the norms stay in
float) with :class:`QuantLinear`. Its products:

* few rows on CPU (decode steps, speculative verification; after
  :func:`models.transformer.attach_decode_weights`): ``rows_matmul.cc``'s quantized kernel, which
  by default quantizes the activations to 8-bit blocks of 32 (a float32 scale each) and takes
  each block's dot product in int32 (VNNI): ``activations="q8"``. With ``"f32"``
  (:func:`set_activations`) it dequantizes each weight in registers to exactly the float32 value
  above and accumulates in float32 in the same order as the float kernel: the result equals the
  float kernel on the dequantized weights bit for bit;
* everything else (prefill, GPU): the weights are dequantized to the activation dtype in the
  program (``convert`` + multiply, fused by XLA into the product's operand) and multiplied.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from models import rows_matmul
from models.linear import Linear, few_rows
from pallas_attn import native

FORMATS = rows_matmul.FORMATS  # ("q8_0", "q4_0", "q4_1")
BLOCK = rows_matmul.BLOCK
BITS = {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0}  # stored bits per weight

# GGUF tensor types kept as they are, and the nearest kept format of every other type (the
# type's bits and whether it has a minimum): requantized from its dequantized weights.
GGUF_FORMATS = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}
_NEAREST = {
    "F32": "q8_0",
    "F16": "q8_0",
    "BF16": "q8_0",
    "Q8_1": "q8_0",
    "Q8_K": "q8_0",
    "Q6_K": "q8_0",
    "Q5_0": "q8_0",
    "Q5_1": "q8_0",
    "Q5_K": "q8_0",
    "Q4_K": "q4_1",
    "Q2_K": "q4_1",
    "Q3_K": "q4_0",
    "IQ4_NL": "q4_0",
    "IQ4_XS": "q4_0",
}


def check_format(fmt) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    return fmt


def _blocks(w, name: str) -> np.ndarray:
    """w [K, N] -> float32 [K / 32, 32, N] (blocks along K); ValueError naming ``name``."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[0] % BLOCK:
        raise ValueError(
            f"{name}: weights [K, N] with K a multiple of {BLOCK} to quantize, got {w.shape}"
        )
    return w.reshape(w.shape[0] // BLOCK, BLOCK, w.shape[1])


def _roundf(v):
    """Round half away from zero, in gguf.quants' float32 arithmetic."""
    a = np.abs(v)
    f = np.floor(a)
    return np.sign(v) * (f + np.floor(2 * (a - f)))


def _inverse(d):
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


def quantize_array(w, fmt: str, name: str = "w") -> dict[str, np.ndarray]:
    """Float weights ``w [K, N]`` (blocks along K: a column is one GGUF row) -> the arrays of a
    :class:`QuantLinear`: ``quants`` ([K, N] int8 for q8_0; [K / 2, N] uint8 for q4, row
    16 b + j of block b holding its weights j (low nibble) and 16 + j (high nibble)), ``scales``
    [K / 32, N] float16 and, for q4_1, ``mins`` [K / 32, N] float16. The numerics of
    ``gguf.quants``. ValueError for an unknown format or K not a multiple of 32 (naming ``name``)."""
    check_format(fmt)
    b = _blocks(w, name)
    if fmt == "q8_0":
        d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
        q = _roundf(b * _inverse(d)).astype(np.int8)
        return dict(quants=q.reshape(w.shape), scales=d[:, 0].astype(np.float16))
    if fmt == "q4_0":
        top = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)
        d = top / np.float32(-8)
        q = np.trunc(b * _inverse(d) + np.float32(8.5)).astype(np.uint8).clip(0, 15)
        out = dict(scales=d[:, 0].astype(np.float16))
    else:
        lo, hi = b.min(axis=1, keepdims=True), b.max(axis=1, keepdims=True)
        d = (hi - lo) / np.float32(15)
        q = np.trunc((b - lo) * _inverse(d) + np.float32(0.5)).astype(np.uint8).clip(0, 15)
        out = dict(scales=d[:, 0].astype(np.float16), mins=lo[:, 0].astype(np.float16))
    packed = q[:, :16] | (q[:, 16:] << np.uint8(4))  # [K / 32, 16, N]
    return dict(quants=packed.reshape(-1, b.shape[2]), **out)


def _unpack(xp, fmt: str, quants):
    """quants -> the integer part of each weight, [K / 32, 32, N] float32."""
    nb = quants.shape[0] // (32 if fmt == "q8_0" else 16)
    if fmt == "q8_0":
        return quants.reshape(nb, BLOCK, -1).astype(np.float32)
    q = quants.reshape(nb, 16, -1)
    return xp.concatenate([q & 15, q >> 4], axis=1).astype(np.float32)


def _dequantize(xp, fmt: str, quants, scales, mins=None):
    q = _unpack(xp, fmt, quants)
    d = scales.astype(np.float32)[:, None, :]
    if fmt == "q8_0":
        w = q * d
    elif fmt == "q4_0":
        w = (q - np.float32(8)) * d
    else:
        w = q * d + mins.astype(np.float32)[:, None, :]
    return w.reshape(-1, w.shape[-1])


# Rows up to which a product on a non-CPU backend multiplies the blocks' integers directly
# (block_matmul) instead of dequantizing W first: its [K / 32, rows, N] float32 partial sums cost
# rows / 8 times the Q8_0 weights' bytes, so past 8 rows dequantizing once is the cheaper pass.
BLOCK_DOT_ROWS = 8
# Formats whose GPU programs take block_matmul for few rows. XLA's GPU compiler fuses Q8_0's
# int8 -> bfloat16 convert into its GEMM, so the blocks are read as stored; a Q4 format's nibble
# unpacking (and, shift) it does not fuse: it writes the unpacked weights in bfloat16 first, as
# dequantizing does, and the partial sums would only add to that.
BLOCK_DOT_FORMATS = ("q8_0",)


def block_matmul(x, fmt: str, quants, scales, mins=None):
    """``x [..., K] @ W`` for block-quantized ``W`` without materialising W: per block b, the
    integers' product ``p_b = x_b @ q_b`` (exact integers in the operand dtype, float32
    accumulation; one batched product over the blocks, which XLA's GPU compiler fuses with
    Q8_0's int8 convert, so those blocks are read once as stored), then
    ``y = sum_b d_b p_b`` (Q8_0), ``sum_b d_b (p_b - 8 s_b)`` (Q4_0) or ``sum_b d_b p_b + m_b s_b``
    (Q4_1), s_b the block's activation sum. Returns float32. The dequantizing product rounds
    ``d q`` to the activation dtype first; this does not, so the two differ by that rounding."""
    check_format(fmt)
    K, N = x.shape[-1], scales.shape[-1]
    nb = K // BLOCK
    lead = x.shape[:-1]
    xb = x.reshape(-1, nb, BLOCK).transpose(1, 0, 2)  # [nb, M, 32]
    batch = (((2,), (1,)), ((0,), (0,)))

    def dot(xs, q):
        return lax.dot_general(xs, q.astype(x.dtype), batch, preferred_element_type=jnp.float32)

    if fmt == "q8_0":
        part = dot(xb, quants.reshape(nb, BLOCK, N))
    else:  # row 16 b + j of quants: weight j (low nibble) and 16 + j (high nibble) of block b
        q = quants.reshape(nb, 16, N)
        part = dot(xb[..., :16], q & 15) + dot(xb[..., 16:], q >> 4)
    d = scales.astype(jnp.float32)[:, None, :]  # [nb, 1, N]
    if fmt == "q8_0":
        y = jnp.sum(part * d, axis=0)
    else:
        s = jnp.sum(xb.astype(jnp.float32), axis=2)[:, :, None]  # [nb, M, 1]
        if fmt == "q4_0":
            y = jnp.sum((part - 8 * s) * d, axis=0)
        else:
            y = jnp.sum(part * d + s * mins.astype(jnp.float32)[:, None, :], axis=0)
    return y.reshape(*lead, N)


def dequantize_array(fmt: str, quants, scales, mins=None) -> np.ndarray:
    """Inverse of :func:`quantize_array`: float32 [K, N], gguf.quants' values exactly."""
    check_format(fmt)
    return _dequantize(np, fmt, np.asarray(quants), np.asarray(scales), mins)


class QuantWeight(nnx.Param):
    """The blocks of a :class:`QuantLinear` (integer quants, float16 scales and minimums)."""


class QuantLinear(nnx.Module):
    """``y = x @ W (+ bias)`` with ``W [in_features, out_features]`` block-quantized (``fmt``).

    ``dtype``: the activation dtype (inputs are cast to it, outputs are in it). Few-row calls on
    CPU after :func:`models.transformer.attach_decode_weights` use the quantized kernel; in a
    program for another backend (GPU), Q8_0 products of at most :data:`BLOCK_DOT_ROWS` rows
    multiply the blocks' integers (:func:`block_matmul`); the others dequantize ``W`` to
    ``dtype`` and multiply (as :class:`~models.linear.Linear` would the dequantized weights)."""

    packed_kernel = None  # models.linear.PackedWeights: panels of rows_matmul.pack_quantized
    # The few-row kernel's activations: "q8" | "f32" | None (rows_matmul.DEFAULT_ACTIVATIONS);
    # set_activations sets it on a model's layers.
    activations = None

    def __init__(self, fmt: str, arrays: Mapping, *, bias=None, dtype=jnp.float32):
        self.fmt = check_format(fmt)
        self.in_features = int(arrays["scales"].shape[0]) * BLOCK
        self.out_features = int(arrays["scales"].shape[1])
        self.dtype = jnp.dtype(dtype)
        self.quants = QuantWeight(jnp.asarray(arrays["quants"]))
        self.scales = QuantWeight(jnp.asarray(arrays["scales"]))
        self.mins = QuantWeight(jnp.asarray(arrays["mins"])) if fmt == "q4_1" else None
        self.bias = None if bias is None else nnx.Param(jnp.asarray(bias, dtype))

    def arrays(self) -> dict[str, jax.Array]:
        out = dict(quants=self.quants[...], scales=self.scales[...])
        if self.mins is not None:
            out["mins"] = self.mins[...]
        return out

    def weight(self, dtype=None) -> jax.Array:
        """The dequantized ``W [in_features, out_features]`` (float32, or ``dtype``)."""
        a = self.arrays()
        w = _dequantize(jnp, self.fmt, a["quants"], a["scales"], a.get("mins"))
        return w if dtype is None else w.astype(dtype)

    def __call__(self, x):
        if self.packed_kernel is None or not few_rows(x):
            return self._plain(x)
        return native.on_cpu(self._packed, self._plain, x)

    def _plain(self, x):
        x = x.astype(self.dtype)
        if self.fmt in BLOCK_DOT_FORMATS and x.size // x.shape[-1] <= BLOCK_DOT_ROWS:
            y = native.on_cpu(self._dequantized, self._block_product, x)
        else:
            y = self._dequantized(x)
        return y if self.bias is None else y + self.bias[...]

    def _dequantized(self, x):
        return lax.dot_general(x, self.weight(self.dtype), (((x.ndim - 1,), (0,)), ((), ())))

    def _block_product(self, x):
        # Programs for other backends: on CPU, few rows take the native kernel (_packed).
        a = self.arrays()
        return block_matmul(x, self.fmt, a["quants"], a["scales"], a.get("mins")).astype(x.dtype)

    def _packed(self, x):
        y = rows_matmul.matmul_quantized(
            x.astype(self.dtype),
            self.packed_kernel[...],
            self.out_features,
            self.fmt,
            self.activations,
        ).astype(self.dtype)
        return y if self.bias is None else y + self.bias[...]


def set_activations(model, activations):
    """Sets the few-row kernel's activations of every :class:`QuantLinear` of ``model`` (in
    place; returns ``model``): ``"q8"`` (8-bit activation blocks, integer dot products), ``"f32"``
    (float32 activations: the dequantized float model's results bit for bit) or None (the
    default, :data:`models.rows_matmul.DEFAULT_ACTIVATIONS`). ValueError for another value."""
    if activations is not None:
        rows_matmul.check_activations(activations)
    for _, m in nnx.iter_modules(model):
        if isinstance(m, QuantLinear):
            m.activations = activations
    return model


def _linears(model):
    """(path, parent, attribute, module) of every Linear / QuantLinear of ``model``."""
    out = []
    for path, m in nnx.iter_modules(model):
        if isinstance(m, (Linear, QuantLinear)) and path:
            parent = model
            for p in path[:-1]:
                parent = parent[p] if isinstance(p, int) else getattr(parent, p)
            out.append(("/".join(map(str, path)), parent, path[-1], m))
    return out


def _set(parent, attr, value):
    if isinstance(attr, int):
        parent[attr] = value
    else:
        setattr(parent, attr, value)


def quantize(model, fmt, *, dtype=None):
    """A copy of ``model`` (a :class:`~models.transformer.Transformer`, or any module with
    :class:`~models.linear.Linear` layers) with its linear layers block-quantized.

    Args:
      fmt: ``"q8_0"``, ``"q4_0"`` or ``"q4_1"`` for every layer, or a mapping from module path
        (``"layers/0/attn/qkv_proj"``, ``"lm_head"``) to format; layers it does not name stay
        float.
      dtype: the activation dtype of the result (its embedding, norms and quantized layers'
        inputs and outputs). Default: the model's.

    A tied LM head (``lm_head`` None) gets a quantized copy of the embedding as ``lm_head``
    (path ``"lm_head"``): the embedding gather and the norms stay float. The blocks come from
    the float32 value of each weight. ValueError for an unknown format, or a layer whose input
    features are not a multiple of 32 (named), or a sharded model.
    """
    if isinstance(fmt, str):
        check_format(fmt)
        formats = None
    else:
        formats = {k: check_format(v) for k, v in dict(fmt).items()}
    if getattr(model, "mesh", None) is not None:
        raise ValueError("quantize: a sharded model (mesh) is not supported; quantize before")
    model = nnx.merge(*nnx.split(model))  # a new module tree over the same arrays
    layers = _linears(model)
    embed = getattr(model, "embed", None)
    tied = embed is not None and hasattr(model, "lm_head") and model.lm_head is None
    want = lambda path: fmt if formats is None else formats.get(path)  # noqa: E731
    bad = [
        f"{p} ({m.in_features} input features)"
        for p, _, _, m in layers
        if want(p) and isinstance(m, Linear) and m.in_features % BLOCK
    ]
    if tied and want("lm_head") and embed.features % BLOCK:
        bad.append(f"lm_head (the tied embedding, {embed.features} features)")
    if bad:
        raise ValueError(
            f"quantize: input features must be a multiple of {BLOCK}: {', '.join(bad)}"
        )
    if tied and want("lm_head"):
        w = np.asarray(embed.embedding[...], np.float32).T
        head = QuantLinear(
            want("lm_head"), quantize_array(w, want("lm_head"), "lm_head"), dtype=embed.dtype
        )
        model.lm_head = nnx.data(head)  # None (static) before
    for path, parent, attr, m in layers:
        f = want(path)
        if f is None or isinstance(m, QuantLinear):
            continue
        w = np.asarray(m.kernel[...], np.float32)
        bias = None if m.bias is None else m.bias[...]
        dt = m.dtype or m.param_dtype
        _set(parent, attr, QuantLinear(f, quantize_array(w, f, path), bias=bias, dtype=dt))
    return model if dtype is None else _cast(model, jnp.dtype(dtype))


def _cast(model, dtype):
    """``model`` with its float parameters and activations in ``dtype`` (quantized blocks kept)."""
    for _, m in nnx.iter_modules(model):
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "dtype") and hasattr(config, "replace"):
            kv = getattr(config, "kv_dtype", None)  # a narrow cache stays where it is valid
            keep = kv is None or dtype.name == "float32" or kv == dtype.name
            extra = {} if keep else {"kv_dtype": None}
            m.config = config.replace(dtype=dtype.name, **extra)
        for attr in ("dtype", "param_dtype"):
            if getattr(m, attr, None) is not None and not isinstance(
                getattr(m, attr), nnx.Variable
            ):
                setattr(m, attr, dtype)
    state = nnx.state(model, nnx.Not(QuantWeight))
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
    nnx.update(model, jax.tree.map(cast, state))
    return model


def dequantize(model):
    """A copy of ``model`` with every :class:`QuantLinear` replaced by a float
    :class:`~models.linear.Linear` holding the dequantized weights (in the layer's
    activation dtype: exactly the quantized values in float32). A tied model's quantized head
    stays a separate ``lm_head``."""
    model = nnx.merge(*nnx.split(model))
    for _, parent, attr, m in _linears(model):
        if not isinstance(m, QuantLinear):
            continue
        lin = Linear(
            m.in_features,
            m.out_features,
            use_bias=m.bias is not None,
            dtype=m.dtype,
            param_dtype=m.dtype,
            rngs=nnx.Rngs(0),
        )
        lin.kernel[...] = m.weight(m.dtype)
        if m.bias is not None:
            lin.bias[...] = m.bias[...]
        _set(parent, attr, lin)
    return model


def formats_from_gguf(tensor_types: Mapping[str, str], *, tied: bool) -> dict[str, str]:
    """The format of each linear layer of a model loaded from a GGUF file with these tensor
    types (``{"blk.0.attn_q.weight": "Q4_1", ...}``): the file's own where it is one of
    :data:`GGUF_FORMATS`, else the nearest one (a warning names every conversion). A fused
    layer (qkv, gate/up) whose parts differ takes the most precise of their formats."""
    parts = {
        "attn_q": "attn/qkv_proj",
        "attn_k": "attn/qkv_proj",
        "attn_v": "attn/qkv_proj",
        "attn_output": "attn/o_proj",
        "ffn_gate": "mlp/gate_up_proj",
        "ffn_up": "mlp/gate_up_proj",
        "ffn_down": "mlp/down_proj",
    }
    rank = {"q4_0": 0, "q4_1": 1, "q8_0": 2}
    out, converted = {}, {}
    for name, ttype in tensor_types.items():
        bits = name.split(".")
        if bits[0] == "blk" and len(bits) == 4 and bits[2] in parts:
            path = f"layers/{bits[1]}/{parts[bits[2]]}"
        elif name == "output.weight" or (tied and name == "token_embd.weight"):
            path = "lm_head"
        else:
            continue
        f = GGUF_FORMATS.get(ttype) or _NEAREST.get(ttype, "q8_0")
        if ttype not in GGUF_FORMATS:
            converted.setdefault(f"{ttype} -> {f}", []).append(name)
        if path not in out or rank[f] > rank[out[path]]:
            out[path] = f
    if converted:
        said = "; ".join(f"{k} ({len(v)} tensors, e.g. {v[0]})" for k, v in converted.items())
        warnings.warn(f"load_gguf(quantized=True): requantized {said}", stacklevel=3)
    return out
