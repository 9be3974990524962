"""EAGLE draft heads (Li et al., 2024): one decoder block on a frozen target's own hidden
states, autoregressive in feature space, so that the target drafts for itself with context.

Position j of the draft reads the pair (h_j, x_{j+1}): h_j the target's last hidden state at j
(after its final norm, what its LM head reads) and the embedding of the token after it (the
target's own table). ``fc([e(x_{j+1}); h_j])`` goes through one pre-norm decoder block (causal
attention over the pairs before it, with its own one-layer KV cache) whose output f_{j+1}
predicts h_{j+1}; the logits of f_{j+1} then predict x_{j+2}. Drafting k tokens after x_{t+1}:
the pairs up to (h_t, x_{t+1}) come from the target (its verification returns the hidden
states), then each drafted token is fed with the draft's own f in place of h.

Medusa heads (``models.medusa``) read only h_t (and the root token) through a residual layer;
the block's attention lets the draft look back over the context (a copy, a repeated name) and
feeding its own f makes each draft token depend on the ones before it, which is what a chain
needs. It costs one block per drafted token (about a thirtieth of SmolLM2-135M's body) and a
few-row product with the draft vocabulary's rows.

Draft vocabulary (``vocab=``): as for Medusa heads (FR-Spec), the logits cover only these ids,
through ``vocab_head``, a frozen copy of the target's LM-head rows for them (:meth:`init_from`);
every other token's logit is -inf (never drafted; verification keeps the output exact).

Checkpoints: ``config.json`` (``{"eagle": 1, "target": {...}}`` plus the trainer's fields) and
``model.safetensors`` (the module's parameters by path, ``vocab``). :func:`load_eagle` checks the
target's shapes and every tensor's name and shape.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from models import fused_decode
from models.config import TransformerConfig
from models.kv_cache import KVCache
from models.medusa import (
    check_saved_target,
    copy_vocab_rows,
    fill_params,
    param_tensors,
    vocab_head,
)
from models.transformer import Block, Linear, rope_tables


def block_config(config: TransformerConfig) -> TransformerConfig:
    """The draft block's config: the target's layer 0, alone (its window, RoPE base)."""
    return dataclasses.replace(config, num_layers=1, layer_types=None, attn_impl="auto")


class EagleHead(nnx.Module):
    """The draft for a target with ``config``, drafting from the token ids ``vocab``.

    ``features(h, e, positions, kv=None)``: h [B, T, dim] the target's hidden states (or the
    draft's own f), e [B, T, dim] the embeddings of the tokens after them, positions [B, T]
    -> f [B, T, dim] (and the block's new (k, v) with ``kv``; a cached call of a few rows runs
    the block as ``models.fused_decode``'s layer where that applies, as the target's do).
    ``logits(f)`` -> [B, T, V] float32, -inf outside ``vocab``; ``sub_logits(f)`` -> [B, T, V']
    over ``vocab`` only.
    """

    def __init__(self, config: TransformerConfig, *, vocab, rngs: nnx.Rngs):
        self.vocab, self.vocab_head = vocab_head(config, vocab, rngs)  # checks vocab first
        self.config = config
        dt, D = config.jnp_dtype, config.dim
        self.fc = Linear(2 * D, D, use_bias=True, dtype=dt, param_dtype=dt, rngs=rngs)
        self.block = Block(block_config(config), rngs=rngs)

    def features(self, h, e, positions, *, kv=None, segment_ids=None):
        dt = self.config.jnp_dtype
        x = self.fc(jnp.concatenate([e.astype(dt), h.astype(dt)], -1))
        cos, sin = rope_tables(self.config, positions)
        if fused_decode.applies(self.block, x, kv, segment_ids=segment_ids):
            # A drafting step's block as the target's decode layers run: one native call on
            # CPU (the modules' dozen small ops cost the head more than its weights' reads).
            return fused_decode.layer(self.block, x, cos, sin, kv)
        return self.block(x, cos, sin, kv=kv, segment_ids=segment_ids)

    def sub_logits(self, f):
        sub = self.vocab_head(f).astype(jnp.float32)
        c = self.config.final_softcap
        return c * jnp.tanh(sub / c) if c > 0 else sub

    def logits(self, f):
        return self.full_logits(self.sub_logits(f))

    def full_logits(self, sub):
        """:meth:`sub_logits`' [..., V'] placed at their ids of the whole vocabulary, -inf
        elsewhere -> [..., V]."""
        full = jnp.full((*sub.shape[:-1], self.config.vocab_size), -jnp.inf, jnp.float32)
        return full.at[..., self.vocab[...]].set(sub)

    def cache(self, batch: int, max_len: int) -> KVCache:
        """An empty contiguous one-layer cache for ``batch`` rows of ``max_len`` pairs."""
        return KVCache.contiguous(block_config(self.config), batch, max_len)

    def check_target(self, config: TransformerConfig) -> None:
        """ValueError naming the first shape field where ``config`` differs from the draft's."""
        check_saved_target(dataclasses.asdict(self.config), config, "the EAGLE head")

    def init_from(self, target) -> EagleHead:
        """Copies ``target``'s LM-head rows for the draft vocabulary into ``vocab_head``."""
        self.check_target(target.config)
        copy_vocab_rows(target, self.vocab, self.vocab_head)
        return self


# The parameters a trainer updates: all but ``vocab_head`` (the target's frozen rows).
TRAINABLE = nnx.All(nnx.Param, nnx.Not(nnx.PathContains("vocab_head")))


def save_eagle(head: EagleHead, path: str, *, extra: dict | None = None, dtype="float32"):
    """Writes ``config.json`` and ``model.safetensors`` (parameters in ``dtype``, "float32" or
    "float16") under ``path``; ``extra`` adds fields to the config."""
    tensors = param_tensors(head, dtype)
    os.makedirs(path, exist_ok=True)
    tensors["vocab"] = np.asarray(head.vocab[...], np.int32)
    safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"))
    cfg = {k: v for k, v in dataclasses.asdict(head.config).items() if k != "rope_scaling"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(eagle=1, target=cfg, **(extra or {})), f, indent=2, default=str)
        f.write("\n")


def load_eagle(path: str, config: TransformerConfig) -> EagleHead:
    """The head saved by :func:`save_eagle` for a target with ``config`` (its dtype is used).
    ValueError naming the mismatch for a target differing in a shape field, or a tensor
    missing, unexpected or misshapen."""
    with open(os.path.join(path, "config.json")) as f:
        meta = json.load(f)
    if "eagle" not in meta:
        raise ValueError(f"{path} holds no EAGLE head (config.json has no 'eagle' field)")
    check_saved_target(meta["target"], config, f"the EAGLE head at {path}")
    tensors = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
    vocab = tensors.pop("vocab", None)
    if vocab is None:
        raise ValueError(f"the EAGLE head at {path}: missing tensor vocab")
    try:
        head = EagleHead(config, vocab=vocab, rngs=nnx.Rngs(0))
    except (TypeError, ValueError) as e:
        raise ValueError(f"the EAGLE head at {path}: {e}") from None
    return fill_params(head, tensors, f"the EAGLE head at {path}")
