"""Medusa drafting (Cai et al., 2024): the target drafts for itself with ``models.MedusaHeads`` on
its own last hidden state; no second model, no second cache.

Chain: with h the target's hidden state at the last accepted position (the one whose LM head
gave the last, not yet fed, token x_{t+1}), head i proposes d_{i+1} for x_{t+2+i}, i = 0 .. k-1,
greedy: its argmax; sampling: a sample of its distribution q_{i+1} (shaped by the same
``SamplingConfig`` as the target's p). The heads do not see each other's tokens, so q_{i+1} is
exactly the distribution d_{i+1} was drawn from and the verification rule
(``decoding.acceptance.accept``) keeps the output distributed exactly as the target's.

The verification forward (``[last, d_1 .. d_k]``, Tq = k + 1) also returns the target's hidden
states; the one at the last accepted input (index n) is the next step's h, so a step costs one
target call plus the heads. After the target's prefill, h comes from one extra Tq = 1 forward of
the last prompt token (its cache writes are discarded).

With ``lookup_ngram=n`` (chain only) a row whose last n known tokens occurred earlier in its
prompt + output proposes what followed them (``drafts.lookup``, prompt lookup's rule) and the
other rows the heads' tokens: code repeats itself where the heads are weakest, so the two
complement each other. Which source a row uses depends only on its tokens so far, and its q is
that source's (one-hot for the lookup), so the verification rule stays exact.

:class:`MedusaDraft` implements ``decoding.drafts.DraftKind``: its ``prefill`` computes h from
the target's cache after the target's prefill, its ``verify`` returns the hidden state at each
row's last accepted token as the next state (for a tree, after :func:`decoding.tree.accept_tree`
and compacting the accepted path).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from decoding import tree
from decoding.checks import check_optional_int
from decoding.drafts import (
    MAX_K,
    PRIOR_ACCEPTANCE,
    Context,
    DraftCosts,
    DraftKind,
    Proposal,
    Verified,
    check_vocab,
    default_k,
    draft_q,
    lookup_match,
    verify_chain,
    with_lookup,
)
from decoding.generate import generate
from decoding.packing import packed_model, packed_weights
from decoding.sampling import all_greedy, argmax, branch, probabilities, sample
from decoding.tree import TreeSpec
from models.medusa import MedusaHeads
from models.sharding import mesh_of

# The n of ``Medusa(heads, lookup_ngram=n)`` the benchmark and the CLI use: the best on the
# target's greedy continuations of the 4 calibration prompts (``python -m benchmarks.speculative
# --sources``): at k = 3, n = 1 / 2 / 3 / 4 give 1.78 / 2.78 / 2.80 / 2.77 tokens per call (the
# heads alone 2.12, prompt lookup alone 2.39).
LOOKUP_NGRAM = 3


class Medusa:
    """A draft kind for ``speculative_generate``: ``Medusa(heads)`` with ``heads`` a
    ``models.MedusaHeads`` trained for the target (its ``num_heads`` is the largest
    ``num_draft_tokens``, ``drafts.default_k("medusa")`` the default); ``Medusa(heads,
    tree=TreeSpec.default(4))`` or ``tree=TreeSpec.from_accuracies(...)`` drafts a token tree
    (``decoding.tree``; k = the tree's depth); ``Medusa(heads, lookup_ngram=3)`` a chain that
    takes prompt lookup's continuation where the last 3 tokens occurred before (module doc),
    up to ``drafts.MAX_K`` tokens (rows without a match draft past the last head from its
    distribution again)."""

    def __init__(
        self, heads: MedusaHeads, tree: TreeSpec | None = None, lookup_ngram: int | None = None
    ):
        if not isinstance(heads, MedusaHeads):
            raise TypeError(f"heads must be a models.MedusaHeads, got {type(heads).__name__}")
        if tree is not None and not isinstance(tree, TreeSpec):
            raise TypeError(f"tree must be a decoding.TreeSpec or None, got {type(tree).__name__}")
        lookup_ngram = check_optional_int("lookup_ngram", lookup_ngram, 1)
        if lookup_ngram is not None and tree is not None:
            raise ValueError("lookup_ngram drafts a chain: it cannot be combined with tree")
        self.heads, self.tree, self.lookup_ngram = heads, tree, lookup_ngram

    def split(self) -> tuple[MedusaDraft, Any]:
        """(the static draft kind, params: the heads' and their packed copies for few-row
        products, ``decoding.packing.packed_weights``)."""
        graphdef, params = nnx.split(self.heads)
        c = self.heads.config
        kind = MedusaDraft(
            graphdef, self.heads.num_heads, c.dim, c.vocab_size, self.tree, self.lookup_ngram
        )
        return kind, (params, packed_weights(self.heads, params))


@dataclasses.dataclass(frozen=True)
class MedusaDraft(DraftKind):
    """The static side of :class:`Medusa` (``graphdef`` of the heads; params passed apart).

    State: h [B, dim], the target's hidden state at the last accepted position.
    """

    graphdef: Any
    num_heads: int
    dim: int
    vocab_size: int
    tree: TreeSpec | None = None
    lookup_ngram: int | None = None
    prompt_hidden = True  # the state starts at the prompt's last hidden state

    @property
    def default_num_draft_tokens(self) -> int:
        if self.tree is not None:
            return self.tree.depth
        return min(default_k("medusa"), self.num_heads)

    @property
    def deterministic(self) -> bool:
        """A tree's nodes are the heads' top candidates (deterministic); a chain draws from the
        heads' distributions (with ``lookup_ngram``, only where no n-gram matched)."""
        return self.tree is not None

    @property
    def verify_width(self) -> int:
        """Cache slots a verification writes past the last token."""
        return 0 if self.tree is None else self.tree.num_nodes

    def check(self, target, k: int) -> None:
        check_vocab("Medusa heads", self.vocab_size, target)
        if self.dim != target.config.dim:
            raise ValueError(
                f"Medusa heads have dim {self.dim}, the target has {target.config.dim}"
            )
        if self.tree is not None and mesh_of(target) is not None:
            raise ValueError(
                "a token tree needs tree attention, which a sharded target (models.shard) does "
                "not run: use a chain, Medusa(heads), or an unsharded target"
            )
        if self.tree is not None and self.tree.top > self.vocab_size:
            raise ValueError(
                f"tree choices go up to {self.tree.top - 1} (the {self.tree.top}-th best token of "
                f"a head) but the vocabulary has {self.vocab_size} tokens"
            )
        if self.tree is not None and self.tree.depth > self.num_heads:
            raise ValueError(
                f"tree of depth {self.tree.depth} needs that many heads, the Medusa heads have "
                f"num_heads={self.num_heads}"
            )
        if k > self.num_heads and self.lookup_ngram is None:
            raise ValueError(
                f"num_draft_tokens={k} exceeds the Medusa heads' num_heads={self.num_heads}"
            )
        if self.tree is not None and k != self.tree.depth:
            raise ValueError(
                f"num_draft_tokens={k} must be None or the tree's depth {self.tree.depth}"
            )

    def costs(self, target, params) -> DraftCosts:
        fixed = None if self.tree is None else self.tree.depth  # a tree drafts its depth
        # The heads cost little beside the target's step. With lookup_ngram a matched row's
        # draft runs past the heads (up to MAX_K): a copying answer keeps long drafts.
        most = MAX_K if self.lookup_ngram is not None else min(MAX_K, self.num_heads)
        return DraftCosts(PRIOR_ACCEPTANCE["medusa"], max_k=most, fixed_k=fixed)

    def prefill(self, ctx: Context, tokens, prompt_lengths):
        """h [B, dim] at the last prompt token, read from the target's prefill (``ctx.hidden``,
        ``prompt_hidden``)."""
        pos = jnp.maximum(prompt_lengths - 1, 0).astype(jnp.int32)
        return jnp.take_along_axis(ctx.hidden, pos[:, None, None], axis=1)[:, 0]

    def head_logits(self, params, h, k: int, target=None, root=None):
        """h [B, dim] (and ``root`` [B], the token each h gave, for heads that read it) -> the
        first k heads' logits [B, k, V] float32 (shared-head heads take them from ``target``'s
        LM head, in one k-row product per row)."""
        heads = packed_model(self.graphdef, params[0], params[1])
        tokens = None if root is None else root[:, None]
        return heads(h[:, None], num=k, target=target, tokens=tokens)[:, 0]

    def _logits(self, ctx: Context, k: int):
        """The first k heads' logits [B, k, V] at ``ctx.state``; the root each row's h gave is
        its last known token (``ctx.seq`` at the cache's length, not yet fed). Past the last
        head (k > num_heads, with ``lookup_ngram``: a long lookup draft's rows without a match)
        the last head's logits again: its tokens there are drawn from them, so they are the
        q those positions are verified against (exact, if rarely kept)."""
        root = jnp.take_along_axis(ctx.seq, ctx.cache.lengths[:, None], axis=1)[:, 0]
        logits = self.head_logits(ctx.params, ctx.state, min(k, self.num_heads), ctx.target, root)
        if k > self.num_heads:
            logits = logits[:, [min(i, self.num_heads - 1) for i in range(k)]]
        return logits

    def propose(self, ctx: Context, k: int, sampling, key) -> Proposal:
        if self.tree is not None:
            logits = self._logits(ctx, self.tree.depth)
            last = jnp.take_along_axis(ctx.seq, ctx.cache.lengths[:, None], axis=1)[:, 0]
            nodes = tree.node_tokens(self.tree, logits, last)[:, 1:]  # [B, N]
            return Proposal(nodes, None, ctx.state, ctx.cache, 1)
        logits = self._logits(ctx, k)  # [B, k, V]
        B, _, V = logits.shape
        tokens = sample(logits.reshape(B * k, V), key, sampling).reshape(B, k)
        q = draft_q(tokens, V, lambda: probabilities(logits, sampling), sampling)
        cut = None
        if self.lookup_ngram is not None:
            found, seen = lookup_match(ctx, k, self.lookup_ngram)
            tokens, q = with_lookup(found, seen, tokens, q)
            if k > self.num_heads:  # where no row matched, the heads' tokens alone
                cut = (self.num_heads, found)
        return Proposal(tokens, q, ctx.state, ctx.cache, 1, cut=cut)

    def greedy_chain(self, ctx: Context, k: int):
        """The engine's chain draft (``decoding.Engine(draft=Medusa(heads))``): each of the
        first k heads' most likely token at ``ctx.state`` h [B, dim] (with ``lookup_ngram``,
        prompt lookup's continuation where the n-gram matched) -> [B, k] int32.

        Deterministic, so it is verified against a one-hot q (exact for greedy and sampled rows
        alike) and a row's draft depends only on its own tokens and hidden state, never on a
        key shared with the batch."""
        tokens = argmax(self._logits(ctx, k))
        if self.lookup_ngram is not None:
            tokens = with_lookup(*lookup_match(ctx, k, self.lookup_ngram), tokens)
        return tokens

    def verify(self, target, params, last, prop: Proposal, sampling, key) -> Verified:
        rows = jnp.arange(last.shape[0])
        if self.tree is not None:
            return self.verify_tree(target, last, prop, sampling, key)
        n, nxt, cache, hidden = verify_chain(target, last, prop, sampling, key, hidden=True)
        return Verified(prop.tokens, n, nxt, cache, hidden[rows, n])  # h at the last accepted

    def verify_tree(self, target, last, prop: Proposal, sampling, key) -> Verified:
        """All nodes in one target call with the tree mask; ``tree.accept_tree``; the accepted
        path's K/V compacted to the slots after the root."""
        spec, t = self.tree, self.tree.tables
        tokens = jnp.concatenate([last, prop.tokens], 1)  # [B, N+1]
        B, T = tokens.shape
        start = prop.cache.lengths
        positions = start[:, None] + jnp.asarray(t["depth"])[None]
        mask = jnp.broadcast_to(jnp.asarray(t["mask"]), (B, T, T))
        logits, cache, hidden = target(
            tokens, positions, cache=prop.cache, return_hidden=True, tree_mask=mask
        )
        best, n, path, nxt = branch(
            all_greedy(sampling),
            lambda: tree.accept_tree_greedy(spec, tokens, argmax(logits)),
            lambda: tree.accept_tree(spec, tokens, probabilities(logits, sampling), key),
        )
        cache = tree.compact_path(spec, cache, start, best)
        return Verified(path, n, nxt, cache, hidden[jnp.arange(B), best])


def rank_accuracy(
    target, heads: MedusaHeads, prompts, *, max_new_tokens: int = 128, ranks: int = 4
):
    """[heads][ranks] table: how often head d's c-th best candidate is the right token on the
    target's own greedy continuations of ``prompts`` (what it will verify), for
    :meth:`TreeSpec.from_accuracies`.

    The continuations come from ``decoding.generate``; one uncached forward of each
    prompt + continuation gives the hidden states; at every generated position t head d is
    scored against token t + 2 + d. Ties rank a token after every strictly larger logit.
    """

    res = generate(target, prompts, max_new_tokens=max_new_tokens)
    H = heads.num_heads
    hits = np.zeros((H, ranks))
    total = np.zeros(H)
    for prompt, new in zip(prompts, res.tokens, strict=True):
        seq = jnp.asarray([list(prompt) + list(new)], jnp.int32)
        _, h = target(seq, return_hidden=True)
        roots = jnp.pad(seq[:, 1:], ((0, 0), (0, 1)))  # x_{t+1} after h_t (the last: unused)
        logits = heads(h, target=target, tokens=roots)[0]  # [T, H, V]
        T = seq.shape[1]
        for d in range(H):
            t = np.arange(len(prompt) - 1, T - 2 - d)  # positions with a known answer
            if t.size == 0:
                continue
            right = seq[0, t + 2 + d]
            lg = logits[t, d]  # [n, V]
            rank = jnp.sum(lg > jnp.take_along_axis(lg, right[:, None], 1), axis=1)
            hits[d] += np.bincount(np.asarray(rank), minlength=ranks + 1)[:ranks]
            total[d] += t.size
    return (hits / np.maximum(total, 1)[:, None]).tolist()
