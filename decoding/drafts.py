"""Draft kinds for ``speculative_generate``: what proposes the k tokens the target verifies.

A draft kind is a frozen, hashable object (a static argument of the jitted loop) with:

* ``check(target, k)``: ``ValueError`` naming the argument when it cannot draft for ``target``;
* ``default_num_draft_tokens``: a k without measurements (``default_k``); with
  ``num_draft_tokens=None`` the loops choose k from measured step costs instead (below);
* ``make_state(target, params, cache_kind, batch, page_size, num_pages)``: host side, the
  draft's own pytree state (e.g. a KV cache) and its page tables (or None);
* ``prefill(params, state, tokens, prompt_lengths)``: traced, after the target's prefill;
* ``propose(ctx, k, sampling, key)``: traced, returns a :class:`Proposal`: k tokens [B, k], the
  distributions q [B, k, V] they were drawn from (shaped by the same ``SamplingConfig`` as the
  target's p, one-hot for deterministic drafts), the new draft state, the target cache (a draft
  that shares it may write into it), and how many draft forward calls it made.

``params`` is the draft's array pytree (None when it has none): the loop passes it as a jit
argument, so the weights are not baked into the executable. The verification loop only sees
``Proposal``s and the acceptance rule only q, so a kind that drafts from the target's own hidden
states (Medusa / EAGLE heads) fits the same interface: its heads' weights are ``params``, its
state holds the target's hidden state at the last accepted position, and its ``propose`` makes
no forward call of the target. What it adds to the loop is one hand-off: the verification
forward (``speculative_step``) must also return the final hidden states [B, k+1, dim]
(:func:`forward` runs the blocks explicitly, so it is the place to return them) for the kind to
keep the one at each row's last accepted token. ``decoding/medusa.py`` does so through two optional
kind hooks the loop calls when present: ``start`` (the state after the target's prefill) and
``verify`` (its own verification forward, with ``Transformer(..., return_hidden=True)``).

Draft length. With ``num_draft_tokens=None`` k is chosen, not looked up: the target's cached
forward is timed at Tq = 1 .. K + 1 (and a model draft's at Tq = 1) once per (model config,
dtypes, backend, batch) (:func:`measure_step_costs`), and k maximises expected tokens per second
(:func:`choose_num_draft_tokens`): (1 - a^(k+1)) / (1 - a) tokens per step over the step's
cost, verification at Tq = k + 1 plus the draft's calls, with a the acceptance rate, a kind's
prior (``PRIOR_ACCEPTANCE``) until verification has observed some (:class:`AcceptanceEstimate`,
which the engine keeps per batch). A compute-bound target (a toy on CPU, where verifying k + 1
tokens costs nearly k + 1 steps) gets a small k, a memory-bound one (a real model at small
batch: cost nearly flat in Tq) a larger one.

Kinds here: :class:`ModelDraft` (a smaller ``models.Transformer`` with its own cache),
:class:`PromptLookup` (n-gram lookup in the prompt and generated text) and :class:`EarlyExit`
(the target's first L layers, sharing its cache).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from decoding.checks import check_int
from decoding.generate import _cache_for
from decoding.sampling import probabilities, sample
from models import KVCache
from models.transformer import attach_decode_weights, pack_decode_weights, rope_tables

# The k a kind's ``default_num_draft_tokens`` gives without a target to measure (kinds that are
# asked for it outside ``speculative_generate``, and a fallback); ``speculative_generate`` and
# ``Engine`` choose k from measured step costs instead (:func:`choose_num_draft_tokens`).
DEFAULT_K = {
    "cpu": {"model": 3, "prompt-lookup": 1, "early-exit": 1, "medusa": 1},
    "gpu": {"model": 3, "prompt-lookup": 3, "early-exit": 1, "medusa": 2},
}
# The largest k the cost-based choice considers (and measures Tq = 1 .. MAX_K + 1 for).
MAX_K = 8
# Prior acceptance rate per draft kind (the chance that a drafted token is accepted), the
# starting point of the running estimate; weighed as PRIOR_WEIGHT proposed tokens.
PRIOR_ACCEPTANCE = {"model": 0.6, "prompt-lookup": 0.5, "early-exit": 0.5, "medusa": 0.5}
PRIOR_WEIGHT = 16.0


def default_k(kind: str) -> int:
    """``DEFAULT_K`` for the default backend (``jax.default_backend()``) and draft ``kind``."""
    return DEFAULT_K["cpu" if jax.default_backend() == "cpu" else "gpu"][kind]


class StepCosts(NamedTuple):
    """Measured seconds per call: ``target[t - 1]`` a cached target forward of Tq = t tokens per
    row (t = 1 .. len(target)); ``draft`` one draft forward call (0 for drafts with no model)."""

    target: tuple[float, ...]
    draft: float = 0.0


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens one verification step emits per row when each drafted token is accepted with
    probability ``acceptance`` independently: 1 + a + .. + a^k = (1 - a^(k+1)) / (1 - a)."""
    a = min(max(float(acceptance), 0.0), 1.0)
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def choose_num_draft_tokens(
    costs: StepCosts, acceptance: float, *, draft_calls=None, max_k: int | None = None
) -> int:
    """The k in 1 .. K that maximises expected tokens per second:

        k* = argmax_k  expected_tokens(k, a) / (costs.target[k] + draft_calls(k) * costs.draft)

    ``costs.target[k]`` is a verification (Tq = k + 1); ``draft_calls(k)`` the draft's forward
    calls per step (default k: a model draft); a = ``acceptance``. K = ``max_k`` (default:
    as many as ``costs.target`` covers, len - 1). Ties go to the smaller k. A compute-bound
    target (verifying k + 1 tokens costs about k + 1 steps) gets k = 1; a memory-bound one
    (cost nearly flat in Tq) a k that grows with a.
    """
    K = len(costs.target) - 1 if max_k is None else min(max_k, len(costs.target) - 1)
    if K < 1:
        raise ValueError(f"costs must cover Tq = 1 .. K + 1 with K >= 1, got {costs.target}")
    calls = draft_calls or (lambda k: k)

    def rate(k):
        return expected_tokens(k, acceptance) / (costs.target[k] + calls(k) * costs.draft)

    return max(range(1, K + 1), key=lambda k: (rate(k), -k))


class AcceptanceEstimate:
    """A running acceptance rate: (accepted + prior * weight) / (proposed + weight), so it
    starts at ``prior`` and follows what verification observed."""

    def __init__(self, prior: float, weight: float = PRIOR_WEIGHT):
        self.prior, self.weight = float(prior), float(weight)
        self.accepted = self.proposed = 0

    def update(self, accepted: int, proposed: int) -> None:
        self.accepted += int(accepted)
        self.proposed += int(proposed)

    @property
    def rate(self) -> float:
        return (self.accepted + self.prior * self.weight) / (self.proposed + self.weight)


_COSTS: dict = {}


def _cost_key(model, batch: int, max_tq: int, context: int):
    dtypes = tuple(sorted({str(x.dtype) for x in jax.tree.leaves(nnx.state(model))}))
    return (model.config, dtypes, jax.default_backend(), batch, max_tq, context)


def measure_step_costs(model, max_tq: int, *, batch: int = 1, context: int = 128, repeats: int = 5):
    """Seconds of one cached forward of ``model`` at Tq = 1 .. ``max_tq`` tokens per row for
    ``batch`` rows with ``context`` tokens already cached -> tuple, index t - 1 for Tq = t.

    Each is the median of ``repeats`` calls after one warm-up (which compiles); the decode path's
    packed weights are used as the decode loops use them. Cached per (config, dtypes, backend,
    batch, max_tq, context): measured once per process for a model shape.
    """
    max_tq = check_int("max_tq", max_tq, 1)
    batch, context = check_int("batch", batch, 1), check_int("context", context, 1)
    repeats = check_int("repeats", repeats, 1)
    key = _cost_key(model, batch, max_tq, context)
    if key in _COSTS:
        return _COSTS[key]
    graphdef, params = nnx.split(model)
    kernels = pack_decode_weights(model, params)

    @jax.jit
    def run(params, kernels, tokens, cache):
        return attach_decode_weights(nnx.merge(graphdef, params), kernels)(tokens, cache=cache)[0]

    cache = KVCache.contiguous(model.config, batch, context + max_tq)
    cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
    out = []
    for t in range(1, max_tq + 1):
        tokens = jnp.zeros((batch, t), jnp.int32)
        jax.block_until_ready(run(params, kernels, tokens, cache))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(run(params, kernels, tokens, cache))
            times.append(time.perf_counter() - t0)
        out.append(float(np.median(times)))
    _COSTS[key] = tuple(out)
    return _COSTS[key]


def measured_costs(target, draft_model=None, *, batch: int = 1, max_k: int = MAX_K) -> StepCosts:
    """:class:`StepCosts` of ``target`` at Tq = 1 .. max_k + 1 and of ``draft_model`` (a
    ``models.Transformer`` or None) at Tq = 1, measured once per shape (``measure_step_costs``)."""
    target_costs = measure_step_costs(target, max_k + 1, batch=batch)
    draft = 0.0 if draft_model is None else measure_step_costs(draft_model, 1, batch=batch)[0]
    return StepCosts(target_costs, draft)


class Proposal(NamedTuple):
    """What a draft kind proposes for one verification step.

    tokens: [B, k] int32; q: [B, k, V] float32, the distribution each token was drawn from
    (one-hot for greedy settings; the greedy rule compares tokens only, and for a greedy
    ``SamplingConfig`` XLA drops q as unused);
    state: the draft's new state; cache: the target's cache (changed only by a draft that shares
    it); calls: int, draft forward calls made.
    """

    tokens: jax.Array
    q: jax.Array
    state: Any
    cache: KVCache
    calls: int


class Context(NamedTuple):
    """What ``propose`` may read: the target model and its cache (``cache.lengths`` [B] = tokens
    the target has cached), ``seq`` [B, L] (prompt then new tokens; ``seq[b, lengths[b]]`` is the
    last token, not yet fed), the draft's params and state."""

    target: nnx.Module
    cache: KVCache
    seq: jax.Array
    params: Any
    state: Any


def forward(model, tokens, cache: KVCache, num_layers: int | None = None):
    """The cached forward through the first ``num_layers`` blocks of ``model`` (all by default),
    then its final norm and LM head: tokens [B, T] -> (logits [B, T, V] float32, cache).

    Writes layers ``0 .. num_layers - 1`` of ``cache`` at ``lengths .. lengths + T - 1`` and
    returns ``lengths + T``; the other layers are untouched.
    """
    T = tokens.shape[1]
    L = model.config.num_layers if num_layers is None else num_layers
    positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)
    cos, sin = rope_tables(model.config, positions)
    x = model.embed(tokens)
    k, v = list(cache.k), list(cache.v)
    for i in range(L):
        kv = (k[i], v[i], cache.lengths, cache.block_table)
        x, (k[i], v[i]) = model.layers[i](x, cos, sin, kv=kv)
    logits = model.logits(model.norm(x))
    return logits, cache.replace(k=tuple(k), v=tuple(v), lengths=cache.lengths + T)


def autoregressive_proposal(step, cache, x0, k: int, sampling, key):
    """k tokens from a model draft: ``step(tokens [B, T], cache) -> (logits [B, T, V], cache)``.

    Feeds ``x0`` [B, T0] (its last token is the sequence's last), then each drafted token but the
    last: k forward calls. Returns (tokens [B, k], q [B, k, V], cache).
    """
    logits, cache = step(x0, cache)
    keys = jax.random.split(key, k)

    def draw(logits, j):
        return sample(logits, keys[j], sampling), probabilities(logits, sampling)

    def body(carry, j):
        logits, cache = carry
        tok, q = draw(logits, j)
        logits, cache = step(tok[:, None], cache)
        return (logits[:, -1], cache), (tok, q)

    (logits, cache), (toks, qs) = jax.lax.scan(body, (logits[:, -1], cache), jnp.arange(k - 1))
    last_tok, last_q = draw(logits, k - 1)
    tokens = jnp.concatenate([toks.T, last_tok[:, None]], axis=1)
    q = jnp.concatenate([jnp.moveaxis(qs, 0, 1), last_q[:, None]], 1)
    return tokens, q, cache


def _check_vocab(name: str, vocab: int, target) -> None:
    if vocab != target.config.vocab_size:
        raise ValueError(
            f"{name} has vocab_size {vocab}, the target has {target.config.vocab_size}: "
            "draft and target must share one vocabulary"
        )


@dataclasses.dataclass(frozen=True)
class ModelDraft:
    """A ``models.Transformer`` draft (its ``graphdef``; the weights are ``params``) with its own
    KV cache, kept at the target's length: each step first re-feeds the token before the last,
    so that after a fully accepted step (when the draft never saw its own k-th token) the cache
    is complete again; rejected positions are dropped by setting the length."""

    graphdef: Any
    config: Any

    @property
    def default_num_draft_tokens(self) -> int:
        return default_k("model")

    @classmethod
    def split(cls, model) -> tuple[ModelDraft, Any]:
        graphdef, params = nnx.split(model)
        return cls(graphdef, model.config), params

    def check(self, target, k: int) -> None:
        _check_vocab("draft", self.config.vocab_size, target)

    def make_state(self, target, params, cache_kind: str, batch, page_size: int, num_pages):
        model, n_pad = nnx.merge(self.graphdef, params), len(batch.done) - batch.num_rows
        cap = batch.capacity
        return _cache_for(model, cache_kind, batch.need, n_pad, cap, page_size, num_pages)

    def prefill(self, params, cache, tokens, prompt_lengths):
        _, cache = nnx.merge(self.graphdef, params)(tokens, cache=cache)
        return cache.replace(lengths=prompt_lengths.astype(jnp.int32))

    def propose(self, ctx: Context, k: int, sampling, key) -> Proposal:
        model = nnx.merge(self.graphdef, ctx.params)
        n = ctx.cache.lengths - 1
        x0 = jnp.take_along_axis(ctx.seq, n[:, None] + jnp.arange(2), axis=1)  # [B, 2]
        cache = ctx.state.replace(lengths=n)

        def step(x, c):
            return model(x, cache=c)

        tokens, q, cache = autoregressive_proposal(step, cache, x0, k, sampling, key)
        return Proposal(tokens, q, cache, ctx.cache, k)


@dataclasses.dataclass(frozen=True)
class EarlyExit:
    """Self-speculation (LayerSkip-style): the target's first ``num_layers`` blocks, its final
    norm and LM head draft, sharing the target's cache for those layers.

    No state of its own. Drafting writes layers ``< num_layers`` at positions ``n .. n + k - 1``
    (n = the target's length); the verification forward then rewrites every layer at
    ``n .. n + k`` for the verified tokens, so after the rollback to ``n + accepted + 1`` every
    layer of every kept position holds the target's own K/V (and layer ``i``'s K/V depend only
    on layers ``< i``, so the draft's writes are what the target would have written for its
    tokens anyway).
    """

    num_layers: int

    @property
    def default_num_draft_tokens(self) -> int:
        return default_k("early-exit")

    def __post_init__(self):
        object.__setattr__(
            self, "num_layers", check_int("EarlyExit num_layers", self.num_layers, 1)
        )

    def check(self, target, k: int) -> None:
        if self.num_layers >= target.config.num_layers:
            raise ValueError(
                f"EarlyExit num_layers={self.num_layers} must be smaller than the target's "
                f"num_layers={target.config.num_layers}"
            )

    def make_state(self, target, params, cache_kind, batch, page_size, num_pages):
        return None, None

    def prefill(self, params, state, tokens, prompt_lengths):
        return state

    def propose(self, ctx: Context, k: int, sampling, key) -> Proposal:
        n = ctx.cache.lengths
        last = jnp.take_along_axis(ctx.seq, n[:, None], axis=1)  # [B, 1]

        def step(x, c):
            return forward(ctx.target, x, c, self.num_layers)

        tokens, q, cache = autoregressive_proposal(step, ctx.cache, last, k, sampling, key)
        return Proposal(tokens, q, None, cache.replace(lengths=n), k)


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Prompt-lookup decoding (Hugging Face's ``prompt_lookup_num_tokens``, vLLM's "ngram"): no
    model; the k tokens that followed the most recent earlier occurrence of the sequence's last
    n tokens, for n from ``max_ngram`` down to ``min_ngram`` (the longest n that matches wins).

    A deterministic draft: q is one-hot, so a proposed token x is accepted with probability
    p(x). Positions past the known text, and rows with no match, repeat the last known token.
    """

    max_ngram: int = 3
    min_ngram: int = 1

    @property
    def default_num_draft_tokens(self) -> int:
        return default_k("prompt-lookup")

    def __post_init__(self):
        for name in ("max_ngram", "min_ngram"):
            object.__setattr__(
                self, name, check_int(f"PromptLookup {name}", getattr(self, name), 1)
            )
        if self.min_ngram > self.max_ngram:
            raise ValueError(
                f"PromptLookup min_ngram={self.min_ngram} must be <= max_ngram={self.max_ngram}"
            )

    def check(self, target, k: int) -> None:
        pass

    def make_state(self, target, params, cache_kind, batch, page_size, num_pages):
        return None, None

    def prefill(self, params, state, tokens, prompt_lengths):
        return state

    def propose(self, ctx: Context, k: int, sampling, key) -> Proposal:
        V = ctx.target.config.vocab_size
        tokens = lookup(ctx.seq, ctx.cache.lengths + 1, k, self.min_ngram, self.max_ngram)
        q = jax.nn.one_hot(tokens, V, dtype=jnp.float32)
        return Proposal(tokens, q, None, ctx.cache, 0)


def lookup(seq, length, k: int, min_ngram: int, max_ngram: int, *, return_found: bool = False):
    """The n-gram lookup of :class:`PromptLookup`: seq [B, L], length [B] (known tokens per row)
    -> [B, k] int32 proposals; with ``return_found``, ``(found [B] bool, proposals)``, found
    where some n-gram matched.

    One pass for every n: ``m[b, e]``, the number of tokens before and at ``e`` that equal the
    last known ones (the common suffix of ``seq[b, :e+1]`` and ``seq[b, :length]``, capped at
    ``max_ngram``), is counted by a ``fori_loop`` over ``j < max_ngram``, so the program's
    size does not grow with ``max_ngram`` (its work is O(max_ngram * L)). The longest matching
    n is ``min(max_ngram, max_e m)`` (a match of n is one of every shorter n), kept if it is
    at least ``min_ngram``; its continuation starts after the latest ``e`` with ``m >= n``.
    """
    B, L = seq.shape
    pos = jnp.arange(L)
    last = length[:, None] - 1

    def count(j, carry):
        run, m = carry  # run: the suffix match so far is unbroken
        here = jnp.take_along_axis(seq, jnp.clip(pos[None] - j, 0, L - 1), axis=1)
        tail = jnp.take_along_axis(seq, jnp.maximum(last - j, 0), axis=1)
        run &= (here == tail) & (pos[None] >= j) & (last >= j)
        return run, m + run

    end_ok = pos[None] < last  # a continuation exists after e
    init = (jnp.broadcast_to(end_ok, (B, L)), jnp.zeros((B, L), jnp.int32))
    _, m = jax.lax.fori_loop(0, max_ngram, count, init, unroll=min(max_ngram, 4))
    n = jnp.minimum(jnp.max(m, axis=1), max_ngram)  # the longest n with a match
    found = n >= min_ngram
    latest = jnp.max(jnp.where(m >= jnp.maximum(n, 1)[:, None], pos[None], -1), axis=1)
    cont = jnp.where(found, latest + 1, -1)
    idx = jnp.where(cont[:, None] >= 0, cont[:, None] + jnp.arange(k), last)
    idx = jnp.minimum(idx, last)
    tokens = jnp.take_along_axis(seq, idx, axis=1).astype(jnp.int32)
    return (found, tokens) if return_found else tokens
