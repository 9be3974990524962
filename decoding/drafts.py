"""Draft kinds for ``speculative_generate``: what proposes the k tokens the target verifies.

A draft kind is a frozen, hashable object (a static argument of the jitted loop) that
implements :class:`DraftKind`, a ``typing.Protocol``: ``check``, ``default_num_draft_tokens``,
``costs`` (for choosing k), ``place`` (its params on a sharded target's mesh), ``make_state`` /
``prefill`` (the draft's own state, e.g. a KV
cache), ``propose`` (k tokens and the distributions q they were drawn from, as a
:class:`Proposal`) and ``verify`` (the target's forward on them and the acceptance rule, as a
:class:`Verified`). The protocol's own methods are the common case (no state, the chain
verification of :func:`verify_chain`); the kinds here subclass it and override what differs, and
``speculative.py`` calls only these methods.

``params`` is the draft's array pytree (None when it has none): the loop passes it as a jit
argument, so the weights are not baked into the executable. The verification loop only sees
``Proposal``s and the acceptance rule only q, so a kind that drafts from the target's own hidden
states (Medusa / EAGLE heads, ``decoding/medusa.py``) fits the same protocol: its heads' weights
are ``params``, its state holds the target's hidden state at the last accepted position (set by
its ``prefill`` from the target's cache), its ``propose`` makes no forward call of the target,
and its ``verify`` also asks the target for the hidden states (``Transformer(...,
return_hidden=True)``) to keep the one at each row's last accepted token.

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
import functools
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from decoding.acceptance import verify
from decoding.checks import check_int
from decoding.generate import make_cache
from decoding.packing import packed_model, packed_weights
from decoding.sampling import all_greedy, branch, probabilities, sample
from models import KVCache
from models.sharding import mesh_of, replicated
from models.transformer import rope_tables

# The k a kind's ``default_num_draft_tokens`` gives without a target to measure (kinds that are
# asked for it outside ``speculative_generate``, and a fallback); ``speculative_generate`` and
# ``Engine`` choose k from measured step costs instead (:func:`choose_num_draft_tokens`).
DEFAULT_K = {
    "cpu": {"model": 3, "prompt-lookup": 1, "early-exit": 1, "medusa": 1, "eagle": 3},
    "gpu": {"model": 3, "prompt-lookup": 3, "early-exit": 1, "medusa": 2, "eagle": 4},
}
# The largest k the cost-based choice considers (and measures Tq = 1 .. MAX_K + 1 for).
MAX_K = 8
# Prior acceptance rate per draft kind (the chance that a drafted token is accepted), the
# starting point of the running estimate; weighed as PRIOR_WEIGHT proposed tokens.
PRIOR_ACCEPTANCE = {
    "model": 0.6,
    "prompt-lookup": 0.5,
    "early-exit": 0.5,
    "medusa": 0.5,
    "eagle": 0.6,
}
PRIOR_WEIGHT = 16.0
# Tested draft positions over which the running estimate's observations fade (by 1/e): a few
# requests' worth, so k follows the workload running now.
HORIZON = 256.0


def default_k(kind: str) -> int:
    """``DEFAULT_K`` for the default backend (``jax.default_backend()``) and draft ``kind``."""
    return DEFAULT_K["cpu" if jax.default_backend() == "cpu" else "gpu"][kind]


class StepCosts(NamedTuple):
    """Measured seconds per call: ``target[t - 1]`` a cached target forward of Tq = t tokens per
    row (t = 1 .. len(target)); ``draft`` one draft forward call (0 for drafts with no model)."""

    target: tuple[float, ...]
    draft: float = 0.0


# How much faster (expected tokens per second) a new k must be than the one in use to replace it
# (``choose_num_draft_tokens(keep=)``).
KEEP_MARGIN = 0.05


def expected_tokens(k: int, acceptance: float) -> float:
    """Tokens one verification step emits per row when each drafted token is accepted with
    probability ``acceptance`` independently: 1 + a + .. + a^k = (1 - a^(k+1)) / (1 - a)."""
    a = min(max(float(acceptance), 0.0), 1.0)
    return float(k + 1) if a == 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def choose_num_draft_tokens(
    costs: StepCosts,
    acceptance: float,
    *,
    draft_calls=None,
    max_k: int | None = None,
    allow_zero: bool = False,
    keep: int | None = None,
    drafting: float = 1.0,
) -> int:
    """The k in 1 .. K (0 .. K with ``allow_zero``) that maximises expected tokens per second:

        k* = argmax_k  (1 + f * (expected_tokens(k, a) - 1))
                       / (costs.target[k] + draft_calls(k) * costs.draft)

    ``costs.target[k]`` is a verification (Tq = k + 1); ``draft_calls(k)`` the draft's forward
    calls per step (default k: a model draft); a = ``acceptance``. K = ``max_k`` (default:
    as many as ``costs.target`` covers, len - 1). Ties go to the smaller k. A compute-bound
    target (verifying k + 1 tokens costs about k + 1 steps) gets k = 1; a memory-bound one
    (cost nearly flat in Tq) a k that grows with a. k = 0 is a plain step (one token, no draft
    call): with ``allow_zero`` it wins where no k pays for its verification (the engine at a
    batch whose rows rarely accept).

    ``drafting``, f: the fraction of rows that get a draft. A verification costs the same for
    every row, but a row with nothing to propose (prompt lookup without a match) emits its one
    token: at batch 8 on SmolLM2 a fifth of the rows had none, which alone turned k = 1 from a
    gain into a loss.

    ``keep``: the k in use (or None). It stays unless the best k is expected to be more than
    ``KEEP_MARGIN`` faster: near the optimum the rate is flat in k, so a running estimate's
    noise would otherwise move k back and forth, and every new k is one more compilation.
    """
    K = len(costs.target) - 1 if max_k is None else min(max_k, len(costs.target) - 1)
    if K < 1:
        raise ValueError(f"costs must cover Tq = 1 .. K + 1 with K >= 1, got {costs.target}")
    calls = draft_calls or (lambda k: k)

    def rate(k):
        if k == 0:
            return 1.0 / costs.target[0]
        f = min(max(float(drafting), 0.0), 1.0)
        tokens = 1.0 + f * (expected_tokens(k, acceptance) - 1.0)
        return tokens / (costs.target[k] + calls(k) * costs.draft)

    best = max(range(0 if allow_zero else 1, K + 1), key=lambda k: (rate(k), -k))
    lo = 0 if allow_zero else 1
    if keep is not None and lo <= keep <= K and rate(best) <= rate(keep) * (1.0 + KEEP_MARGIN):
        return keep
    return best


class ObservedCosts:
    """Seconds per step as a caller ran them, per k (0: a plain step, one token per row; k: a
    verification of k drafts, its draft's calls included), each a running mean that follows
    the last ``HORIZON_STEPS`` or so steps.

    :meth:`apply` puts them in place of measured costs: the measurement times the bare forward
    at a fixed context on padding rows, which on SmolLM2 at batch 8 priced a k = 1 verification
    at 1.35 decode steps where the engine's own steps (real contexts, the lookup and acceptance
    around the forward) took 1.45. A k not observed yet keeps its measured cost scaled by the
    mean ratio of observed to measured over the ks that were.
    """

    HORIZON_STEPS = 32

    def __init__(self):
        self.seconds: dict[int, float] = {}
        self._weight: dict[int, float] = {}

    def observe(self, k: int, seconds: float) -> None:
        w = min(self._weight.get(k, 0.0) + 1.0, float(self.HORIZON_STEPS))
        old = self.seconds.get(k, seconds)
        self.seconds[k] = old + (float(seconds) - old) / w
        self._weight[k] = w

    def count(self, k: int) -> float:
        """The weight of k's mean: its observations, up to ``HORIZON_STEPS``."""
        return self._weight.get(k, 0.0)

    def apply(self, costs: StepCosts, draft_calls=None) -> StepCosts:
        """``costs`` as whole-step seconds (a draft's calls folded into each k's cost, draft 0)
        with the observed ones in place."""
        calls = draft_calls or (lambda k: k)
        total = [t + (calls(k) * costs.draft if k else 0.0) for k, t in enumerate(costs.target)]
        seen = [k for k in self.seconds if k < len(total)]
        scale = float(np.mean([self.seconds[k] / total[k] for k in seen])) if seen else 1.0
        out = [self.seconds[k] if k in self.seconds else t * scale for k, t in enumerate(total)]
        return StepCosts(tuple(out), 0.0)


class AcceptanceEstimate:
    """A running acceptance rate a, the chance that a drafted token is accepted given that the
    ones before it were (what :func:`expected_tokens` assumes): accepted tokens over the draft
    positions that verification actually tested, (accepted + prior * weight) / (tested +
    weight), so it starts at ``prior`` and follows what verification observed.

    A step that accepts n of k tested n + 1 positions when n < k (the first rejection ends it:
    the positions after it were never judged) and k when n = k: the maximum-likelihood a of
    the truncated geometric law. Accepted over proposed (k every step) would count the untested
    positions as rejections and underrate a drafter whose runs are long, the more so the larger
    k, pulling the choice of k down exactly where a larger k pays (copying spans).

    Observations fade with ``horizon`` tested positions (each update scales the earlier counts
    by exp(-tested / horizon)), so the rate follows the requests running now (an engine serving
    a copy task after open chat) instead of everything since it started.
    """

    def __init__(self, prior: float, weight: float = PRIOR_WEIGHT, horizon: float = HORIZON):
        self.prior, self.weight, self.horizon = float(prior), float(weight), float(horizon)
        self.accepted = self.tested = 0.0

    def update(self, accepted: int, proposed: int) -> None:
        """One row's verification step: ``accepted`` of its ``proposed`` (k) drafted tokens."""
        accepted, proposed = int(accepted), int(proposed)
        tested = accepted + (accepted < proposed)
        fade = math.exp(-tested / self.horizon)
        self.accepted = self.accepted * fade + accepted
        self.tested = self.tested * fade + tested

    def add(self, accepted: int, tested: int) -> None:
        """Many steps at once: ``accepted`` of ``tested`` judged positions (their sums)."""
        fade = math.exp(-float(tested) / self.horizon)
        self.accepted = self.accepted * fade + float(accepted)
        self.tested = self.tested * fade + float(tested)

    @property
    def rate(self) -> float:
        return (self.accepted + self.prior * self.weight) / (self.tested + self.weight)


_COSTS: dict = {}


def _cost_key(model, batch: int, max_tq: int, context: int, params=None):
    state = nnx.state(model) if params is None else params  # the walk: 9 ms for SmolLM2
    dtypes = tuple(sorted({str(x.dtype) for x in jax.tree.leaves(state)}))
    return (model.config, dtypes, jax.default_backend(), batch, max_tq, context)


def measure_step_costs(
    model, max_tq: int, *, batch: int = 1, context: int = 128, repeats: int = 5, params=None
):
    """Seconds of one cached forward of ``model`` at Tq = 1 .. ``max_tq`` tokens per row for
    ``batch`` rows with ``context`` tokens already cached -> tuple, index t - 1 for Tq = t.

    After one warm-up call per Tq (which compiles), ``repeats`` rounds each time every Tq once,
    in turn, so a change in the machine's speed hits every Tq alike; each Tq keeps its fastest
    call (on a shared machine a call is only ever slowed down), and the costs are then made
    non-decreasing in Tq (a running maximum: verifying more tokens never costs less, and a
    noisy cheap reading would otherwise pull k there). The decode path's packed weights are
    used as the decode loops use them, so a Tq that the fused CPU decode layer
    (``models.fused_decode``) serves is timed fused and one it does not unfused. Cached per
    (config, dtypes, backend, batch, max_tq, context): measured once per process for a shape.
    ``params``: ``nnx.split(model)[1]`` where the caller has it, so that looking the shape up
    reads their dtypes instead of walking the model's modules again.
    """
    max_tq = check_int("max_tq", max_tq, 1)
    batch, context = check_int("batch", batch, 1), check_int("context", context, 1)
    repeats = check_int("repeats", repeats, 1)
    key = _cost_key(model, batch, max_tq, context, params)
    if key in _COSTS:
        return _COSTS[key]
    graphdef, params = nnx.split(model)
    packed = packed_weights(model, params)

    # The cache is donated and handed back, as the decode loops and the engine do: otherwise
    # every call copies it before writing into it (8 rows of SmolLM2 at 137 positions: 50 MB,
    # which made Tq = 1 cost 41 ms here against 29 ms in the engine, and k look cheaper).
    @functools.partial(jax.jit, donate_argnums=(3,))
    def run(params, packed, tokens, cache):
        logits, cache = packed_model(graphdef, params, packed)(tokens, cache=cache)
        return logits, cache.replace(lengths=jnp.full((batch,), context, jnp.int32))

    cache = KVCache.contiguous(model.config, batch, context + max_tq)
    cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
    tokens = [jnp.zeros((batch, t), jnp.int32) for t in range(1, max_tq + 1)]
    for x in tokens:
        out, cache = run(params, packed, x, cache)
        jax.block_until_ready(out)
    best = [float("inf")] * max_tq
    for _ in range(repeats):
        for i, x in enumerate(tokens):
            t0 = time.perf_counter()
            out, cache = run(params, packed, x, cache)
            jax.block_until_ready(out)
            best[i] = min(best[i], time.perf_counter() - t0)
    _COSTS[key] = tuple(float(c) for c in np.maximum.accumulate(best))
    return _COSTS[key]


def measured_costs(
    target, draft_model=None, *, batch: int = 1, max_k: int = MAX_K, params=None
) -> StepCosts:
    """:class:`StepCosts` of ``target`` at Tq = 1 .. max_k + 1 and of ``draft_model`` (a
    ``models.Transformer`` or None) at Tq = 1, measured once per shape (``measure_step_costs``;
    ``params``: the target's, where the caller has split it)."""
    target_costs = measure_step_costs(target, max_k + 1, batch=batch, params=params)
    draft = 0.0 if draft_model is None else measure_step_costs(draft_model, 1, batch=batch)[0]
    return StepCosts(target_costs, draft)


class Proposal(NamedTuple):
    """What a draft kind proposes for one verification step.

    tokens: [B, k] int32; q: [B, k, V] float32, the distribution each token was drawn from
    (one-hot for greedy settings; the greedy rule compares tokens only, and for a greedy
    ``SamplingConfig`` XLA drops q as unused);
    state: the draft's new state; cache: the target's cache (changed only by a draft that shares
    it); calls: int, draft forward calls made; found: [B] bool or None, whether the row has a
    real draft (prompt lookup: an n-gram matched). When no live row has one the loop runs a
    plain Tq = 1 step instead of verifying tokens that are only filler. cut: None, or (m, long)
    with m a static int < k and long [B] bool, the rows whose real draft runs past m tokens (a
    long lookup draft where the row's n-gram matched; the others' tokens past a head's m are
    filler): where no live row's does (the loop masks done rows), :func:`verify_chain`
    verifies the first m alone (Tq = m + 1).
    """

    tokens: jax.Array
    q: jax.Array
    state: Any
    cache: KVCache
    calls: int
    found: Any = None
    cut: Any = None


class Context(NamedTuple):
    """What ``propose`` may read: the target model and its cache (``cache.lengths`` [B] = tokens
    the target has cached), ``seq`` [B, L] (prompt then new tokens; ``seq[b, lengths[b]]`` is the
    last token, not yet fed), the draft's params and state; in a prefill of a kind with
    ``prompt_hidden``, ``hidden`` [B, Tp, dim], the target's last hidden states over the prompts
    from its own prefill."""

    target: nnx.Module
    cache: KVCache
    seq: jax.Array
    params: Any
    state: Any
    hidden: Any = None


class Verified(NamedTuple):
    """A verification step's outcome: tokens [B, k] (the draft path whose first n are kept),
    n [B] int32, nxt [B] int32 (the target's token after them), the target's cache (lengths
    not yet rolled back) and the draft's new state."""

    tokens: jax.Array
    n: jax.Array
    nxt: jax.Array
    cache: Any
    state: Any


def verify_chain(target, last, prop: Proposal, sampling, key, hidden=False):
    """The target's forward on ``[last, d_1 .. d_k]`` (last [B, 1]) and the acceptance rule;
    with ``prop.cut = (m, long)``, on ``[last, d_1 .. d_m]`` alone where no row is ``long`` (a second
    branch of one ``lax.cond``: on SmolLM2 in float32 on a 2-core CPU, Tq = 8 costs 1.2-1.3x
    Tq = 1 and Tq = 4 about 1.1x).

    Returns (n [B], nxt [B], cache, hidden states [B, k+1, dim] or None; rows past m + 1 zero
    after a short verification).
    """

    def first(w: int):
        def run():
            draft = prop.tokens[:, :w]
            out = target(jnp.concatenate([last, draft], 1), cache=prop.cache, return_hidden=hidden)
            q = None if prop.q is None else prop.q[:, :w]
            n, nxt = verify(out[0], q, draft, sampling, key)
            pad = ((0, 0), (0, prop.tokens.shape[1] - w), (0, 0))
            return n, nxt, out[1], jnp.pad(out[2], pad) if hidden else None

        return run

    k = prop.tokens.shape[1]
    if prop.cut is None:
        return first(k)()
    m, long = prop.cut
    return jax.lax.cond(jnp.any(long), first(k), first(m))


class DraftCosts(NamedTuple):
    """What choosing k (:func:`choose_num_draft_tokens`) needs of a kind: ``prior``, its
    acceptance rate before any is observed; ``model``, the model whose Tq = 1 step one draft
    call costs (None: no measured cost; the target itself: a share of its step, e.g. early
    exit); ``calls(k)``, draft calls per step in units of that cost; ``max_k``, the largest k;
    ``fixed_k``, the only k it drafts (a token tree's depth) or None."""

    prior: float
    model: Any = None
    calls: Callable[[int], float] = lambda k: 0
    max_k: int = MAX_K
    fixed_k: int | None = None


@runtime_checkable
class DraftKind(Protocol):
    """What ``speculative_generate``'s loop asks of a draft kind (module docstring). A kind is a
    frozen, hashable object, a static argument of the jitted loop; the methods marked traced run
    inside it. The bodies here are the common case; a kind overrides what differs.

    ``verify_width``: cache slots a verification writes past the last token where that is more
    than k (a token tree's nodes; 0 for a chain, which writes k). ``prefill_calls``: draft
    forward calls its prefill makes. ``deterministic``: every proposed token is a function of
    the context, not a draw (q is one-hot on it), so a verifier may build q from the tokens
    (``jax.nn.one_hot``) instead of carrying ``Proposal.q``; every kind states it.
    ``prompt_hidden``: its prefill reads the target's hidden states over the prompts
    (``Context.hidden``), which the target's prefill then returns: no second pass for them.
    """

    verify_width: int = 0
    prefill_calls: int = 0
    deterministic: bool = False
    prompt_hidden: bool = False

    @property
    def default_num_draft_tokens(self) -> int:
        """A k without measurements (``default_k``, :data:`DEFAULT_K`)."""
        ...

    def check(self, target, k: int) -> None:
        """``ValueError`` naming the argument when it cannot draft k tokens for ``target``."""

    def costs(self, target, params) -> DraftCosts:
        """Its :class:`DraftCosts` for ``target``."""
        ...

    def place(self, draft, params, target):
        """Host side: ``params`` placed where ``target``'s loop runs (``draft``: what the user
        passed). Replicated over a sharded target's mesh (the user's arrays are not moved);
        ``ValueError`` where the kind cannot run there."""
        if mesh_of(target) is not None and params is not None:
            return jax.device_put(params, replicated(target))
        return params

    def make_state(self, target, params, cache_kind: str, batch, page_size: int, num_pages):
        """Host side: the draft's own pytree state (e.g. a KV cache) for the bucketed ``batch``
        (``decoding.generate.Batch``) and its page tables to free afterwards (or None)."""
        return None, None

    def prefill(self, ctx: Context, tokens, prompt_lengths):
        """Traced, after the target's prefill (``ctx.cache`` holds the prompts, ``ctx.state`` is
        ``make_state``'s state): the draft's state for the first step."""
        return ctx.state

    def propose(self, ctx: Context, k: int, sampling, key) -> Proposal:
        """Traced: k tokens [B, k] and the distributions q [B, k, V] they were drawn from (shaped
        by the same ``SamplingConfig`` as the target's p, one-hot for deterministic drafts)."""
        ...

    def verify(self, target, params, last, prop: Proposal, sampling, key) -> Verified:
        """Traced: the target's forward on ``[last, proposal]`` and the acceptance rule."""
        n, nxt, cache, _ = verify_chain(target, last, prop, sampling, key)
        return Verified(prop.tokens, n, nxt, cache, prop.state)


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


def autoregressive_proposal(step, cache, logits, k: int, sampling, key):
    """k tokens from a model draft: ``step(tokens [B, T], cache) -> (logits [B, T, V], cache)``.

    ``logits`` [B, V]: the draft's prediction for the first token (the caller fed what comes
    before it into ``cache``); then each drafted token but the last is fed: k - 1 forward calls.
    ``key``: one PRNG key, or one per row (keys [B]: row b's tokens are drawn from its own, so
    they do not depend on the other rows). Returns (tokens [B, k], q [B, k, V], cache).
    """
    keys = split_keys(key, k)

    def body(carry, j):
        logits, cache = carry
        tok = sample(logits, keys[j], sampling)
        nxt, cache = step(tok[:, None], cache)
        return (nxt[:, -1], cache), (tok, logits)

    (last, cache), (toks, seen) = jax.lax.scan(body, (logits, cache), jnp.arange(k - 1))
    tokens = jnp.concatenate([toks.T, sample(last, keys[k - 1], sampling)[:, None]], axis=1)

    def drawn():  # step by step: ``sampling`` may hold one setting per row, [B]
        steps = [seen[j] for j in range(k - 1)] + [last]
        return jnp.stack([probabilities(x, sampling) for x in steps], 1)

    return tokens, draft_q(tokens, last.shape[-1], drawn, sampling), cache


def split_keys(key, k: int):
    """k keys [k] from one key, or [k, B] from per-row keys [B] (each row's split alone)."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if (key.ndim if typed else key.ndim - 1) == 0:
        return jax.random.split(key, k)
    return jnp.moveaxis(jax.vmap(lambda x: jax.random.split(x, k))(key), 0, 1)


def check_vocab(name: str, vocab: int, target) -> None:
    """``ValueError`` unless a draft's ``vocab`` (``name`` in the message) is the target's."""
    if vocab != target.config.vocab_size:
        raise ValueError(
            f"{name} has vocab_size {vocab}, the target has {target.config.vocab_size}: "
            "draft and target must share one vocabulary"
        )


@dataclasses.dataclass(frozen=True)
class ModelDraft(DraftKind):
    """A ``models.Transformer`` draft (its ``graphdef``; ``params`` are its weights and their
    packed copies for few-row products, ``decoding.packing.packed_weights``) with its own KV
    cache, kept at the target's length: each step first re-feeds the token before the last, so
    that after a fully accepted step (when the draft never saw its own k-th token) the cache is
    complete again; rejected positions are dropped by setting the length (or, in the engine's
    page pool, overwritten by the next step's feed).

    Its state is a ``models.KVCache`` (``make_state``); the engine passes its own page pool
    there (``decoding.engine_steps.verify_rows``), with per-row keys."""

    graphdef: Any
    config: Any
    prefill_calls = 1  # its prefill is a forward call of the draft model
    deterministic = False  # draws its tokens from its own distributions

    @property
    def default_num_draft_tokens(self) -> int:
        return default_k("model")

    def costs(self, target, params) -> DraftCosts:
        return DraftCosts(
            PRIOR_ACCEPTANCE["model"], nnx.merge(self.graphdef, params[0]), lambda k: k
        )

    def place(self, draft, params, target):
        """A model draft has its own cache, which ``models.shard`` places: it must be sharded
        over the target's mesh itself (or neither sharded)."""
        mesh = mesh_of(target)
        if mesh_of(draft) != mesh:
            where = "not sharded" if mesh is None else f"sharded over {mesh.shape_tuple}"
            raise ValueError(
                f"the target is {where} but the draft model is "
                + ("not sharded" if mesh_of(draft) is None else "sharded over another mesh")
                + ": shard both over the same mesh (models.shard(draft, target.mesh)) or neither"
            )
        return params

    @classmethod
    def split(cls, model) -> tuple[ModelDraft, Any]:
        """(the static kind, params: the weights and their packed copies)."""
        graphdef, params = nnx.split(model)
        return cls(graphdef, model.config), (params, packed_weights(model, params))

    def model(self, params) -> nnx.Module:
        """The draft model (traceable), its packed weights attached."""
        return packed_model(self.graphdef, *params)

    def check(self, target, k: int) -> None:
        check_vocab("draft", self.config.vocab_size, target)

    def make_state(self, target, params, cache_kind: str, batch, page_size: int, num_pages):
        model, n_pad = nnx.merge(self.graphdef, params[0]), len(batch.done) - batch.num_rows
        cap = batch.capacity
        return make_cache(model, cache_kind, batch.need, n_pad, cap, page_size, num_pages)

    def prefill(self, ctx: Context, tokens, prompt_lengths):
        _, cache = nnx.merge(self.graphdef, ctx.params[0])(tokens, cache=ctx.state)
        return cache.replace(lengths=prompt_lengths.astype(jnp.int32))

    def propose(self, ctx: Context, k: int, sampling, key) -> Proposal:
        """Feeds the row's last two known tokens at ``n - 1, n`` (n = the target's length; at
        n = 0 only the last counts: the second position is overwritten by the next feed), then
        drafts k tokens (``autoregressive_proposal``; ``key`` one, or one per row)."""
        model = self.model(ctx.params)
        n = ctx.cache.lengths
        start = jnp.maximum(n - 1, 0)
        x0 = jnp.take_along_axis(ctx.seq, start[:, None] + jnp.arange(2), axis=1)  # [B, 2]
        logits, cache = model(x0, cache=ctx.state.replace(lengths=start))
        first = jnp.take_along_axis(logits, (n - start)[:, None, None], axis=1)[:, 0]
        cache = cache.replace(lengths=n + 1)

        def step(x, c):
            return model(x, cache=c)

        tokens, q, cache = autoregressive_proposal(step, cache, first, k, sampling, key)
        return Proposal(tokens, q, cache, ctx.cache, k)


@dataclasses.dataclass(frozen=True)
class EarlyExit(DraftKind):
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
    deterministic = False  # draws its tokens from the shallow model's distributions

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

    def costs(self, target, params) -> DraftCosts:
        # Its calls run num_layers of the target's layers: counted as that share of a step.
        share = self.num_layers / target.config.num_layers
        return DraftCosts(PRIOR_ACCEPTANCE["early-exit"], target, lambda k: k * share)

    def propose(self, ctx: Context, k: int, sampling, key) -> Proposal:
        n = ctx.cache.lengths
        last = jnp.take_along_axis(ctx.seq, n[:, None], axis=1)  # [B, 1]

        def step(x, c):
            return forward(ctx.target, x, c, self.num_layers)

        logits, cache = step(last, ctx.cache)
        tokens, q, cache = autoregressive_proposal(step, cache, logits[:, -1], k, sampling, key)
        return Proposal(tokens, q, None, cache.replace(lengths=n), k)


@dataclasses.dataclass(frozen=True)
class PromptLookup(DraftKind):
    """Prompt-lookup decoding (Hugging Face's ``prompt_lookup_num_tokens``, vLLM's "ngram"): no
    model; the k tokens that followed the most recent earlier occurrence of the sequence's last
    n tokens, for n from ``max_ngram`` down to ``min_ngram`` (the longest n that matches wins).

    A deterministic draft: q is one-hot, so a proposed token x is accepted with probability
    p(x). Positions past the known text, and rows with no match, repeat the last known token.
    """

    max_ngram: int = 3
    min_ngram: int = 1
    deterministic = True  # copies tokens: q is one-hot

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

    def costs(self, target, params) -> DraftCosts:
        return DraftCosts(PRIOR_ACCEPTANCE["prompt-lookup"])

    def propose(self, ctx: Context, k: int, sampling, key) -> Proposal:
        V = ctx.target.config.vocab_size
        found, tokens = lookup(
            ctx.seq, ctx.cache.lengths + 1, k, self.min_ngram, self.max_ngram, return_found=True
        )
        q = jax.nn.one_hot(tokens, V, dtype=jnp.float32)
        return Proposal(tokens, q, None, ctx.cache, 0, found)


def lookup_found(tokens, min_ngram: int, max_ngram: int) -> bool:
    """Whether :func:`lookup` finds a match for one row of known ``tokens`` on the host: some
    suffix n-gram (``min_ngram`` <= n <= ``max_ngram``) occurred earlier. The engine asks its
    per-request :class:`NgramIndex` the same (a non-empty draft) and skips a verification where
    no running row has one."""
    return bool(lookup_draft(tokens, min_ngram, max_ngram, 1))


def lookup_draft(tokens, min_ngram: int, max_ngram: int, k: int) -> list[int]:
    """:func:`lookup`'s proposal for one row of known ``tokens``, on the host (numpy), without
    its filler: up to k tokens that followed the latest earlier occurrence of the longest
    matching suffix n-gram (``max_ngram`` down to ``min_ngram``), fewer where the known text
    ends first, none where no n-gram matched. The engine's ragged verification
    (``Runner.verify_ragged``) verifies exactly these."""
    t = np.asarray(tokens)
    L = len(t)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(t[: L - 1], n)  # each ends before L - 1
        hits = np.flatnonzero((windows == t[L - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return t[start : start + max(k, 0)].tolist()
    return []


class NgramIndex:
    """:func:`lookup_draft` for one growing token list, kept up to date as it grows: the
    latest occurrence with a continuation of every n-gram (``min_ngram`` <= n <=
    ``max_ngram``), in a dict. Adding a token indexes ``max_ngram - min_ngram + 1`` n-grams
    and a draft is at most that many dict lookups, so the engine's per-step lookups cost the
    same at any length; :func:`lookup_draft` scans the whole list per call (about 1 ms per
    row and step at a few hundred tokens: 3 ms of a 35 ms batch-8 step on SmolLM2 with the
    engine's two lookups per row). ``draft`` catches up with the tokens appended since its
    last call. It takes the list to have only grown (a request's tokens do): one shorter than
    the part indexed, or with another token where that part ended, is indexed anew; other
    changes inside the indexed part are not seen."""

    def __init__(self, min_ngram: int, max_ngram: int):
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._latest: dict[tuple, int] = {}  # n-gram -> where its latest continuation starts
        self._seen = 0  # tokens indexed: every n-gram ending before _seen - 1
        self._tail = None  # tokens[_seen - 1]

    def _update(self, tokens) -> None:
        L = len(tokens)
        if L < self._seen or (self._seen and tokens[self._seen - 1] != self._tail):
            self._latest, self._seen = {}, 0
        lo, hi, latest = self.min_ngram, self.max_ngram, self._latest
        # An n-gram ending at e has a continuation once e <= L - 2 (lookup_draft's windows
        # over tokens[:L - 1]); later occurrences overwrite earlier ones: the latest wins.
        for e in range(max(self._seen - 1, 0), L - 1):
            for n in range(lo, min(hi, e + 1) + 1):
                latest[tuple(tokens[e - n + 1 : e + 1])] = e + 1
        self._seen, self._tail = L, (tokens[L - 1] if L else None)

    def draft(self, tokens, k: int) -> list[int]:
        """``lookup_draft(tokens, min_ngram, max_ngram, k)``, from the index."""
        self._update(tokens)
        L = len(tokens)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            start = self._latest.get(tuple(tokens[L - n :]))
            if start is not None:
                return [int(t) for t in tokens[start : start + max(k, 0)]]
        return []


def lookup_next(tokens, min_ngram: int, max_ngram: int) -> int:
    """:func:`lookup`'s first proposed token for one row of known ``tokens``, on the host (numpy):
    the token after the latest earlier occurrence of the longest matching suffix n-gram
    (``max_ngram`` down to ``min_ngram``), else the last token. While it is not drafting (k = 0)
    the engine compares this token, read from its :class:`NgramIndex`, with each row's new one."""
    first = lookup_draft(tokens, min_ngram, max_ngram, 1)
    return first[0] if first else int(np.asarray(tokens)[-1])


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


def one_hot(tokens, V: int):
    """A deterministic draft's q: probability 1 on each proposed token ([..., V] float32)."""
    return jax.nn.one_hot(tokens, V, dtype=jnp.float32)


def draft_q(tokens, V: int, drawn: Callable[[], jax.Array], sampling):
    """The q of drafted ``tokens`` [B, k]: ``drawn()``, the distributions [B, k, V] they were
    drawn from, or where every row of ``sampling`` is greedy their one-hot, which is what
    ``drawn()`` gives there (a greedy draft's token is its argmax) without building k V-wide
    distributions that the greedy rule never reads: with traced settings that took 0.7 ms of
    an EAGLE step's 2.3 ms of drafting (SmolLM2, CPU)."""
    return branch(all_greedy(sampling), lambda: one_hot(tokens, V), drawn)


def lookup_match(ctx, k: int, n: int):
    """Prompt lookup's n-gram match for a model draft mixed with it (``Medusa`` / ``Eagle`` with
    ``lookup_ngram=n``): ``(found [B] bool, proposals [B, k])`` over each row's known tokens
    (``ctx.seq`` up to ``ctx.cache.lengths + 1``)."""
    return lookup(ctx.seq, ctx.cache.lengths + 1, k, n, n, return_found=True)


def with_lookup(found, seen, tokens, q=None):
    """A model's draft ``tokens`` [B, k] (and its q [B, k, V]) with prompt lookup's proposals
    ``seen`` put in the rows where an n-gram ``found`` one (q one-hot there, so the verification
    rule stays exact) -> tokens, or (tokens, q) when q is given."""
    tokens = jnp.where(found[:, None], seen, tokens)
    if q is None:
        return tokens
    return tokens, jnp.where(found[:, None, None], one_hot(seen, q.shape[-1]), q)
