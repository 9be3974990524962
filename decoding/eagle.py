"""EAGLE drafting (Li et al., 2024) in ``speculative_generate``: the target drafts for itself
with a ``models.EagleHead``, one decoder block that reads the target's own hidden states.

The draft keeps its own one-layer KV cache of pairs (h_j, x_{j+1}) (``models.eagle``), at the
target's length. A verification (``[last, d_1 .. d_k]``, Tq = k + 1) also returns the target's
hidden states h_L .. h_{L+k}; the first n + 1 of them (n accepted) pair with the tokens after
them, which are then all known: ``last``'s successors d_1 .. d_n and the target's own token. The
next step's ``propose`` feeds those n + 1 pairs into the draft's cache in one call (k + 1 rows,
the rows past n + 1 written and then dropped by the length), reads the draft's feature at the
last of them, and drafts k tokens, feeding each with the draft's own feature in place of the
target's (k - 1 more calls of one row). Greedy drafts the argmax; sampling draws from the
draft's distribution q (shaped by the target's ``SamplingConfig``), which the verification rule
uses, so the output stays exactly the target's either way.

The target's prefill also returns its hidden states over the prompts (``prompt_hidden``); the
draft's prefill feeds all their pairs but the last, which stays pending.

With ``lookup_ngram=n`` a row whose last n known tokens occurred earlier in its prompt + output
proposes what followed them (``drafts.lookup``, prompt lookup's rule; q one-hot on it), the
other rows the head's tokens: open chat repeats its own phrases where the head is unsure, and a
copied run is kept far more often than a guessed one. A step where every row matched skips the
head's drafting calls (``lax.cond``; the pending pairs are still fed). The head drafts at most
``head_tokens`` (default ``drafts.default_k("eagle")``) of a longer k; the positions past them
repeat its last token with a one-hot q (exact; rarely kept), so a long lookup draft does not
make every unmatched step pay k drafting calls. Which source a row uses depends only on its
tokens so far, so the verification rule stays exact.

Chains only, in ``speculative_generate`` (a batch of rows, each at its own length).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

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
    one_hot,
    split_keys,
    verify_chain,
    with_lookup,
)
from decoding.packing import packed_model, packed_weights
from decoding.sampling import argmax, probabilities, sample
from models import KVCache
from models.eagle import EagleHead, block_config
from models.sharding import mesh_of


class Eagle:
    """A draft kind for ``speculative_generate``: ``Eagle(head)`` with ``head`` a
    ``models.EagleHead`` trained for the target (``python -m models.eagle_train``); k up to
    ``drafts.MAX_K``, chosen from the measured step costs unless ``num_draft_tokens`` fixes
    it. ``Eagle(head, lookup_ngram=3)`` takes prompt lookup's continuation where a row's last 3
    tokens occurred before (module docstring); ``head_tokens``: the most tokens the head drafts
    of a step's k (default: all of them alone, ``drafts.default_k("eagle")`` with lookup)."""

    def __init__(
        self, head: EagleHead, lookup_ngram: int | None = None, head_tokens: int | None = None
    ):
        if not isinstance(head, EagleHead):
            raise TypeError(f"head must be a models.EagleHead, got {type(head).__name__}")
        lookup_ngram = check_optional_int("lookup_ngram", lookup_ngram, 1)
        head_tokens = check_optional_int("head_tokens", head_tokens, 1)
        if head_tokens is not None and head_tokens > MAX_K:
            raise ValueError(f"head_tokens={head_tokens} exceeds drafts.MAX_K={MAX_K}")
        self.head, self.lookup_ngram = head, lookup_ngram
        if head_tokens is None:  # a cap only where lookup drafts the long runs
            head_tokens = MAX_K if lookup_ngram is None else default_k("eagle")
        self.head_tokens = head_tokens

    def split(self) -> tuple[EagleDraft, Any]:
        """(the static draft kind, params: the head's and their packed copies for few-row
        products, ``decoding.packing.packed_weights``)."""
        graphdef, params = nnx.split(self.head)
        c = self.head.config
        share = draft_share(self.head)
        kind = EagleDraft(
            graphdef,
            c.dim,
            c.vocab_size,
            share,
            self.lookup_ngram,
            self.head_tokens,
            weight_bytes(self.head),
        )
        return kind, (
            params,
            packed_weights(self.head, params),
        )


def weight_bytes(head: EagleHead) -> float:
    """The head's bytes per weight (its parameters' mean)."""
    params = [v[...] for _, v in nnx.to_flat_state(nnx.state(head, nnx.Param))]
    return sum(p.nbytes for p in params) / sum(p.size for p in params)


def draft_share(head: EagleHead) -> float:
    """One drafting call's weights as a share of the target's (what a memory-bound step
    reads): the block, ``fc`` and the draft vocabulary's rows against the whole target."""
    c = head.config
    mine = sum(int(v[...].size) for _, v in nnx.to_flat_state(nnx.state(head, nnx.Param)))
    D, H, Hkv, M = c.dim, c.num_heads, c.num_kv_heads, c.mlp_dim
    hd = c.resolved_head_dim
    layer = D * (H + 2 * Hkv) * hd + H * hd * D + 3 * D * M
    target = c.num_layers * layer + c.vocab_size * D * (1 if c.tie_embeddings else 2)
    return mine / target


def chain(head: EagleHead, embed, x, kc, vc, lengths, table, k: int, m: int, pick):
    """The head's drafting chain from its feature x [B, 1, dim]: m tokens, token i the draft
    vocabulary's id at ``pick(sub_logits [B, V'], i)`` (an index into the draft vocabulary:
    its ids are sorted, so an argmax there is the whole vocabulary's, ties included, without
    building or scanning the V - V' -inf entries), each fed with the head's own feature at
    position ``lengths + i`` of its one-layer cache kc, vc (contiguous with ``table`` None, else
    paged), then the m-th repeated up to k -> (tokens [B, k] int32, the m sub-logits, kc, vc)."""
    toks, logits = [], []
    vocab = head.vocab[...]
    for i in range(m):
        logits.append(head.sub_logits(x)[:, 0])
        toks.append(vocab[pick(logits[-1], i)])
        if i + 1 < m:
            kv = (kc, vc, lengths + i, table)
            x, (kc, vc) = head.features(x, embed(toks[-1][:, None]), (lengths + i)[:, None], kv=kv)
    return jnp.stack(toks + [toks[-1]] * (k - m), 1), logits, kc, vc


@dataclasses.dataclass(frozen=True)
class EagleDraft(DraftKind):
    """The static side of :class:`Eagle` (``graphdef`` of the head; params passed apart).

    State: (cache, pending h [B, MAX_K + 1, dim], pending count [B]): the draft's one-layer
    ``KVCache`` (lengths = pairs fed), and the target's hidden states of the positions whose
    pairs are not fed yet (the first ``count`` rows)."""

    graphdef: Any
    dim: int
    vocab_size: int
    share: float
    lookup_ngram: int | None = None
    head_tokens: int = MAX_K
    itemsize: float = 4.0  # the head's bytes per weight (bfloat16 reads half what float32 does)
    prefill_calls = 1
    prompt_hidden = True

    @property
    def default_num_draft_tokens(self) -> int:
        return default_k("eagle")

    @property
    def deterministic(self) -> bool:
        return False  # draws from its own distribution when sampling

    def check(self, target, k: int) -> None:
        check_vocab("the EAGLE head", self.vocab_size, target)
        if self.dim != target.config.dim:
            raise ValueError(
                f"the EAGLE head has dim {self.dim}, the target has {target.config.dim}"
            )
        if k > MAX_K:
            raise ValueError(f"num_draft_tokens={k} exceeds drafts.MAX_K={MAX_K} for EAGLE")

    def place(self, draft, params, target):
        if mesh_of(target) is not None:
            raise ValueError("EAGLE drafting runs on an unsharded target only")
        return params

    def costs(self, target, params) -> DraftCosts:
        most = self.head_tokens
        share = self.share * self.itemsize / jnp.dtype(target.config.jnp_dtype).itemsize
        # With lookup_ngram: an unmatched step's calls (a matched one makes only the first).
        return DraftCosts(
            PRIOR_ACCEPTANCE["eagle"], target, lambda k: min(k, most) * share, max_k=MAX_K
        )

    def head(self, params) -> EagleHead:
        return packed_model(self.graphdef, *params)

    def make_state(self, target, params, cache_kind: str, batch, page_size: int, num_pages):
        """A contiguous draft cache whatever the target's (one layer: small)."""
        return self.empty_state(target, params, len(batch.done), batch.capacity), None

    def empty_state(self, target, params, rows: int, capacity: int):
        """The state for ``rows`` rows of up to ``capacity`` positions (traceable)."""
        head = nnx.merge(self.graphdef, params[0])
        cache = head.cache(rows, capacity + MAX_K + 2)
        pend = jnp.zeros((rows, MAX_K + 1, self.dim), target.config.jnp_dtype)
        return cache, pend, jnp.zeros((rows,), jnp.int32)

    def prefill(self, ctx: Context, tokens, prompt_lengths):
        """From the target's hidden states over the prompts (``ctx.hidden``, its prefill's), the
        pairs of positions 0 .. P - 2 fed, position P - 1's pending."""
        cache, pend, _ = ctx.state
        B, T = tokens.shape
        h = ctx.hidden  # [B, T, dim]
        head = self.head(ctx.params)
        nxt = ctx.seq[:, 1 : T + 1]  # the token after each position (the first new one at P)
        e = ctx.target.embed(nxt)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        kv = (cache.k[0], cache.v[0], jnp.zeros((B,), jnp.int32), None)
        _, (kc, vc) = head.features(h, e, positions, kv=kv)
        last = jnp.maximum(prompt_lengths - 1, 0)
        pend = pend.at[:, 0].set(jnp.take_along_axis(h, last[:, None, None], 1)[:, 0])
        cache = cache.replace(k=(kc,), v=(vc,), lengths=last.astype(jnp.int32))
        return cache, pend, jnp.ones((B,), jnp.int32)

    def propose(self, ctx: Context, k: int, sampling, key) -> Proposal:
        cache, pend, count = ctx.state
        head = self.head(ctx.params)
        embed = ctx.target.embed
        D = cache.lengths
        j = jnp.arange(k + 1, dtype=jnp.int32)
        pos = D[:, None] + j  # [B, k + 1]
        nxt = jnp.take_along_axis(ctx.seq, jnp.minimum(pos + 1, ctx.seq.shape[1] - 1), axis=1)
        kv = (cache.k[0], cache.v[0], D, None)
        f, (kc, vc) = head.features(pend[:, : k + 1], embed(nxt), pos, kv=kv)
        feat = jnp.take_along_axis(f, (count - 1)[:, None, None], axis=1)  # [B, 1, dim]
        lengths = D + count  # = the target's length: the pairs all known
        m = min(k, self.head_tokens)

        def drafted(kc, vc):  # the head's m tokens, then its last repeated (one-hot q)
            keys = split_keys(key, m)
            pick = lambda logits, i: sample(logits, keys[i], sampling)  # noqa: E731
            tokens, logits, kc, vc = chain(head, embed, feat, kc, vc, lengths, None, k, m, pick)

            def drawn():
                q = jnp.stack([probabilities(head.full_logits(x), sampling) for x in logits], 1)
                if k > m:
                    q = jnp.concatenate([q, one_hot(tokens[:, m:], self.vocab_size)], 1)
                return q

            return tokens, draft_q(tokens, self.vocab_size, drawn, sampling), kc, vc

        calls = m  # the feed call and m - 1 drafted ones
        if self.lookup_ngram is None:
            tokens, q, kc, vc = drafted(kc, vc)
        else:
            found, seen = lookup_match(ctx, k, self.lookup_ngram)

            def mixed():
                tokens, q, k2, v2 = drafted(kc, vc)
                return (*with_lookup(found, seen, tokens, q), k2, v2)

            def copied():  # every row matched: no drafting calls
                return seen, one_hot(seen, self.vocab_size), kc, vc

            tokens, q, kc, vc = jax.lax.cond(jnp.all(found), copied, mixed)
            calls = jnp.where(jnp.all(found), 1, m).astype(jnp.int32)
        state = (cache.replace(k=(kc,), v=(vc,), lengths=lengths), pend, count)
        # Where no row matched, the tokens past the head's m are filler: verify the m alone.
        cut = None if self.lookup_ngram is None or m == k else (m, found)
        return Proposal(tokens, q, state, ctx.cache, calls, cut=cut)

    # --------------------------------------------------------------- the engine's (paged)
    # ``decoding.Engine(draft=Eagle(head))`` keeps the head's one-layer pool at the target's
    # page ids and, per slot, the head's feature at the row's last cached position: position t
    # of the pool holds the pair (h_t, x_{t+1}), so it is complete up to the target's length
    # and a step drafts from the slot's feature alone (no pending pairs, unlike the loop's).

    def engine_pool(self, params, num_pages: int, page_size: int):
        """The head's zeroed paged K and V pools (tuples of one layer) of ``num_pages`` pages."""
        head = nnx.merge(self.graphdef, params[0])
        rows = jnp.zeros((1, 1), jnp.int32)
        pool = KVCache.paged(block_config(head.config), num_pages, page_size, rows)
        return pool.k, pool.v

    def feed(self, target, params, k, v, h, nexts, start, table):
        """The pairs (h [B, T, dim] of positions ``start`` [B] ..., the tokens after them
        ``nexts`` [B, T]) into the pool k, v through ``table`` [B, W] -> (the head's features
        f [B, T, dim], k, v)."""
        pos = start[:, None] + jnp.arange(nexts.shape[1], dtype=jnp.int32)
        kv = (k[0], v[0], start, table)
        f, (kc, vc) = self.head(params).features(h, target.embed(nexts), pos, kv=kv)
        return f, (kc,), (vc,)

    def greedy_chain(self, ctx: Context, k: int, feat, pool, table):
        """The engine's chain draft: from each row's feature ``feat`` [B, dim] (the head's at
        its last cached position ``ctx.cache.lengths - 1``), the head's argmax for
        ``min(k, head_tokens)`` tokens, each fed with its own feature at the next position of
        the pool (k, v; rewritten by the step's :meth:`feed`), then its last token repeated;
        with ``lookup_ngram``, prompt lookup's continuation where the n-gram matched
        -> (tokens [B, k] int32, k, v).

        Deterministic, so verified against a one-hot q (exact for greedy and sampled rows
        alike), and a row's draft depends only on its own tokens and state."""
        head, ((kc,), (vc,)) = self.head(ctx.params), pool
        x = feat[:, None].astype(head.config.jnp_dtype)
        m, L = min(k, self.head_tokens), ctx.cache.lengths
        pick = lambda logits, i: argmax(logits)  # noqa: E731
        tokens, _, kc, vc = chain(head, ctx.target.embed, x, kc, vc, L, table, k, m, pick)
        if self.lookup_ngram is not None:
            tokens = with_lookup(*lookup_match(ctx, k, self.lookup_ngram), tokens)
        return tokens, ((kc,), (vc,))

    def verify(self, target, params, last, prop: Proposal, sampling, key) -> Verified:
        n, nxt, cache, hidden = verify_chain(target, last, prop, sampling, key, hidden=True)
        draft_cache, pend, _ = prop.state
        k1 = hidden.shape[1]
        pend = pend.at[:, :k1].set(hidden.astype(pend.dtype))
        return Verified(prop.tokens, n, nxt, cache, (draft_cache, pend, n + 1))
