"""Speculative decoding (Leviathan et al., 2023; Chen et al., 2023): lossless, batched, one jit.

Each step a draft (see ``decoding.drafts``) proposes k tokens d_1..d_k with distributions
q_1..q_k; the target runs once on ``[last, d_1, .., d_k]`` (Tq = k + 1, through
``attention_with_kvcache`` against its cache), giving p_1..p_{k+1}; :func:`decoding.acceptance.accept`
keeps a prefix of the draft and adds one token from the target, so every step emits 1 .. k + 1 tokens whose
distribution is exactly the target's (with the same ``SamplingConfig`` shaping p and q).

Batched with fixed shapes: every row proposes and verifies k tokens every step; rows accept
different numbers, and a row's cache and token count advance by its own count (rollback is a
length change, nothing is copied). Rows stop at their own EOS and at exactly ``max_new_tokens``
(a step's tokens past either are dropped). ``speculative_decode`` is one ``lax.while_loop``
inside one jit with the state (caches included) donated; the host syncs once per call.
Prefill reuses ``generate.prefill`` (the first new token is the target's own sample) and the
host side reuses ``generate``'s options and validation, bucketing, cache building, timing and
stats. The loop reaches the draft only through ``decoding.drafts.DraftKind``'s methods.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx, struct

from decoding.checks import check_model, check_optional_int
from decoding.drafts import (
    MAX_K,
    AcceptanceEstimate,
    Context,
    DraftKind,
    EarlyExit,
    ModelDraft,
    ObservedCosts,
    PromptLookup,
    StepCosts,
    Verified,
    choose_num_draft_tokens,
    measured_costs,
)
from decoding.eagle import Eagle
from decoding.generate import (
    GenerateOptions,
    GenerateResult,
    bucket,
    generate_stats,
    make_cache,
    next_pow2,
    prefill,
    run_compiled,
    timed_phases,
)
from decoding.medusa import Medusa
from decoding.packing import packed_model, packed_weights
from decoding.sampling import sample
from models import KVCache, Transformer
from models.sharding import mesh_of


@struct.dataclass
class SpecState:
    """The speculative loop's carry, one pytree.

    Attributes:
      seq: [B, L] int32, prompt then new tokens; ``seq[b, cache.lengths[b]]`` is the last token
        (sampled, not yet fed to the target).
      prompt_lengths, num_new: [B] int32; ``cache.lengths == prompt_lengths + num_new - 1``.
      done: [B] bool, the row hit EOS, ``max_new_tokens``, or is batch padding.
      cache: the target's ``models.KVCache``; draft: the draft kind's state (or None).
      key: PRNG key, step ``s`` uses ``fold_in(key, s)``; step: int32, target calls so far
        (prefill included).
      accepted, proposed, live_steps: [B] int32, draft tokens accepted / proposed and
        verification steps taken by each row while it was live; tested: [B] int32, the draft
        positions verification judged (``drafts.AcceptanceEstimate``: n + 1 when n < k, else
        k); draft_calls: int32 scalar.
    """

    seq: jax.Array
    prompt_lengths: jax.Array
    num_new: jax.Array
    done: jax.Array
    cache: KVCache
    draft: Any
    key: jax.Array
    step: jax.Array
    accepted: jax.Array
    proposed: jax.Array
    live_steps: jax.Array
    tested: jax.Array
    draft_calls: jax.Array


def _emitted(draft_tokens, n, nxt, num_new, done, eos_id, max_new_tokens):
    """Tokens a step appends per row -> (tokens [B, k+1], count [B], hit_eos [B]).

    ``tokens[:, :n]`` are the accepted draft tokens, ``tokens[:, n]`` the target's; ``count``
    cuts after the first EOS and at ``max_new_tokens``; 0 for rows already done.
    """
    B, k = draft_tokens.shape
    j = jnp.arange(k + 1)
    padded = jnp.concatenate([draft_tokens, nxt[:, None]], axis=1)
    tokens = jnp.where(j < n[:, None], padded, nxt[:, None])
    is_eos = (tokens == eos_id) & (j <= n[:, None])
    first_eos = jnp.where(jnp.any(is_eos, 1), jnp.argmax(is_eos, 1), k + 1)
    count = jnp.minimum(jnp.minimum(n + 1, first_eos + 1), max_new_tokens - num_new)
    count = jnp.where(done, 0, count)
    return tokens, count, first_eos < count


def speculative_step(
    target, draft: DraftKind, params, state: SpecState, *, k, eos_id, max_new_tokens, sampling
):
    """One draft-then-verify step for every row. Traceable."""
    key_draft, key_accept = jax.random.split(jax.random.fold_in(state.key, state.step))
    start = state.cache.lengths  # [B]: the last token's position
    ctx = Context(target, state.cache, state.seq, params, state.draft)
    prop = draft.propose(ctx, k, sampling, key_draft)
    last = jnp.take_along_axis(state.seq, start[:, None], axis=1)
    live = ~state.done
    if prop.cut is not None:  # a done row's long draft does not make the live rows' step long
        prop = prop._replace(cut=(prop.cut[0], prop.cut[1] & live))

    def verified():
        return draft.verify(target, params, last, prop, sampling, key_accept)

    def plain():  # no live row has a real draft: one token, a Tq = 1 step's cost
        logits, cache = target(last, cache=prop.cache)
        nxt = sample(logits[:, -1], key_accept, sampling)
        n = jnp.zeros_like(nxt)
        return Verified(prop.tokens, n, nxt, cache, prop.state)

    drafting = jnp.asarray(True) if prop.found is None else jnp.any(prop.found & live)
    if prop.found is None:
        v = verified()
    else:
        v = jax.lax.cond(drafting, verified, plain)
    drafted, n, nxt, cache, draft_state = v
    k = drafted.shape[1]
    judged = live & drafting  # rows whose drafts verification judged
    tokens, count, hit_eos = _emitted(
        drafted, n, nxt, state.num_new, state.done, eos_id, max_new_tokens
    )
    B, L = state.seq.shape
    j = jnp.arange(k + 1)
    col = jnp.where(j < count[:, None], (start + 1)[:, None] + j, L)  # L: dropped
    num_new = state.num_new + count
    return state.replace(
        seq=state.seq.at[jnp.arange(B)[:, None], col].set(tokens, mode="drop"),
        num_new=num_new,
        done=state.done | hit_eos | (num_new >= max_new_tokens),
        cache=cache.replace(lengths=start + count),  # roll back the rejected positions
        draft=draft_state,
        step=state.step + 1,
        accepted=state.accepted + jnp.where(judged, n, 0),
        proposed=state.proposed + jnp.where(judged, k, 0),
        live_steps=state.live_steps + live.astype(jnp.int32),
        tested=state.tested + jnp.where(judged, n + (n < k), 0),
        draft_calls=state.draft_calls + prop.calls,
    )


def speculative_decode(
    target, draft, params, state: SpecState, *, k, eos_id, max_new_tokens, sampling
):
    """``speculative_step`` until every row is done. Traceable (``eos_id``, ``max_new_tokens``
    may be traced int32 scalars)."""

    def body(s):
        return speculative_step(
            target,
            draft,
            params,
            s,
            k=k,
            eos_id=eos_id,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
        )

    return jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)


def speculative_prefill(
    target,
    draft,
    params,
    draft_state,
    tokens,
    prompt_lengths,
    cache,
    *,
    key,
    done,
    eos_id,
    max_new_tokens,
    seq_len,
    sampling,
) -> SpecState:
    """The target's ``generate.prefill`` (first new token), then the draft's prefill. Traceable.

    tokens [B, Tp] right-padded; ``seq_len`` (static) L >= Tp, the token buffer's width.
    """
    st = prefill(
        target,
        tokens,
        prompt_lengths,
        cache,
        key=key,
        done=done,
        eos_id=eos_id,
        num_new_max=1,
        sampling=sampling,
        hidden=draft.prompt_hidden,
    )
    st, hidden = st if draft.prompt_hidden else (st, None)
    B, Tp = tokens.shape
    seq = jnp.zeros((B, seq_len), jnp.int32).at[:, :Tp].set(tokens)
    seq = seq.at[jnp.arange(B), prompt_lengths].set(st.tokens[:, 0])
    zeros = jnp.zeros((B,), jnp.int32)
    ctx = Context(target, st.cache, seq, params, draft_state, hidden)
    draft_state = draft.prefill(ctx, tokens, prompt_lengths)
    return SpecState(
        seq=seq,
        prompt_lengths=prompt_lengths.astype(jnp.int32),
        num_new=st.num_new,
        done=st.done | (st.num_new >= max_new_tokens),
        cache=st.cache,
        draft=draft_state,
        key=key,
        step=st.step,
        accepted=zeros,
        proposed=zeros,
        live_steps=zeros,
        tested=zeros,
        draft_calls=jnp.asarray(draft.prefill_calls, jnp.int32),
    )


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "draft", "seq_len"),
    donate_argnames=("cache", "draft_state"),
)
def _prefill_jit(
    target_params,
    params,
    tokens,
    prompt_lengths,
    cache,
    draft_state,
    key,
    done,
    eos_id,
    max_new,
    sampling,
    *,
    graphdef,
    draft,
    seq_len,
):
    return speculative_prefill(
        nnx.merge(graphdef, target_params),
        draft,
        params,
        draft_state,
        tokens,
        prompt_lengths,
        cache,
        key=key,
        done=done,
        eos_id=eos_id,
        max_new_tokens=max_new,
        seq_len=seq_len,
        sampling=sampling,
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "draft", "k"), donate_argnames=("state",))
def _decode_jit(
    target_params, packed, params, state, max_new, eos_id, sampling, *, graphdef, draft, k
):
    target = packed_model(graphdef, target_params, packed)
    return speculative_decode(
        target,
        draft,
        params,
        state,
        k=k,
        eos_id=eos_id,
        max_new_tokens=max_new,
        sampling=sampling,
    )


def draft_kind(draft):
    """(static draft kind, its params or None) for what ``speculative_generate`` accepts: the
    user's argument checked by its type, the one place types are looked at (the loop and the
    choice of k reach the kind only through ``drafts.DraftKind``'s methods)."""
    if isinstance(draft, Transformer):
        return ModelDraft.split(draft)
    if isinstance(draft, PromptLookup | EarlyExit):
        return draft, None
    if isinstance(draft, Medusa | Eagle):
        return draft.split()
    raise TypeError(
        "draft must be a models.Transformer, decoding.PromptLookup, decoding.EarlyExit, "
        f"decoding.Medusa or decoding.Eagle, got {type(draft).__name__}"
    )


def place_on_target(draft, kind: DraftKind, params, target):
    """The draft's params placed where the target's loop runs -> params (the kind's
    ``place``): a sharded target (``models.shard``) runs its loop on its mesh; ``ValueError``
    before any work where the draft cannot follow it."""
    return kind.place(draft, params, target)


def draft_step_costs(
    target, kind: DraftKind, params, *, batch: int, target_params=None
) -> StepCosts:
    """The measured :class:`drafts.StepCosts` :func:`chosen_num_draft_tokens` weighs for
    ``kind`` at ``batch`` rows (``drafts.measured_costs``, measured once per shape): the
    target's verifications and a draft model's step, or for a draft run by the target's own
    layers its Tq = 1 step (the kind's ``calls`` count shares of it). Looking the shape up
    reads every parameter's dtype: from ``target_params`` (``nnx.split(target)[1]``) where
    given, else by a walk over the target's modules (9 ms for SmolLM2), so the engine keeps
    the result."""
    dc = kind.costs(target, params)
    own = dc.model is target  # drafted by the target's own layers: a share of its Tq = 1 step
    draft_model = None if own else dc.model
    costs = measured_costs(target, draft_model, batch=batch, max_k=MAX_K, params=target_params)
    return costs._replace(draft=costs.target[0]) if own else costs


def chosen_num_draft_tokens(
    target,
    kind: DraftKind,
    params,
    *,
    batch: int,
    acceptance=None,
    allow_zero: bool = False,
    keep: int | None = None,
    observed: ObservedCosts | None = None,
    drafting: float = 1.0,
    step_costs: StepCosts | Callable[[], StepCosts] | None = None,
    max_k: int | None = None,
):
    """k for ``num_draft_tokens=None``: :func:`drafts.choose_num_draft_tokens` on the target's
    (and a model draft's) measured step costs at ``batch`` rows (:func:`draft_step_costs`, or
    ``step_costs`` where the caller keeps them: the costs, or a callable giving them, called
    only where they are weighed), with the caller's own step times in their place
    where it has them (``observed``, :class:`drafts.ObservedCosts`), and ``acceptance``
    (default the kind's prior), with the kind's :class:`drafts.DraftCosts`; 0 (do not draft)
    only with ``allow_zero``; ``keep``, the k in use, stays unless another is clearly faster
    (``drafts.KEEP_MARGIN``); ``drafting``, the fraction of rows that get a draft; ``max_k``
    caps the kind's most k. A Medusa tree's k is its depth."""
    dc = kind.costs(target, params)
    if dc.fixed_k is not None:
        return dc.fixed_k
    if mesh_of(target) is not None:  # measuring runs unsharded programs: the unmeasured k
        return kind.default_num_draft_tokens
    if step_costs is None:
        costs = draft_step_costs(target, kind, params, batch=batch)
    else:
        costs = step_costs() if callable(step_costs) else step_costs
    a = dc.prior if acceptance is None else acceptance
    calls = dc.calls
    if observed is not None and observed.seconds:
        costs, calls = observed.apply(costs, dc.calls), None  # the draft's calls included
    return choose_num_draft_tokens(
        costs,
        a,
        draft_calls=calls,
        max_k=dc.max_k if max_k is None else min(max_k, dc.max_k),
        allow_zero=allow_zero,
        keep=keep,
        drafting=drafting,
    )


_ESTIMATES: dict = {}
_LAST_K: dict = {}


def acceptance_estimate(target, kind: DraftKind, params) -> AcceptanceEstimate:
    """The process's running acceptance estimate for ``target`` (its config) drafted by
    ``kind`` (a hashable static kind): every :func:`speculative_generate` call adds what its
    verifications observed, so the next call's k (``num_draft_tokens=None``) follows the
    workload this process runs; it starts at the kind's prior. ``_LAST_K`` keeps the k the
    last such call chose (kept while no other k is clearly faster: each k compiles once)."""
    key = (target.config, kind)
    if key not in _ESTIMATES:
        _ESTIMATES[key] = AcceptanceEstimate(kind.costs(target, params).prior)
    return _ESTIMATES[key]


def speculative_generate(
    target, draft, prompts, *, num_draft_tokens: int | None = None, **options
) -> GenerateResult:
    """``generate(target, ...)``'s output distribution (its exact tokens when greedy), faster.

    Args:
      target: the ``models.Transformer`` whose distribution is sampled.
      draft: a ``models.Transformer`` with the target's vocabulary (its own cache),
        ``PromptLookup(...)``, ``EarlyExit(num_layers=L)`` with L < the target's layers, or
        ``Medusa(heads[, tree=TreeSpec])`` (heads trained on the target's hidden states). On a
        sharded target (``models.shard``) a model draft must be sharded over the same mesh,
        Medusa heads are replicated over it, and trees are refused (no sharded tree
        attention): ``ValueError`` before any work (:func:`place_on_target`).
      num_draft_tokens: k >= 1 tokens drafted per step; None = the k with the most expected
        tokens per second for the target's measured step costs at Tq = 1 .. K + 1 (and a
        model draft's), at the acceptance rate earlier calls with this target and draft kind
        observed in this process (:func:`acceptance_estimate`: the kind's prior at first,
        then a running estimate; :func:`chosen_num_draft_tokens`,
        ``drafts.choose_num_draft_tokens``; costs measured once per model shape, dtype and
        backend).
      options: ``generate``'s, :class:`decoding.generate.GenerateOptions`' fields
        (``num_pages`` sizes each model's page pool).

    Returns:
      ``GenerateResult``; ``stats`` has ``generate``'s keys plus ``acceptance_rate`` (accepted
      / proposed draft tokens), ``draft_proposed`` (draft tokens verified: a prompt-lookup step
      where no live row's n-gram matched is a plain Tq = 1 step and proposes none), ``tokens_per_target_call`` (tokens emitted per row per
      verification step: (1 - a^(k+1)) / (1 - a) in theory), ``target_calls`` (verification
      steps; prefill not counted), ``draft_calls`` (draft forward calls, prefill included) and
      ``num_draft_tokens``.
    """
    opts = GenerateOptions(**options)
    check_model("target", target)
    kind, params = draft_kind(draft)
    k = check_optional_int("num_draft_tokens", num_draft_tokens, 1)
    if k is not None:
        kind.check(target, k)
    params = place_on_target(draft, kind, params, target)
    estimate = acceptance_estimate(target, kind, params)
    graphdef, target_params = nnx.split(target)
    if k is None:  # chosen for the padded batch's rows (the prompts checked first)
        batch_rows = next_pow2(len(opts.check(target, prompts, name="target")[1]))
        last = _LAST_K.get((target.config, kind))
        costs = functools.partial(
            draft_step_costs, target, kind, params, batch=batch_rows, target_params=target_params
        )
        k = chosen_num_draft_tokens(
            target,
            kind,
            params,
            batch=batch_rows,
            acceptance=estimate.rate,
            keep=last,
            step_costs=costs,
        )
        kind.check(target, k)
        _LAST_K[(target.config, kind)] = k
    extra = max(k, kind.verify_width)  # slots a step writes past the last token
    sampling, rows = opts.check(target, prompts, extra=extra, name="target")
    batch = bucket(rows, opts.max_new_tokens, extra=extra)
    B, n_pad = batch.num_rows, len(batch.done) - batch.num_rows
    page_size, num_pages = opts.page_size, opts.num_pages
    kv, tables = make_cache(
        target,
        opts.cache,
        batch.need,
        n_pad,
        batch.capacity,
        page_size,
        num_pages,
        max_call=max(batch.tokens.shape[1], extra + 1),
    )
    draft_tables = None
    try:
        draft_state, draft_tables = kind.make_state(
            target, params, opts.cache, batch, page_size, num_pages
        )
        static = dict(graphdef=graphdef, draft=kind)
        x = opts.device_inputs(target, sampling, batch)
        args = (target_params, params, x["tokens"], x["prompt_lengths"], kv, draft_state)
        args += (x["key"], x["done"], x["eos"], x["max_new"], x["settings"])
        del kv, draft_state  # donated
        seq_len = batch.tokens.shape[1] + batch.num_new_max
        loop_args = (target_params, packed_weights(target, target_params), params)
        out, prefill_s, decode_s, compile_s = timed_phases(
            lambda: run_compiled(_prefill_jit, args, seq_len=seq_len, **static),
            lambda s: run_compiled(
                _decode_jit,
                (*loop_args, s, x["max_new"], x["eos"], x["settings"]),
                k=k,
                **static,
            ),
            lambda s: (
                s.seq,
                s.num_new,
                s.step,
                s.accepted,
                s.proposed,
                s.live_steps,
                s.tested,
                s.draft_calls,
            ),
        )
    finally:
        for t in (tables, draft_tables):
            if t is not None:
                t.free_all()
    seq, num_new, steps, accepted, proposed, live_steps, tested, draft_calls = out
    estimate.add(int(accepted[:B].sum()), int(tested[:B].sum()))
    plen = batch.prompt_lengths
    tokens = [seq[b, plen[b] : plen[b] + num_new[b]].tolist() for b in range(B)]
    stats = generate_stats(num_new, B, prefill_s, decode_s, compile_s, steps, opts.cache)
    row_steps = int(live_steps[:B].sum())
    stats.update(
        acceptance_rate=float(accepted[:B].sum() / max(int(proposed[:B].sum()), 1)),
        draft_proposed=int(proposed[:B].sum()),
        tokens_per_target_call=(stats["new_tokens"] - B) / row_steps if row_steps else 0.0,
        target_calls=int(steps) - 1,
        draft_calls=int(draft_calls),
        num_draft_tokens=k,
    )
    return GenerateResult(tokens=tokens, stats=stats)
