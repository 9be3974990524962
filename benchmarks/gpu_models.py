"""Whole-model programs for deviceless CUDA compiles: weights and caches as shapes only.

Each builder takes a case dict and ``sds(shape, dtype)`` (a ``ShapeDtypeStruct`` placed on the
target) and returns ``(fn, args)``; nothing of model size is ever allocated (``nnx.eval_shape``;
the quantized decode builds the 5M-parameter code target, whose blocks need values).
See :mod:`benchmarks.gpu_cases` for the shapes.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from flax import nnx

from models import KVCache, Transformer, TransformerConfig


def abstract_model(config: TransformerConfig, sds, *filters):
    """``(graphdef, *states)`` of ``Transformer(config)`` with every leaf a placed shape."""
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, *states = nnx.split(model, *filters)
    return (graphdef, *(_placed(s, sds) for s in states))


def _placed(tree, sds):
    return jax.tree.map(lambda x: sds(x.shape, x.dtype), tree)


def paged_cache(config: TransformerConfig, sds, batch: int, capacity: int, page_size: int = 16):
    """An abstract paged ``KVCache`` of ``batch`` rows of ``capacity`` positions."""
    pages = capacity // page_size

    def make():
        table = jnp.zeros((batch, pages), jnp.int32)
        return KVCache.paged(config, batch * pages, page_size, table)

    return _placed(jax.eval_shape(make), sds)


def model_decode(case, sds, preset: str = "code-target", batch: int = 8):
    """The cached forward of one token per row: tokens [B, 1] -> (logits [B, 1, V], cache)."""
    config = TransformerConfig.preset(preset, attn_impl="pallas")
    graphdef, state = abstract_model(config, sds)
    cache = paged_cache(config, sds, batch, 1024)

    def step(state, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, cache=cache)

    return step, (state, sds((batch, 1), jnp.int32), cache)


def model_decode_quantized(case, sds, preset: str = "code-target", batch: int = 8):
    """``model_decode`` with every linear layer (and the tied head) block-quantized to
    ``case["fmt"]`` (``models.quantize``), bfloat16 activations: the GPU's weight-only path (Q8_0:
    the blocks' integers multiplied, ``quant.block_matmul``; Q4: dequantized in the program). The
    blocks come from weight values, so this small model is built for real (5M parameters) and
    then placed."""
    from models import quantize

    config = TransformerConfig.preset(preset, attn_impl="pallas")
    model = quantize(Transformer(config, rngs=nnx.Rngs(0)), case["fmt"], dtype=jnp.bfloat16)
    graphdef, state = nnx.split(model)
    state = _placed(state, sds)
    cache = paged_cache(model.config, sds, batch, 1024)

    def step(state, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, cache=cache)

    return step, (state, sds((batch, 1), jnp.int32), cache)


def model_train(case, sds, preset: str = "code-target", batch: int = 16, seq_len: int = 256):
    """``models.train``'s jitted step: AdamW on packed [B, T] windows with segment ids."""
    from models import train

    config = TransformerConfig.preset(preset, attn_impl="pallas")
    graphdef, params, rest = abstract_model(config, sds, nnx.Param, ...)
    tx = train.optimizer(train.TrainConfig())
    opt_state = _placed(jax.eval_shape(tx.init, params), sds)
    tokens = sds((batch, seq_len), jnp.int32)
    data = (tokens, tokens, tokens, sds((batch, seq_len), jnp.float32))
    return train.make_train_step(graphdef, tx), (params, rest, opt_state, data)


def generate(
    case, sds, preset="llama-3-8b", batch=8, prompt_len=512, new_tokens=3584, num_layers=None
):
    """``decoding.generate``'s prefill or its ``while_loop`` decode, at the shapes ``generate``
    buckets ``batch`` prompts of ``prompt_len`` tokens and ``new_tokens`` into (paged, P = 16)."""
    from decoding.sampling import SamplingConfig

    gen = importlib.import_module("decoding.generate")  # the package exports a same-named function
    config = TransformerConfig.preset(preset, attn_impl="pallas")
    if num_layers is not None:
        config = config.replace(num_layers=num_layers)
    graphdef, params = abstract_model(config, sds)
    cache = paged_cache(config, sds, batch, prompt_len + new_tokens)
    static = dict(graphdef=graphdef)
    settings = _placed(jax.eval_shape(lambda: SamplingConfig().params()), sds)  # greedy, as data
    rows = sds((batch,), jnp.int32)
    key = _placed(jax.eval_shape(lambda: jax.random.key(0)), sds)
    scalar = sds((), jnp.int32)
    if case["phase"] == "prefill":
        fn = functools.partial(gen.prefill_jit, num_new_max=new_tokens, **static)
        done = sds((batch,), jnp.bool_)
        tokens = sds((batch, prompt_len), jnp.int32)
        return fn, (params, tokens, rows, cache, key, done, scalar, settings)
    state = gen.DecodeState(
        tokens=sds((batch, new_tokens), jnp.int32),
        num_new=rows,
        last=rows,
        done=sds((batch,), jnp.bool_),
        cache=cache,
        key=key,
        step=scalar,
    )
    # {}: no packed weights (decoding.packing packs for CPU programs only)
    return functools.partial(gen.decode_jit, **static), (
        params,
        {},
        state,
        scalar,
        scalar,
        settings,
    )
