"""The packed view of a model for few-row decoding: the one place the decode paths get it.

Decode steps, speculative verification, draft proposals and the engine's steps multiply each
weight matrix by a few rows per call; on CPU those products run faster on packed copies of the
weights (``models.linear``, ``models.rows_matmul``). How a model is packed is the model's
(``models.transformer.pack_decode_weights``: which layers, which format); when and where the
decode paths pack is this module's, and no other module of the library calls the models' packing
(``tests/test_imports.py`` checks it): ``generate`` and ``speculative_generate`` once per call,
the engine once, in its runner (``decoding.runner.Runner``), the drafts' cost measurement and
Medusa's heads. Packing is eager and attaching happens inside the jitted loop, where the
weights are arguments, so the view has two halves:

* :func:`packed_weights` (host side, before the jitted call): the packed copies, a dict to pass
  into the jitted function as an argument; ``{}`` where packing does not apply (not CPU, no C++
  compiler for the native kernel, a sharded model), and the loop then runs the plain products.
* :func:`packed_model` (traced side): ``nnx.merge(graphdef, params)`` with those copies attached,
  so its few-row calls use them.

Caching rule: the copies are cached per weight array (``models.rows_matmul.packed``), so a model
is packed once while its weight arrays live and are unchanged; a model whose weights are replaced
(new arrays: training, loading, quantizing) is packed afresh, and a copy is dropped with its
weight array. Calling :func:`packed_weights` once per ``generate`` call therefore costs a walk
over the model's state, not a packing.
"""

from __future__ import annotations

import jax
from flax import nnx

from models.transformer import attach_decode_weights, pack_decode_weights


def packed_weights(model: nnx.Module, params=None) -> dict[str, jax.Array]:
    """The packed copies of ``model``'s weights for few-row products, by module path (``{}``
    where none apply; see the module docstring). ``params``: ``nnx.split(model)[1]`` when the
    caller has it (saves a second walk over the modules). Eager: call it outside jit."""
    return pack_decode_weights(model, params)


def packed_model(graphdef, params, packed: dict[str, jax.Array]) -> nnx.Module:
    """``nnx.merge(graphdef, params)`` with :func:`packed_weights`' copies ``packed`` attached
    (traceable: inside the jitted loop, where ``params`` and ``packed`` are arguments)."""
    return attach_decode_weights(nnx.merge(graphdef, params), packed)
