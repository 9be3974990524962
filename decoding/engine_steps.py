"""The engine's jitted device steps over a shared page pool, at fixed shapes.

* ``prefill_chunk``: writes chunks of C prompt tokens [n, C] (right-padded; one request's
  each, n a power of two, padding rows on the scratch page) into their pages: one
  ``Tq = C > 1`` cached forward through ``attention_with_kvcache`` with a block table. Its
  logits are dead code (XLA drops them): the chunk's last token is fed by the decode step.
* ``decode_rows``: feeds each row's last token [B, 1] at its own position, samples each row's next
  token with that row's sampling settings (``SamplingParams`` rows: data, so one compiled step
  serves every setting) and PRNG key.
* ``verify_rows``: speculation: each row's draft of k tokens (``drafts.PromptLookup`` over the
  row's known tokens ``seq``, ``decoding.Medusa``'s heads on the row's hidden state from the
  step before, ``decoding.Eagle``'s head from its feature and one-layer pool, or a draft model
  over its own page pool) and the target's verification of
  ``[last, d_1 .. d_k]`` (Tq = k + 1 for every row) in one step; each row accepts its own number (the acceptance rule of
  ``decoding.speculative``, drawn with the row's own key), so rows are ragged only in what the
  host keeps.
* ``verify_ragged_rows``: prompt lookup's drafts made on the host, each row its own length: the
  draft tokens are rows of one token after the decode rows (like ``decode_rows``' folded
  prompt tokens), so a row without a match costs one row, and each row accepts on its own
  draft (``acceptance.accept`` with per-row lengths).
* ``copy_pages``: page copies for copy on write.

The pool is a tuple of ``[num_pages + 1, P, Hkv, D]`` arrays per layer for keys and for values,
donated to every call so that XLA updates it in place. Its last page is scratch: padding rows and
block-table entries past a row's pages point there, so padding writes never touch a real page.
On an engine with rings (``decoding.engine``), a sliding-window layer's entry is its rings
instead, ``[max_batch * R + 1, P, Hkv, D]`` (the last page scratch too), and the steps take a
:class:`RingTables` where they take a block table.

``TRACES`` counts how often each step was traced (= compiled): the engine keeps every shape fixed
(decode batches in powers of two up to ``max_batch``, block table ``max_pages``, chunk
lengths in ``runner.chunk_bucket``'s buckets and chunks per prefill call in powers of two up to
``DECODE_MAX_ROWS // C``), so it grows only with new shapes, a few dozen at most (all of them
compiled up front by ``Engine.warmup``), never as requests come and go or with new sampling
settings.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
from flax import struct

from decoding.acceptance import accept, accept_greedy
from decoding.drafts import Context, ModelDraft
from decoding.eagle import EagleDraft
from decoding.medusa import MedusaDraft
from decoding.packing import packed_model
from decoding.sampling import (
    SamplingParams,
    all_greedy,
    argmax,
    branch,
    probabilities,
    sample,
    token_logprobs,
)
from models import KVCache
from pallas_attn.cache import set_rows

TRACES: collections.Counter = collections.Counter()
# Folded into a row's key for a model draft's draws, so they are independent of the
# acceptance rule's, which uses the row's key itself.
DRAFT_SALT = 0x5D7AF7


@struct.dataclass
class RingTables:
    """A step's tables on an engine whose sliding-window layers keep rings: ``block`` [B, W]
    int32, the pool pages of the global layers; ``window`` [B, W] int32, the ring pages of the
    sliding layers (``KVCache.window_table``); ``ring_pages`` R and ``replay`` as in
    ``models.KVCache`` (static: each value compiles its own step)."""

    block: jax.Array
    window: jax.Array
    ring_pages: int = struct.field(pytree_node=False)
    replay: bool = struct.field(pytree_node=False, default=False)


def step_cache(k, v, lengths, table) -> KVCache:
    """The ``KVCache`` of a step: ``table`` a block table, or :class:`RingTables`."""
    if isinstance(table, RingTables):
        return KVCache(
            k=k,
            v=v,
            lengths=lengths,
            block_table=table.block,
            ring_pages=table.ring_pages,
            window_table=table.window,
            replay=table.replay,
        )
    return KVCache(k=k, v=v, lengths=lengths, block_table=table)


def row_keys(seeds, index):
    """Per-row PRNG keys [B]: ``fold_in(key(seeds[b]), index[b])``.

    ``index`` is the number of tokens the request generated before this one, so a request's
    draws depend only on its seed and its own progress, never on the rest of the batch (and
    match ``generate`` on the request alone, which folds its step counter into ``key(seed)``).
    """
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, index)


def prefill_chunk(graphdef, params, kernels, k, v, tokens, start, table):
    """tokens [n, C] (row i at positions ``start[i] ..``), pages ``table`` [n, max_pages] (or
    :class:`RingTables`; a replay writes only the rings) -> (k, v). ``kernels``: the packed
    weights (``decoding.packing``): a chunk of at most ``models.linear.DECODE_MAX_ROWS`` tokens
    multiplies them, as a decode step does (on CPU about twice XLA's rate at 16-32 rows, and
    each row's products are bit for bit a one-row step's)."""
    TRACES["prefill"] += 1
    model = packed_model(graphdef, params, kernels)
    _, cache = model(tokens, cache=step_cache(k, v, start, table))
    return cache.k, cache.v


def eagle_prefill_chunk(
    graphdef,
    draft,
    params,
    kernels,
    k,
    v,
    draft_params,
    hk,
    hv,
    tokens,
    nexts,
    start,
    table,
    last,
    hidden,
    slots,
):
    """:func:`prefill_chunk` with an EAGLE head (``decoding.eagle.EagleDraft``): the target's
    hidden states over the chunks and the tokens after them (``nexts`` [n, C]: known, the
    decode step feeds a prompt's last token) fed into the head's pool hk, hv (at the target's
    pages, the block table of ``table``), and each chunk's feature at its last token (index
    ``last`` [n]) put in ``hidden`` [S, dim] at slot ``slots`` [n] (S or more: a padding row,
    dropped) -> (k, v, hk, hv, hidden)."""
    TRACES["prefill"] += 1
    model = packed_model(graphdef, params, kernels)
    _, cache, h = model(tokens, cache=step_cache(k, v, start, table), return_hidden=True)
    block = table.block if isinstance(table, RingTables) else table
    f, hk, hv = draft.feed(model, draft_params, hk, hv, h, nexts, start, block)
    feat = jnp.take_along_axis(f, last[:, None, None], axis=1)[:, 0]
    hidden = hidden.at[slots].set(feat.astype(hidden.dtype), mode="drop")
    return cache.k, cache.v, hk, hv, hidden


def decode_rows(
    graphdef,
    logprobs_mode,
    params,
    kernels,
    k,
    v,
    last,
    lengths,
    table,
    seeds,
    index,
    sampling: SamplingParams,
    wanted,
    prefill=None,
    states=None,
    draft_params=None,
    hk=None,
    hv=None,
    *,
    eagle=None,
):
    """One token per row: last [B] fed at position lengths [B] through table [B, max_pages];
    ``kernels`` from ``decoding.packing.packed_weights`` (few-row products on CPU).

    Returns ``(next tokens [B] int32, logprobs, k, v)``, and with ``states`` = (hidden
    [S, dim], slots [B] int32) also hidden with row b's hidden state at its position (what its
    LM head read) in slot ``slots[b]`` (S or more: a padding row, dropped): Medusa's heads
    draft from it, so a row that decoded plainly can draft at its next step. With ``eagle``
    (static, a ``decoding.eagle.EagleDraft``; its params ``draft_params`` and one-layer pool
    hk, hv) the slot gets the head's feature instead: the pair (that hidden state, the token
    just drawn) is fed into the pool at the row's position, so the pool stays complete up to
    the row's length as after a verification, and the return also has (hk, hv). Seeds [B] uint32
    and index [B] int32 give each row's key (``row_keys``), ``sampling`` [B] its settings: row ``b`` draws alone
    (as at batch 1), a greedy row (temperature 0) takes the argmax. ``logprobs``:
    ``sampling.Logprobs`` [B] of the tokens under ``logprobs_mode`` (static), computed only
    when some row of ``wanted`` [B] bool asks (else zeros).

    ``prefill``: None, or prompt tokens computed in the same forward, as rows after the B decode
    rows: (tokens [N], positions [N], block table [N, max_pages]), each token a row of its own at
    its position in its request's pages (padding rows: the scratch page). Every row's key and
    value is written before any row attends (models.fused_decode; the jnp scatter likewise), so a
    token sees the earlier tokens of its chunk, and a request whose prompt ends here decodes
    in the same step. The weights stream once for both (``Runner.fold`` says when it pays);
    their logits are dead code.
    """
    model = packed_model(graphdef, params, kernels)
    if prefill is None and states is None:
        TRACES["decode"] += 1
        logits, cache = model(last[:, None], cache=step_cache(k, v, lengths, table))
    else:  # the hidden states wanted, or the prompt tokens as rows B.. of the same forward:
        TRACES["decode" if prefill is None else "mixed"] += 1  # the LM head is the B rows'
        B = last.shape[0]
        rows = (last, lengths, table)
        if prefill is not None:
            rows = [jnp.concatenate([a, b]) for a, b in zip(rows, prefill, strict=True)]
        _, cache, hidden = model(
            rows[0][:, None], cache=step_cache(k, v, *rows[1:]), return_hidden=True
        )
        hidden = hidden[:B]
        logits = model.logits(hidden)
    tokens = sample(logits[:, -1], row_keys(seeds, index), sampling)
    lp = token_logprobs(logits[:, -1], tokens, sampling, logprobs_mode, wanted)
    if states is not None:
        kept, slots = states
        x = hidden[:, -1]
        if eagle is not None:
            block = table.block if isinstance(table, RingTables) else table
            f, hk, hv = eagle.feed(
                model, draft_params, hk, hv, hidden, tokens[:, None], lengths, block
            )
            x = f[:, -1]
        kept = kept.at[slots].set(x.astype(kept.dtype), mode="drop")
        if eagle is not None:  # the target's pools first: the donated inputs' order
            return tokens, lp, cache.k, cache.v, kept, hk, hv
        return tokens, lp, cache.k, cache.v, kept
    return tokens, lp, cache.k, cache.v


def accept_sampled(logits, sampling: SamplingParams, drafts, keys, q=None, lengths=None):
    """``acceptance.accept`` for each row alone, under its own settings and key: logits
    [B, k + 1, V] the target's at the row's k + 1 positions, drafts [B, k], keys [B], q [B, k, V]
    the draft's distributions (None: a deterministic draft, one-hot), lengths [B] or None
    -> (n [B], nxt [B]); a row's draws do not depend on the batch.

    Row by row (``lax.map``): batched, the [B, k + 1, V] distributions, their top-p sorts and
    the one-hot q made a verification's scratch about 90 MB at batch 8 on SmolLM2, past glibc's
    largest reused block (32 MB), so every step mapped it afresh and faulted its pages in,
    greedy steps too (about 3 ms of a 31 ms step)."""

    xs = (logits, sampling, drafts, keys)
    xs += (() if q is None else (q,)) + (() if lengths is None else (lengths,))

    def one(args):
        lg, settings, d, key, *rest = args
        p = probabilities(lg, jax.tree.map(lambda x: x[None], settings))  # [k + 1, V]
        qb = jax.nn.one_hot(d, p.shape[-1]) if q is None else rest.pop(0)
        extra = () if lengths is None else (rest.pop(0)[None],)
        n, nxt = accept(p[None], qb[None], d[None], key, *extra)
        return n[0], nxt[0]

    return jax.lax.map(one, xs)


def verify_rows(
    graphdef,
    draft,
    num_draft,
    logprobs_mode,
    params,
    kernels,
    k,
    v,
    seq,
    lengths,
    table,
    seeds,
    index,
    sampling: SamplingParams,
    wanted,
    draft_params=None,
    state=None,
):
    """Draft and verify for every row: seq [B, L] each row's known tokens (its last one,
    ``seq[b, lengths[b]]``, not yet cached), lengths [B] the cached positions, table [B, W].

    ``draft`` (static) proposes ``num_draft`` = k tokens per row; the target runs on
    ``[last, d_1 .. d_k]`` at positions ``lengths .. lengths + k``. Returns ``(drafted [B, k],
    n [B] the leading draft tokens kept, nxt [B] the target's token after them, logprobs,
    k, v, state)``: the row emits ``drafted[b, :n[b]]`` then ``nxt[b]``, distributed exactly
    as that many tokens sampled one by one (greedy: the target's argmax chain). Its key is
    ``row_keys``' (seed, tokens generated so far), so a row's draws do not depend on the batch.

    ``logprobs``: ``sampling.Logprobs`` [B, k + 1] of the row's emitted tokens under the
    target's distribution at their positions (``drafted[b, j]`` at j < n[b], ``nxt[b]`` at
    j = n[b], later positions meaningless), computed only when some row of ``wanted`` [B] bool
    asks.

    ``state``, the draft's own, in and out (None for prompt lookup):

    * a Medusa draft (``decoding.medusa.MedusaDraft``, a chain) reads ``draft_params`` (the
      heads' params and packed copies) and ``state`` = (h [B, dim], ok [B] bool): each row's
      target hidden state at its last accepted position from its previous step, where ``ok``
      (else zeros: a row's first step drafts from nothing but still verifies exactly); it
      drafts each head's argmax (``MedusaDraft.greedy_chain``) and returns the new h at each
      row's last accepted input;
    * an EAGLE head (``decoding.eagle.EagleDraft``) reads ``draft_params`` and ``state`` =
      (k, v, f [B, dim], ok [B] bool): its one-layer pool at the target's page ids, complete
      up to ``lengths``, and each row's head feature at position ``lengths - 1`` (where
      ``ok``, else zeros); it drafts the head's argmax chain (``EagleDraft.greedy_chain``),
      then feeds the verification's pairs (the target's hidden state at each position, the
      token emitted after it) and returns (k, v, the feature at the last kept position);
    * a model draft (``drafts.ModelDraft``) reads ``draft_params`` (its weights and packed
      copies) and ``state`` = (k, v), its own page pool, at the target's page ids (the block
      table's pages; the scratch page likewise): it re-feeds each row's last two known tokens
      and draws k tokens from its own distributions with keys split from the row's key
      (``DRAFT_SALT``), so they too are the row's own; it returns the pool it wrote.
    """
    TRACES["verify"] += 1
    model = packed_model(graphdef, params, kernels)
    cache = step_cache(k, v, lengths, table)
    keys = row_keys(seeds, index)
    last = jnp.take_along_axis(seq, lengths[:, None], axis=1)
    medusa = isinstance(draft, MedusaDraft)
    eagle = isinstance(draft, EagleDraft)
    block = table.block if isinstance(table, RingTables) else table
    if eagle:
        hk, hv, feat, ok = state
        feat = jnp.where(ok[:, None], feat, jnp.zeros_like(feat))
        ctx = Context(model, cache, seq, draft_params, None)
        drafts, (hk, hv) = draft.greedy_chain(ctx, num_draft, feat, (hk, hv), block)
        deterministic, q, found = True, None, None
        logits, cache, states = model(
            jnp.concatenate([last, drafts], 1), cache=cache, return_hidden=True
        )
    elif isinstance(draft, ModelDraft):
        own = KVCache(k=state[0], v=state[1], lengths=lengths, block_table=block)
        draft_keys = jax.vmap(lambda x: jax.random.fold_in(x, DRAFT_SALT))(keys)
        ctx = Context(model, cache, seq, draft_params, own)
        prop = draft.propose(ctx, num_draft, sampling, draft_keys)
        drafts, deterministic, q, found = prop.tokens, False, prop.q, None
        state = (prop.state.k, prop.state.v)
        logits, cache = model(jnp.concatenate([last, drafts], 1), cache=cache)
    elif not medusa:
        prop = draft.propose(Context(model, cache, seq, None, None), num_draft, sampling, keys[0])
        drafts, deterministic, q, found = prop.tokens, draft.deterministic, prop.q, prop.found
        logits, cache = model(jnp.concatenate([last, drafts], 1), cache=prop.cache)
    else:
        h = jnp.where(state[1][:, None], state[0], jnp.zeros_like(state[0]))
        drafts = draft.greedy_chain(Context(model, cache, seq, draft_params, h), num_draft)
        deterministic, q, found = True, None, None
        logits, cache, states = model(
            jnp.concatenate([last, drafts], 1), cache=cache, return_hidden=True
        )

    def sampled():
        # A deterministic draft's q is one-hot: built there, so greedy steps never make it.
        return accept_sampled(logits, sampling, drafts, keys, None if deterministic else q)

    n, nxt = branch(all_greedy(sampling), lambda: accept_greedy(argmax(logits), drafts), sampled)
    if found is not None:
        # A row with nothing to propose (no n-gram matched) takes its first position's token as
        # a plain decode step samples it (same key, same settings), so its tokens do not depend
        # on whether another row made this step a verification (Runner.run decodes otherwise).
        plain = sample(logits[:, 0], keys, sampling)
        n, nxt = jnp.where(found, n, 0), jnp.where(found, nxt, plain)
    # The emitted token at each of the k + 1 positions: the draft's while accepted, then nxt.
    pos = jnp.arange(num_draft + 1)
    drafted = jnp.pad(drafts, ((0, 0), (0, 1)))
    emitted = jnp.where(pos < n[:, None], drafted, nxt[:, None])
    rows = jax.tree.map(lambda x: x[:, None], sampling)
    lp = token_logprobs(logits, emitted, rows, logprobs_mode, wanted)
    if medusa:  # h at the last accepted input: what produced nxt
        state = jnp.take_along_axis(states, n[:, None, None], axis=1)[:, 0]
    if eagle:  # the pairs (h, the token after it) of every position; those past n + 1 are
        # rewritten before they are read (the pool's length is the target's)
        f, hk, hv = draft.feed(model, draft_params, hk, hv, states, emitted, lengths, block)
        state = (hk, hv, jnp.take_along_axis(f, n[:, None, None], axis=1)[:, 0])
    # The pools in the donated inputs' order (the target's, then the draft's): JAX pairs each
    # donated input with the next output of its shape, and an EAGLE head's layer has a target
    # layer's shape, so the other order paired layer i's input with layer i - 1's output and
    # XLA copied the whole pool every step (twice a plain step's time at batch 8).
    return drafts, n, nxt, lp, cache.k, cache.v, state


def verify_ragged_rows(
    graphdef,
    logprobs_mode,
    params,
    kernels,
    k,
    v,
    last,
    lengths,
    table,
    seeds,
    index,
    sampling: SamplingParams,
    wanted,
    drafts,
):
    """Prompt lookup's drafts (made on the host, ``drafts.lookup_draft``) verified with each
    draft token a row of its own: a row without a draft costs one row, not k + 1.

    The first B rows are ``decode_rows``' (last [B] at lengths [B], table [B, W], seeds, index,
    sampling, wanted [B]; block tables only: an engine without rings); ``drafts`` = (tokens
    [E], positions [E], tables [E, W], owner [N], step [N], where [B, K], count [B]) adds E
    rows (N = B + E; padding rows on the scratch page): row b's draft is ``count[b]`` tokens,
    its j-th at row ``where[b, j]``, fed at position ``lengths[b] + 1 + j`` in row b's pages;
    ``owner[i]`` is the row whose input row i is, ``step[i]`` its place in that row's inputs
    (0 the last token, j + 1 the j-th draft; -1 padding). Every row's key and value is
    written before any row attends (as in ``decode_rows``' ``prefill``), so a draft row sees
    the ones before it.

    Returns ``(n [B], nxt [B], logprobs [N], k, v)``: row b emits its first n[b] draft tokens
    then nxt[b], by :func:`decoding.acceptance.accept` on its ``count[b]`` tokens (one-hot q,
    draws from the row's own key; greedy: the argmax chain); a row without a draft samples its
    token as a plain decode step does, so its tokens are those of a step that verified
    nothing. ``logprobs``: ``sampling.Logprobs`` of the emitted token at each input row (row
    ``where[b, j]``: the token after draft j), under row ``owner[i]``'s settings, computed only
    when some row of ``wanted`` asks."""
    TRACES["ragged"] += 1
    tokens, positions, tables, owner, step, where, count = drafts
    model = packed_model(graphdef, params, kernels)
    B, K = where.shape
    feed = jnp.concatenate([last, tokens])
    logits, cache = model(
        feed[:, None],
        cache=step_cache(
            k, v, jnp.concatenate([lengths, positions]), jnp.concatenate([table, tables])
        ),
    )
    logits = logits[:, -1]  # [N, V]
    ids = jnp.concatenate([jnp.arange(B, dtype=where.dtype)[:, None], where], 1)  # [B, K + 1]
    live = jnp.arange(K) < count[:, None]
    drafted = jnp.where(live, feed[where], 0)  # [B, K], padding 0 (masked by count)
    keys = row_keys(seeds, index)

    def sampled():
        return accept_sampled(logits[ids], sampling, drafted, keys, lengths=count)

    def greedy():
        return accept_greedy(argmax(logits)[ids], jnp.where(live, drafted, -1))

    n, nxt = branch(all_greedy(sampling), greedy, sampled)
    n = jnp.where(count > 0, n, 0)
    nxt = jnp.where(count > 0, nxt, sample(logits[:B], keys, sampling))
    # The token each input row emitted (its row's token at that place), for its logprobs.
    emitted = jnp.where(
        jnp.arange(K + 1) < n[:, None], jnp.pad(drafted, ((0, 0), (0, 1))), nxt[:, None]
    )
    flat = emitted[owner, jnp.maximum(step, 0)]
    settings = jax.tree.map(lambda x: x[owner], sampling)
    lp = token_logprobs(logits, flat, settings, logprobs_mode, wanted[owner] & (step >= 0))
    return n, nxt, lp, cache.k, cache.v


@functools.lru_cache(maxsize=16)
def jitted_ragged(graphdef, logprobs_mode: str = "raw"):
    """``verify_ragged_rows`` jitted for one model structure and logprobs mode, the pool
    donated."""
    fn = functools.partial(verify_ragged_rows, graphdef, logprobs_mode)
    return jax.jit(fn, donate_argnums=(2, 3))


@functools.lru_cache(maxsize=16)
def jitted_verify(graphdef, draft, num_draft: int, logprobs_mode: str = "raw"):
    """``verify_rows`` jitted for one model structure, draft kind, k and logprobs mode, the
    pool donated (and a model draft's pool, its state)."""
    fn = functools.partial(verify_rows, graphdef, draft, num_draft, logprobs_mode)
    own_pool = isinstance(draft, ModelDraft | EagleDraft)  # the state is a pool: donated
    return jax.jit(fn, donate_argnums=(2, 3, 12) if own_pool else (2, 3))


@functools.lru_cache(maxsize=16)
def jitted_eagle_prefill(graphdef, draft):
    """``eagle_prefill_chunk`` jitted for one model structure and head, the pools and the
    slots' features donated."""
    fn = functools.partial(eagle_prefill_chunk, graphdef, draft)
    return jax.jit(fn, donate_argnums=(2, 3, 5, 6, 12))


@functools.lru_cache(maxsize=16)
def jitted(graphdef, logprobs_mode: str = "raw"):
    """``(prefill_chunk, decode_rows)`` jitted for one model structure (and logprobs mode),
    the pool donated.

    The graph definition is closed over (hashed once here, not at every call); cached so that
    engines over the same model share compilations.
    """
    prefill = jax.jit(functools.partial(prefill_chunk, graphdef), donate_argnums=(2, 3))
    decode = jax.jit(functools.partial(decode_rows, graphdef, logprobs_mode), donate_argnums=(2, 3))
    return prefill, decode


@functools.lru_cache(maxsize=16)
def jitted_eagle_decode(graphdef, draft, logprobs_mode: str = "raw"):
    """``decode_rows`` with an EAGLE head's feed (``eagle=draft``), jitted for one model
    structure, head and logprobs mode, the target's pool and the head's donated."""
    fn = functools.partial(decode_rows, graphdef, logprobs_mode, eagle=draft)
    return jax.jit(fn, donate_argnums=(2, 3, 14, 15))


def _copy(x, src, dst):
    """Pages dst[i] = pages src[i] of one layer (``set_rows``: in place for bfloat16 on CPU)."""
    pages = x.reshape(x.shape[0], 1, -1)
    return set_rows(pages, dst, jnp.zeros_like(dst), pages[src, 0]).reshape(x.shape)


@functools.partial(jax.jit, donate_argnames=("k", "v"), static_argnames=("layers",))
def copy_pages(k, v, src, dst, layers=None):
    """Page ``dst[i]`` becomes a copy of page ``src[i]`` in every layer, or in the layers of
    ``layers`` (a tuple of indices: the pool's, not the rings); src, dst [n] int32."""
    TRACES["copy"] += 1
    pick = range(len(k)) if layers is None else layers
    copy = lambda xs: tuple(  # noqa: E731
        _copy(x, src, dst) if i in pick else x for i, x in enumerate(xs)
    )
    return copy(k), copy(v)
