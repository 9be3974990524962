"""Medusa heads (Cai et al., 2024): light heads on a frozen target's last hidden state, each
predicting a token further ahead, so that one model drafts for itself.

Offset convention. With the target's last hidden state h_t (after its final norm, what its LM
head reads) the target predicts x_{t+1}; head i (0-based) predicts x_{t+2+i}. So after the target
has produced x_{t+1}, heads 0 .. k-1 draft x_{t+2} .. x_{t+1+k}.

Head i: ``h' = h + silu(W_i h + b_i)`` (a residual SiLU layer, ``W_i`` and ``b_i`` initialised to
zero) then its own LM head ``[dim, V]``; :meth:`MedusaHeads.init_from` copies the target's LM head
(its tied embedding when ``tie_embeddings``) into every head, so an untrained head predicts what
the target predicts one step earlier.

Checkpoints: ``config.json`` (``{"medusa_num_heads": n, "target": {...}}``, the target's
:class:`TransformerConfig` fields) and ``model.safetensors`` (``heads.<i>.<name>``).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from models.config import TransformerConfig
from models.transformer import Linear


class MedusaHead(nnx.Module):
    """One head: hidden [B, T, dim] -> logits [B, T, V] float32."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        dt = config.jnp_dtype
        zeros = nnx.initializers.zeros
        self.res = Linear(
            config.dim, config.dim, kernel_init=zeros, dtype=dt, param_dtype=dt, rngs=rngs
        )
        self.lm_head = Linear(
            config.dim,
            config.vocab_size,
            use_bias=False,
            dtype=dt,
            param_dtype=dt,
            kernel_init=nnx.initializers.normal(stddev=0.02),
            rngs=rngs,
        )

    def __call__(self, h):
        return self.lm_head(h + jax.nn.silu(self.res(h))).astype(jnp.float32)


class MedusaHeads(nnx.Module):
    """``num_heads`` :class:`MedusaHead`s for a target with ``config``.

    ``heads(h)``: the target's last hidden state h [B, T, dim] -> logits [B, T, num_heads, V]
    float32; ``[..., i, :]`` predicts the token i + 2 positions after h's own position.
    """

    def __init__(self, config: TransformerConfig, num_heads: int = 4, *, rngs: nnx.Rngs):
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
            raise ValueError(f"num_heads must be an int >= 1, got {num_heads!r}")
        self.config = config
        self.num_heads = num_heads
        self.heads = nnx.List([MedusaHead(config, rngs=rngs) for _ in range(num_heads)])

    def __call__(self, h, num: int | None = None):
        """Logits of every head, or of the first ``num`` (a drafting step that needs only k)."""
        return jnp.stack([head(h) for head in list(self.heads)[:num]], axis=-2)

    def init_from(self, target) -> MedusaHeads:
        """Copies ``target``'s LM head ([dim, V]) into every head's; returns ``self``."""
        if target.config.vocab_size != self.config.vocab_size or (
            target.config.dim != self.config.dim
        ):
            raise ValueError(
                f"target (dim {target.config.dim}, vocab {target.config.vocab_size}) does not "
                f"match the heads' (dim {self.config.dim}, vocab {self.config.vocab_size})"
            )
        if target.lm_head is None:
            kernel = target.embed.embedding[...].T
        else:
            kernel = target.lm_head.kernel[...]
        for head in self.heads:
            head.lm_head.kernel.set_value(jnp.array(kernel, head.lm_head.kernel.dtype))  # a copy
        return self


def save_medusa(heads: MedusaHeads, path: str, *, extra: dict | None = None) -> None:
    """Writes ``config.json`` and ``model.safetensors`` (float32) under ``path``."""
    os.makedirs(path, exist_ok=True)
    flat = nnx.to_flat_state(nnx.state(heads, nnx.Param))
    tensors = {".".join(str(p) for p in key): np.asarray(v[...], np.float32) for key, v in flat}
    safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"))
    cfg = {k: v for k, v in dataclasses.asdict(heads.config).items() if k != "rope_scaling"}
    meta = dict(medusa_num_heads=heads.num_heads, target=cfg, **(extra or {}))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(meta, f, indent=2, default=str)
        f.write("\n")


def load_medusa(path: str, config: TransformerConfig) -> MedusaHeads:
    """Heads saved by :func:`save_medusa` for a target with ``config`` (its dtype is used)."""
    with open(os.path.join(path, "config.json")) as f:
        meta = json.load(f)
    saved = meta["target"]
    if (saved["dim"], saved["vocab_size"]) != (config.dim, config.vocab_size):
        raise ValueError(
            f"heads at {path} are for dim {saved['dim']}, vocab {saved['vocab_size']}; the target "
            f"has dim {config.dim}, vocab {config.vocab_size}"
        )
    heads = MedusaHeads(config, meta["medusa_num_heads"], rngs=nnx.Rngs(0))
    tensors = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
    flat = nnx.to_flat_state(nnx.state(heads, nnx.Param))
    for key, v in flat:
        name = ".".join(str(p) for p in key)
        v.set_value(jnp.asarray(tensors[name], dtype=v.dtype))
    nnx.update(heads, nnx.from_flat_state(flat))
    return heads
