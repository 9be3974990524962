"""The model's linear layer and its packed copy for few-row products on CPU.

Below both ``models.transformer`` (which builds its layers from :class:`Linear` and re-exports
these names) and ``models.quant`` (whose ``QuantLinear`` takes the same packed copies and row
test), so neither imports the other to reach them.

Few-row products (decode steps of a batch, speculative verification) on CPU: XLA:CPU reads the
weights of [M, K] @ [K, N] for 2 <= M <= 16 at about half the rate of the packed-panel kernel
in models/rows_matmul.py (1.6-2.4x at M = 4..8, 1.0-1.5x at M = 1).
:func:`models.transformer.attach_decode_weights` gives each large enough Linear a packed copy,
used for calls of at most DECODE_MAX_ROWS rows; benchmarks/generate.py and
benchmarks/speculative.py measure it on the models.
"""

from __future__ import annotations

from flax import nnx

from models import rows_matmul
from pallas_attn import native

DECODE_MAX_ROWS = rows_matmul.MAX_ROWS
DECODE_MIN_WEIGHTS = 1 << 16  # kernel elements (256 x 256); smaller ones gain nothing


class PackedWeights(nnx.Variable):
    """A kernel packed by :func:`models.rows_matmul.pack` (made by
    :func:`models.transformer.pack_decode_weights`, attached by
    :func:`models.transformer.attach_decode_weights`; not a parameter)."""


def few_rows(x, packed=None) -> bool:
    """Whether ``x [..., K]`` has the few rows that :func:`models.rows_matmul.matmul` is for,
    or any number where the ``packed`` panels take any (:func:`models.rows_matmul.max_rows`)."""
    limit = DECODE_MAX_ROWS if packed is None else rows_matmul.max_rows(packed)
    return x.size // x.shape[-1] <= limit


class Linear(nnx.Linear):
    """``nnx.Linear`` (the same parameters and results); after
    :func:`models.transformer.attach_decode_weights`, inputs of few rows multiply a packed copy
    of the kernel (:func:`models.rows_matmul.matmul`)."""

    packed_kernel: PackedWeights | None = None

    def __call__(self, x, out_sharding=None):
        packed = self.packed_kernel
        if packed is None or not few_rows(x, packed[...]) or out_sharding is not None:
            return super().__call__(x, out_sharding)
        return native.on_cpu(self._packed, super().__call__, x)  # plain where lowered for GPU

    def _packed(self, x):
        dt = self.dtype or x.dtype
        y = rows_matmul.matmul(x.astype(dt), self.packed_kernel[...], self.out_features)
        y = y.astype(dt)
        return y if self.bias is None else y + self.bias[...]
