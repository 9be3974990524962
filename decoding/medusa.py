"""Medusa drafting (Cai et al., 2024): the target drafts for itself with ``models.MedusaHeads`` on
its own last hidden state; no second model, no second cache.

Chain: with h the target's hidden state at the last accepted position (the one whose LM head
gave the last, not yet fed, token x_{t+1}), head i proposes d_{i+1} for x_{t+2+i}, i = 0 .. k-1,
greedy: its argmax; sampling: a sample of its distribution q_{i+1} (shaped by the same
``SamplingConfig`` as the target's p). The heads do not see each other's tokens, so q_{i+1} is
exactly the distribution d_{i+1} was drawn from and the verification rule
(``speculative.accept``) keeps the output distributed exactly as the target's.

The verification forward (``[last, d_1 .. d_k]``, Tq = k + 1) also returns the target's hidden
states; the one at the last accepted input (index n) is the next step's h, so a step costs one
target call plus the heads. After the target's prefill, h comes from one extra Tq = 1 forward of
the last prompt token (its cache writes are discarded).

Hooks used by ``speculative.py`` beyond the draft-kind interface of ``decoding.drafts``:
``start(target, cache, seq, params)`` (draft state after the target's prefill) and
``verify(target, params, last, prop, sampling, key)`` (the verification forward and the
acceptance, returning :class:`Verified`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from decoding.drafts import Context, Proposal, _check_vocab
from decoding.sampling import SamplingConfig, probabilities, sample
from models.medusa import MedusaHeads


class Verified(NamedTuple):
    """A verification step's outcome: tokens [B, k] (the draft path whose first n are kept),
    n [B] int32, nxt [B] int32 (the target's token after them), the target's cache (lengths
    not yet rolled back) and the draft's new state."""

    tokens: jax.Array
    n: jax.Array
    nxt: jax.Array
    cache: Any
    state: Any


def verify_chain(target, last, prop: Proposal, sampling: SamplingConfig, key, hidden=False):
    """The target's forward on ``[last, d_1 .. d_k]`` and the acceptance rule.

    Returns (n [B], nxt [B], cache, hidden states [B, k+1, dim] or None).
    """
    from decoding.speculative import accept

    tokens = jnp.concatenate([last, prop.tokens], 1)
    out = target(tokens, cache=prop.cache, return_hidden=hidden)
    logits, cache = out[:2]
    n, nxt = accept(probabilities(logits, sampling), prop.q, prop.tokens, key)
    return n, nxt, cache, out[2] if hidden else None


class Medusa:
    """A draft kind for ``speculative_generate``: ``Medusa(heads)`` with ``heads`` a
    ``models.MedusaHeads`` trained for the target (its ``num_heads`` is the default and largest
    ``num_draft_tokens``)."""

    def __init__(self, heads: MedusaHeads):
        if not isinstance(heads, MedusaHeads):
            raise TypeError(f"heads must be a models.MedusaHeads, got {type(heads).__name__}")
        self.heads = heads

    def split(self) -> tuple[MedusaDraft, Any]:
        """(the static draft kind, the heads' params)."""
        graphdef, params = nnx.split(self.heads)
        c = self.heads.config
        return MedusaDraft(graphdef, self.heads.num_heads, c.dim, c.vocab_size), params


@dataclasses.dataclass(frozen=True)
class MedusaDraft:
    """The static side of :class:`Medusa` (``graphdef`` of the heads; params passed apart).

    State: h [B, dim], the target's hidden state at the last accepted position.
    """

    graphdef: Any
    num_heads: int
    dim: int
    vocab_size: int

    @property
    def default_num_draft_tokens(self) -> int:
        return self.num_heads

    def check(self, target, k: int) -> None:
        _check_vocab("Medusa heads", self.vocab_size, target)
        if self.dim != target.config.dim:
            raise ValueError(
                f"Medusa heads have dim {self.dim}, the target has {target.config.dim}"
            )
        if k > self.num_heads:
            raise ValueError(
                f"num_draft_tokens={k} exceeds the Medusa heads' num_heads={self.num_heads}"
            )

    def make_state(self, target, cache_kind, batch, page_size, num_pages):
        return None, None

    def prefill(self, params, state, tokens, prompt_lengths):
        return state

    def start(self, target, cache, seq, params):
        """h [B, dim] at the last prompt token, from a Tq = 1 forward (cache writes dropped)."""
        pos = jnp.maximum(cache.lengths - 1, 0)
        tok = jnp.take_along_axis(seq, pos[:, None], axis=1)
        _, _, h = target(tok, cache=cache.replace(lengths=pos), return_hidden=True)
        return h[:, 0]

    def head_logits(self, params, h, k: int):
        """h [B, dim] -> the first k heads' logits [B, k, V] float32."""
        return nnx.merge(self.graphdef, params)(h[:, None])[:, 0, :k]

    def propose(self, ctx: Context, k: int, sampling: SamplingConfig, key) -> Proposal:
        logits = self.head_logits(ctx.params, ctx.state, k)  # [B, k, V]
        B, _, V = logits.shape
        tokens = sample(logits.reshape(B * k, V), key, sampling).reshape(B, k)
        return Proposal(tokens, probabilities(logits, sampling), ctx.state, ctx.cache, 1)

    def verify(self, target, params, last, prop: Proposal, sampling, key) -> Verified:
        n, nxt, cache, hidden = verify_chain(target, last, prop, sampling, key, hidden=True)
        h = hidden[jnp.arange(hidden.shape[0]), n]  # at the last accepted input
        return Verified(prop.tokens, n, nxt, cache, h)
