"""KV-cache generation: one jitted prefill, one jitted ``lax.while_loop`` decode, no per-token sync.

The pieces, gpt-fast style, so that speculative decoding can reuse the same state:

* ``prefill``: runs the right-padded prompts [B, Tp] through the model with an empty cache, sets
  the cache lengths to the true prompt lengths and samples each row's first new token.
* ``decode_step``: feeds each row's last token (T = 1), samples the next one, appends it unless
  the row is done. Traceable; called inside the loop.
* ``decode``: the ``lax.while_loop`` of ``decode_step`` until every row is done or
  ``max_new_tokens`` tokens exist, inside one jit with the state (and so the cache) donated.
* ``generate``: host side: pads and buckets shapes, builds a contiguous or paged cache (pages
  for every position a row may write are allocated before the loop and freed when it returns),
  times the two phases, strips padding.

Sampling settings are data (``sampling.SamplingParams``, traced), so every temperature, top-k,
top-p and min-p shares one compiled prefill and loop.

Bucketing: batch to a power of two, the prompt length by :func:`prompt_bucket` (padding under
``PROMPT_BUCKET`` tokens or a quarter, so a short prompt's work is never doubled) and the token
buffer to a multiple of ``NEW_TOKENS_BUCKET``; ``max_new_tokens`` and ``eos_id`` are traced
values. Calls with similar sizes therefore reuse the compiled prefill and loop. The prefill
computes logits only at each prompt's last token.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from decoding import paging
from decoding.checks import check_int, check_model, check_optional_int
from decoding.packing import packed_model, packed_weights
from decoding.sampling import SamplingConfig, check_seed, sample
from models import KVCache
from models.kv_cache import ring_pages_for
from models.sharding import mesh_of, replicated, to_host

PROMPT_BUCKET = 16
NEW_TOKENS_BUCKET = 64
CACHE_KINDS = ("paged", "contiguous")


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries, as one pytree.

    Attributes:
      tokens: [B, N] int32, the new tokens of each row (column j = j-th new token); entries at or
        past ``num_new`` are 0.
      num_new: [B] int32, new tokens in each row so far (an EOS included).
      last: [B] int32, each row's last token, the input of the next step.
      done: [B] bool, the row produced EOS (or is batch padding).
      cache: the ``models.KVCache``; ``cache.lengths`` = prompt length + tokens fed so far.
      key: the PRNG key; step ``s`` samples with ``fold_in(key, s)``.
      step: int32 scalar, number of sampling steps taken (prefill is step 0 -> step becomes 1).
    """

    tokens: jax.Array
    num_new: jax.Array
    last: jax.Array
    done: jax.Array
    cache: KVCache
    key: jax.Array
    step: jax.Array


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """``tokens``: the new tokens per prompt (an EOS included, the prompt not); ``stats``:
    prefill_s, decode_s, new_tokens, tokens_per_s (new tokens over prefill + decode time),
    decode_tokens_per_s (tokens of the decode loop over its time), compile_s (compilation in
    this call, not part of the other times), steps, batch, cache."""

    tokens: list[list[int]]
    stats: dict


def _append(state: DecodeState, logits, eos_id, sampling) -> DecodeState:
    """Samples from logits [B, V], appends to rows not done, advances the step."""
    nxt = sample(logits, jax.random.fold_in(state.key, state.step), sampling)
    live = ~state.done
    B = nxt.shape[0]
    col = jnp.minimum(state.num_new, state.tokens.shape[1] - 1)
    written = jnp.where(live, nxt, state.tokens[jnp.arange(B), col])
    return state.replace(
        tokens=state.tokens.at[jnp.arange(B), col].set(written),
        num_new=state.num_new + live.astype(jnp.int32),
        last=jnp.where(live, nxt, state.last),
        done=state.done | (live & (nxt == eos_id)),
        step=state.step + 1,
    )


def prefill(
    model,
    tokens,
    prompt_lengths,
    cache: KVCache,
    *,
    key,
    done,
    eos_id,
    num_new_max,
    sampling,
    hidden: bool = False,
):
    """Prompt pass: tokens [B, Tp] right-padded, prompt_lengths [B] >= 1, an empty cache
    -> ``DecodeState`` (and, with ``hidden``, the model's last hidden states over the prompts,
    [B, Tp, dim], for a draft that reads them: ``(state, hidden)``).

    Traceable (``generate`` jits it). ``done`` [B] bool marks rows to skip (batch padding);
    ``num_new_max`` (static) is the width N of the token buffer; ``sampling`` a
    ``SamplingConfig`` or ``SamplingParams`` (scalar or per row), as in ``sampling.sample``.
    """
    B = tokens.shape[0]
    out = model(tokens, cache=cache, logits_at=prompt_lengths - 1, return_hidden=hidden)
    logits, cache = out[:2]  # [B, 1, V]
    cache = cache.replace(lengths=prompt_lengths.astype(jnp.int32))
    state = DecodeState(
        tokens=jnp.zeros((B, num_new_max), jnp.int32),
        num_new=jnp.zeros((B,), jnp.int32),
        last=jnp.zeros((B,), jnp.int32),
        done=done,
        cache=cache,
        key=key,
        step=jnp.zeros((), jnp.int32),
    )
    state = _append(state, logits[:, 0], eos_id, sampling)
    return (state, out[2]) if hidden else state


def decode_step(model, state: DecodeState, *, eos_id, sampling) -> DecodeState:
    """One token for every row: feed ``state.last`` [B, 1], sample, append. Traceable.

    Rows already done still run (their cache writes land in their own reserved positions) but
    append nothing.
    """
    logits, cache = model(state.last[:, None], cache=state.cache)
    return _append(state.replace(cache=cache), logits[:, -1], eos_id, sampling)


def decode(model, state: DecodeState, *, max_new_tokens, eos_id, sampling):
    """``decode_step`` until all rows are done or ``max_new_tokens`` tokens were sampled.

    Traceable; ``max_new_tokens`` and ``eos_id`` may be traced int32 scalars.
    """

    def cond(s):
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def body(s):
        return decode_step(model, s, eos_id=eos_id, sampling=sampling)

    return jax.lax.while_loop(cond, body, state)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_new_max"), donate_argnames=("cache",))
def prefill_jit(
    params, tokens, prompt_lengths, cache, key, done, eos_id, sampling, *, graphdef, num_new_max
):
    """:func:`prefill` of ``nnx.merge(graphdef, params)``, jitted with the cache donated (what
    ``generate`` runs; ``benchmarks/gpu_models.py`` compiles it for GPUs)."""
    model = nnx.merge(graphdef, params)
    return prefill(
        model,
        tokens,
        prompt_lengths,
        cache,
        key=key,
        done=done,
        eos_id=eos_id,
        num_new_max=num_new_max,
        sampling=sampling,
    )


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("state",))
def decode_jit(params, packed, state, max_new_tokens, eos_id, sampling, *, graphdef):
    """:func:`decode` of the model with its packed weights ``packed``
    (:func:`decoding.packing.packed_weights`), jitted with the state donated."""
    model = packed_model(graphdef, params, packed)
    return decode(model, state, max_new_tokens=max_new_tokens, eos_id=eos_id, sampling=sampling)


# Executables compiled ahead of time, keyed by function, static arguments and the shapes/dtypes
# of the dynamic ones (what jit keys on), so that compilation is timed apart from running; the
# least recently used is dropped past MAX_EXECUTABLES (each holds its code and, for a model
# closed over by a draft kind, nothing else: weights are arguments).
MAX_EXECUTABLES = 32
_EXECUTABLES: collections.OrderedDict[tuple, jax.stages.Compiled] = collections.OrderedDict()
_COMPILED = [0]


class _Key(tuple):
    """An executable's key with its hash computed once: a model's ``GraphDef`` hashes its whole
    module tree (2-3 ms for SmolLM2), and the lookup, the insertion and the reordering each
    ask for the hash."""

    def __new__(cls, key: tuple):
        self = super().__new__(cls, key)
        self._hash = tuple.__hash__(self)
        return self

    def __hash__(self) -> int:
        return self._hash


def run_compiled(fn, args: tuple, **static):
    """``fn(*args, **static)`` (``fn`` jitted) through a cached ahead-of-time executable ->
    (out, compile_s), compile_s the seconds spent compiling in this call (0.0 on a hit)."""
    leaves, treedef = jax.tree.flatten(args)
    avals = tuple((x.shape, x.dtype, getattr(x, "weak_type", False)) for x in leaves)
    key = _Key((fn, treedef, avals, tuple(sorted(static.items(), key=lambda kv: kv[0]))))
    exe, compile_s = _EXECUTABLES.get(key), 0.0
    if exe is None:
        t0 = time.perf_counter()
        exe = fn.lower(*args, **static).compile()
        compile_s = time.perf_counter() - t0
        _COMPILED[0] += 1
        _EXECUTABLES[key] = exe
        while len(_EXECUTABLES) > MAX_EXECUTABLES:
            _EXECUTABLES.popitem(last=False)
    _EXECUTABLES.move_to_end(key)
    return exe(*args), compile_s


def compiled_count() -> int:
    """How many prefill and loop executables (of generate and speculative_generate) were
    compiled: grows by one per compilation (at most ``MAX_EXECUTABLES`` are kept)."""
    return _COMPILED[0]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (n >= 1): the bucketed batch size."""
    return 1 << (n - 1).bit_length()


def prompt_bucket(n: int) -> int:
    """The padded prompt length for a longest prompt of ``n`` tokens: a multiple of
    ``max(PROMPT_BUCKET, next_pow2(n) / 8)`` (16, 32, ..., 128, 160, 192, 224, 256, 320, ...):
    4 buckets per doubling beyond 128, padding under ``PROMPT_BUCKET`` tokens or 25%."""
    return _round_up(n, max(PROMPT_BUCKET, next_pow2(n) // 8))


def _check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    if hasattr(prompts, "shape") and hasattr(prompts, "dtype"):
        arr = np.asarray(prompts)
        if not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"prompts must be an int array, got dtype {arr.dtype}")
        if arr.ndim != 2:
            raise ValueError(f"prompts must be a [B, T] int array, got shape {arr.shape}")
        prompts = arr.tolist()
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError("prompts must be a non-empty list of token lists or a [B, T] int array")
    rows = []
    for b, p in enumerate(prompts):
        if not isinstance(p, list | tuple) or not p:
            raise ValueError(f"prompt {b} must be a non-empty list of ints, got {p!r}")
        floats = [t for t in p if isinstance(t, bool) or not isinstance(t, int | np.integer)]
        if floats:
            raise TypeError(f"prompt {b} has token ids that are not ints: {floats[:5]!r}")
        row = [int(t) for t in p]
        bad = [t for t in row if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {b} has token ids outside [0, {vocab_size}): {bad[:5]}")
        rows.append(row)
    return rows


def make_cache(
    model,
    kind: str,
    need,
    n_pad: int,
    capacity: int,
    page_size: int,
    num_pages,
    max_call: int | None = None,
):
    """An empty cache for ``len(need)`` real rows, row b writing ``need[b]`` positions, and
    ``n_pad`` batch-padding rows; for a paged cache also its ``BlockTables`` (else None).

    The pool holds ``num_pages`` pages for the real rows (default: ``capacity`` positions for
    every row of the bucketed batch, so that its shape depends on the bucket only) plus one
    scratch page past them that every padding row's block table points at: padding rows write
    there and nobody reads it, so they never take pages from the pool.

    ``max_call``: the most tokens one forward call writes (the prompt bucket, a verification's
    k + 1). Given, a paged cache's sliding-window layers keep a ring of
    ``models.kv_cache.ring_pages_for(window, max_call, P)`` pages per row instead of every page
    of the row, when that is fewer (:meth:`models.KVCache.paged`'s ``ring_pages``).
    """
    config, mesh = model.config, mesh_of(model)
    B = len(need)
    if kind == "contiguous":
        return KVCache.contiguous(config, B + n_pad, capacity, mesh=mesh), None
    page_size = min(page_size, capacity)  # a larger page would only hold unused positions
    max_pages = paging.pages_for(capacity, page_size)
    pool = (B + n_pad) * max_pages if num_pages is None else num_pages
    tables = paging.BlockTables(paging.PageAllocator(pool, page_size), B, max_pages)
    tables.reserve(need)
    table = np.concatenate([tables.table(), np.full((n_pad, max_pages), pool, np.int32)])
    ring = None
    if max_call is not None and any(config.is_sliding(i) for i in range(config.num_layers)):
        ring = ring_pages_for(config.sliding_window, max_call, page_size)
        ring = ring if ring < max_pages else None
    cache = KVCache.paged(config, pool + 1, page_size, table, mesh=mesh, ring_pages=ring)
    return cache, tables


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    """The keyword arguments of ``generate`` and ``speculative_generate`` besides the model(s)
    and prompts (one definition for both).

    Attributes:
      max_new_tokens: >= 1; each row stops earlier after producing ``eos_id``.
      sampling: a ``SamplingConfig``; default greedy.
      eos_id: the stop token (kept in the output), or None.
      seed: PRNG seed, an int in [0, 2**32); same seed, same tokens.
      cache: "paged" (pages from a ``paging.PageAllocator``) or "contiguous".
      page_size: P, positions per page (paged only); capped at the positions the request can
        use (bucketed prompt + new tokens), so a huge P allocates no more than a contiguous
        cache.
      num_pages: size of each model's page pool (a static shape: keep it fixed across calls to
        avoid recompiling); default ``B_pad * pages_for(Tp + N)``, the contiguous cache's size.
        Padding rows of the bucketed batch take none of it (they write one scratch page past
        it). Too small a pool raises ``paging.OutOfPagesError`` before any work.
    """

    max_new_tokens: int
    sampling: SamplingConfig | None = None
    eos_id: int | None = None
    seed: int = 0
    cache: str = "paged"
    page_size: int = 16
    num_pages: int | None = None

    def check(
        self, model, prompts, *, extra: int = 0, name: str = "model"
    ) -> tuple[SamplingConfig, list[list[int]]]:
        """Validates the options for ``model`` and ``prompts`` -> (sampling, prompt rows).

        ``extra``: positions a row may write past its last token (speculative: the draft
        length); ``name``: the model's argument name in errors.
        """
        check_model(name, model)
        sampling = SamplingConfig() if self.sampling is None else self.sampling
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        max_new_tokens = check_int("max_new_tokens", self.max_new_tokens, 1)
        if not isinstance(self.cache, str) or self.cache not in CACHE_KINDS:
            raise ValueError(f"cache must be one of {CACHE_KINDS}, got {self.cache!r}")
        check_int("page_size", self.page_size, 1)
        check_optional_int("num_pages", self.num_pages, 1)
        check_seed(self.seed)
        config = model.config
        check_optional_int("eos_id", self.eos_id, 0, config.vocab_size)
        rows = _check_prompts(prompts, config.vocab_size)
        longest = max(len(r) for r in rows)
        if longest + max_new_tokens + extra > config.max_position:
            raise ValueError(
                f"prompt length {longest} + max_new_tokens {max_new_tokens}"
                + (f" + {extra} draft positions" if extra else "")
                + f" exceeds the model's max_position {config.max_position}"
            )
        return sampling, rows

    def device_inputs(self, model, sampling: SamplingConfig, batch: Batch) -> dict:
        """The loop's inputs besides the weights and caches, placed where ``model``'s loop runs
        (replicated over a sharded model's mesh): tokens, prompt_lengths, done (``batch``'s),
        key (from ``seed``), eos (-1 for None), max_new and settings (``sampling.params()``)."""
        put = functools.partial(jax.device_put, device=replicated(model))
        return dict(
            tokens=put(batch.tokens),
            prompt_lengths=put(batch.prompt_lengths),
            done=put(batch.done),
            key=jax.random.key(put(np.uint32(self.seed))),
            eos=put(np.int32(-1 if self.eos_id is None else self.eos_id)),
            max_new=put(np.int32(self.max_new_tokens)),
            settings=put(sampling.params()),
        )


@dataclasses.dataclass(frozen=True)
class Batch:
    """Prompts padded to bucketed shapes (see the module docstring).

    ``tokens`` [B_pad, Tp] right-padded; ``prompt_lengths`` [B_pad] (1 for padding rows);
    ``done`` [B_pad] marks the padding rows; ``num_new_max`` N, the token buffer's width;
    ``need[b]`` positions real row b may write; ``capacity`` of one cache row.
    """

    tokens: np.ndarray
    prompt_lengths: np.ndarray
    done: np.ndarray
    num_rows: int
    num_new_max: int
    need: list[int]
    capacity: int


def bucket(rows: list[list[int]], max_new_tokens: int, extra: int = 0) -> Batch:
    """Pads B rows to B_pad = next power of two, prompts to :func:`prompt_bucket`, the
    token buffer to a multiple of ``NEW_TOKENS_BUCKET`` covering ``max_new_tokens + extra``."""
    lengths = [len(r) for r in rows]
    B = len(rows)
    B_pad = next_pow2(B)
    Tp = prompt_bucket(max(lengths))
    N = _round_up(max_new_tokens + extra, NEW_TOKENS_BUCKET)
    tokens = np.zeros((B_pad, Tp), np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r
    return Batch(
        tokens=tokens,
        prompt_lengths=np.array(lengths + [1] * (B_pad - B), np.int32),
        done=np.arange(B_pad) >= B,
        num_rows=B,
        num_new_max=N,
        # Positions a row writes: the padded prompt, then one per fed token (+ extra).
        need=[max(Tp, n + max_new_tokens + extra) for n in lengths],
        capacity=Tp + N,
    )


def timed_phases(run_prefill, run_loop, fetch):
    """Runs ``run_prefill() -> (state, compile_s)`` then ``run_loop(state) -> (state, compile_s)``
    with only explicit transfers allowed: two dispatches, one sync after each.

    Returns ``(fetch(state) on the host, prefill_s, decode_s, compile_s)``, compilation excluded
    from the two phase times.
    """
    with jax.transfer_guard("disallow"):
        t0 = time.perf_counter()
        state, compile_prefill = run_prefill()
        jax.block_until_ready(state)
        t1 = time.perf_counter()
        state, compile_loop = run_loop(state)
        out = to_host(fetch(state))  # every process gets the whole result
        t2 = time.perf_counter()
    return out, t1 - t0 - compile_prefill, t2 - t1 - compile_loop, compile_prefill + compile_loop


def generate_stats(num_new, B: int, prefill_s, decode_s, compile_s, steps, cache: str) -> dict:
    """The stats dict of ``GenerateResult`` from per-row new-token counts ``num_new`` [B_pad]."""
    new_tokens = int(sum(num_new[:B]))
    return dict(
        prefill_s=prefill_s,
        decode_s=decode_s,
        new_tokens=new_tokens,
        tokens_per_s=new_tokens / (prefill_s + decode_s),
        decode_tokens_per_s=(new_tokens - B) / decode_s if decode_s > 0 else 0.0,
        compile_s=compile_s,
        steps=int(steps),
        batch=B,
        cache=cache,
    )


def generate(model, prompts, **options) -> GenerateResult:
    """Generates up to ``max_new_tokens`` tokens after each prompt.

    Args:
      model: a ``models.Transformer``.
      prompts: a list of B token lists (lengths may differ) or a [B, T] int array.
      options: :class:`GenerateOptions`' fields as keywords: ``max_new_tokens`` (required),
        ``sampling``, ``eos_id``, ``seed``, ``cache``, ``page_size``, ``num_pages``.

    Returns:
      ``GenerateResult`` with ``tokens`` (list per prompt) and ``stats``.
    """
    opts = GenerateOptions(**options)
    sampling, rows = opts.check(model, prompts)
    batch = bucket(rows, opts.max_new_tokens)
    B = batch.num_rows
    n_pad = len(batch.done) - B
    kv, tables = make_cache(
        model,
        opts.cache,
        batch.need,
        n_pad,
        batch.capacity,
        opts.page_size,
        opts.num_pages,
        max_call=batch.tokens.shape[1],
    )
    try:
        graphdef, params = nnx.split(model)
        static = dict(graphdef=graphdef)
        x = opts.device_inputs(model, sampling, batch)
        args = (params, x["tokens"], x["prompt_lengths"], kv, x["key"], x["done"], x["eos"])
        args += (x["settings"],)
        del kv  # donated
        packed = packed_weights(model, params)
        loop_args = (params, packed)
        (out, num_new, steps), prefill_s, decode_s, compile_s = timed_phases(
            lambda: run_compiled(prefill_jit, args, num_new_max=batch.num_new_max, **static),
            lambda state: run_compiled(
                decode_jit, (*loop_args, state, x["max_new"], x["eos"], x["settings"]), **static
            ),
            lambda state: (state.tokens, state.num_new, state.step),
        )
    finally:
        if tables is not None:
            tables.free_all()
    result = [out[b, : num_new[b]].tolist() for b in range(B)]
    stats = generate_stats(num_new, B, prefill_s, decode_s, compile_s, steps, opts.cache)
    return GenerateResult(tokens=result, stats=stats)
