"""Sampling from next-token logits: greedy, temperature, top-k, top-p (nucleus) and min-p.

Settings are data. A ``SamplingConfig`` is the user-facing, validated description of one
request's sampling; :class:`SamplingParams` is the same settings as arrays (one entry per row,
or one for the whole batch), so one compiled step serves every temperature, top-k, top-p and
min-p, and rows of one batch may differ. Greedy is a row whose temperature is 0.

The filters compose in the order Hugging Face applies them: temperature, then top-k, then top-p
on the top-k survivors' renormalised probabilities, then min-p on those of the top-p survivors.
Ties at a filter's threshold are all kept (a token whose logit equals the k-th largest survives
top-k), so the filtered distribution does not depend on the order of equal logits.

Cost, per step, decided on the device for the whole batch (``lax.cond``): a batch of greedy
rows computes the argmax only; top-k alone takes ``lax.top_k`` of :data:`TOP_K_BOUND` candidates
(k <= the bound; the k-th of them is the threshold, exact); top-p, or a top-k above the bound,
one descending sort of V per row (the sort top-p always needed), which also gives the top-k
threshold. Settings known on the host (a ``SamplingConfig`` passed directly) resolve these
choices while tracing, so such a program contains only the filters it uses.

Randomness comes only from the explicit PRNG key: same key, same tokens. Seeds are ints in
[0, 2**32), the uint32 a key is made from (``check_seed``).

Log-probabilities of emitted tokens (``token_logprobs``, what ``Engine.submit(logprobs=n)``
reports): the chosen token's and the ``MAX_LOGPROBS`` most likely, under the model's raw
distribution (OpenAI's and vLLM's default) or the processed one the token was drawn from; a
static top-20 inside the caller's jitted step, skipped by ``lax.cond`` when no row asks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from decoding.checks import ArgumentTypeError, check_int, is_int, is_real

_F32 = np.finfo(np.float32)
SEED_LIMIT = 2**32
# Top-k candidates taken when top-k is the only sort-like filter: lax.top_k of 64 costs 1.1x
# that of 40 over V = 49152 (0.64 vs 0.59 ms at B = 8, CPU), a full sort 110x.
TOP_K_BOUND = 64


def argmax(logits):
    """logits [..., V] -> [...] int32, ``jnp.argmax`` over the last axis (the first index on ties
    and of a NaN), as two plain reductions: the max, then the smallest index holding it. XLA's
    CPU backend runs this several times faster than argmax's paired (value, index) reduction,
    which is a greedy decode step's largest cost after its matrix products."""
    V = logits.shape[-1]
    top = jnp.max(logits, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where((logits == top) | jnp.isnan(logits), iota, V), axis=-1)


def check_seed(seed) -> int:
    """``seed`` as a Python int; TypeError unless an int, ValueError unless in [0, 2**32)."""
    return check_int("seed", seed, 0, SEED_LIMIT)


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to pick the next token from logits [B, V].

    Attributes:
      temperature: 0 means greedy (argmax, the other fields are ignored); otherwise logits are
        divided by it before the filters. Any finite T > 0 works: as T -> 0 sampling tends to
        greedy (T below float32's smallest normal number, ~1.2e-38, acts as that number).
      top_k: keep the k most likely tokens; 0 disables.
      top_p: keep the smallest set of most likely tokens whose probability reaches top_p;
        1.0 disables.
      min_p: keep tokens whose probability is at least min_p times the largest; 0.0 disables.

    Python or NumPy numbers are accepted (bools are not); :meth:`params` gives the arrays the
    jitted steps take.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
        if not is_real(t) or not t >= 0 or t == float("inf"):
            raise _error(t, f"temperature must be a finite float >= 0, got {t!r}")
        if not is_int(k) or k < 0:
            raise _error(k, f"top_k must be an int >= 0, got {k!r}", is_int)
        if not is_real(p) or not 0.0 < p <= 1.0:
            raise _error(p, f"top_p must be in (0, 1], got {p!r}")
        if not is_real(m) or not 0.0 <= m <= 1.0:
            raise _error(m, f"min_p must be in [0, 1], got {m!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_k", int(k))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "min_p", float(m))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def params(self) -> SamplingParams:
        """These settings as host (NumPy) scalars, one set for a whole batch."""
        return SamplingParams.rows([self]).squeeze()


def _error(value, message: str, kind=is_real) -> ValueError:
    """ArgumentTypeError (also a ValueError) for a value of the wrong type, else ValueError."""
    return ValueError(message) if kind(value) else ArgumentTypeError(message)


def _host_temperature(t: float) -> np.float32:
    """0 (greedy), else T clamped to float32's normal range, so it is neither flushed to zero
    (as denormals are on CPU, giving 0 / 0) nor rounded to inf."""
    return np.float32(0.0 if t == 0.0 else min(max(t, float(_F32.tiny)), float(_F32.max)))


@struct.dataclass
class SamplingParams:
    """Sampling settings as arrays, broadcastable to the logits' row shape (``logits.shape[:-1]``).

    Attributes:
      temperature: float32, 0 = greedy; a positive value is used as it is (build these with
        :meth:`rows`, which clamps T into float32's normal range as ``SamplingConfig`` does).
      top_k: int32, 0 = off. top_p: float32, 1 = off. min_p: float32, 0 = off.

    A pytree: pass it to a jitted function as data (no recompilation for new values).
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array

    @classmethod
    def rows(cls, configs) -> SamplingParams:
        """One row per ``SamplingConfig``: NumPy arrays [B]."""
        return cls(
            temperature=np.array([_host_temperature(c.temperature) for c in configs], np.float32),
            top_k=np.array([c.top_k for c in configs], np.int32),
            top_p=np.array([c.top_p for c in configs], np.float32),
            min_p=np.array([c.min_p for c in configs], np.float32),
        )

    def squeeze(self) -> SamplingParams:
        return jax.tree.map(lambda x: x.reshape(()), self)


def as_params(sampling) -> SamplingParams:
    """A ``SamplingConfig`` (-> its host scalars) or ``SamplingParams`` (unchanged)."""
    if isinstance(sampling, SamplingConfig):
        return sampling.params()
    if isinstance(sampling, SamplingParams):
        return sampling
    raise TypeError(
        f"sampling must be a SamplingConfig or SamplingParams, got {type(sampling).__name__}"
    )


def _on_host(x) -> bool:
    return isinstance(x, np.ndarray | np.generic)


def branch(pred, if_true, if_false):
    """``if_true()`` or ``if_false()`` by ``pred``: ``lax.cond`` when it is traced, the taken
    branch alone when the host knows it (e.g. ``all_greedy`` of a ``SamplingConfig``)."""
    if _on_host(pred):
        return if_true() if pred else if_false()
    return jax.lax.cond(pred, if_true, if_false)


def _any(x):
    return np.any(x) if _on_host(x) else jnp.any(x)


def _col(x):
    """A per-row setting [...] -> [..., 1], to broadcast against [..., V]."""
    return x[..., None]


def _temper(logits, temperature):
    """float32 logits [..., V] -> (logits - row max) / temperature, so every value is <= 0.

    Shifting first means a tiny temperature can only send a value to -inf (the row max stays
    0): dividing first overflows to inf and gives inf - inf = NaN in the softmax. Greedy rows
    (temperature 0) divide by 1; their result is not used.
    """
    t = jnp.where(temperature > 0, temperature, np.float32(1.0))
    return (logits - jnp.max(logits, axis=-1, keepdims=True)) / _col(t)


def _top_k_top_p(x, top_k, top_p):
    """Tempered logits [..., V] -> top-k, then top-p on the survivors (module doc: the cost)."""
    V = x.shape[-1]
    xp = np if _on_host(top_k) else jnp  # host settings keep the branch choices on the host
    k = xp.broadcast_to(top_k, x.shape[:-1])
    use_k = (k > 0) & (k < V)
    use_p = top_p < 1.0

    def kth_of(candidates):
        kth = jnp.take_along_axis(
            candidates, _col(jnp.clip(k - 1, 0, candidates.shape[-1] - 1)), -1
        )
        return jnp.where(_col(use_k), kth, -jnp.inf)

    def by_sort():
        desc = -jnp.sort(-x, axis=-1)
        kth = kth_of(desc)
        # The smallest prefix of the top-k survivors (sorted) whose mass reaches top_p; its last
        # logit is the threshold (tokens tied with it survive too).
        desc = jnp.where(desc >= kth, desc, -jnp.inf)
        probs = jax.nn.softmax(desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        n_keep = jnp.maximum(jnp.sum(mass_before < _col(top_p), axis=-1, keepdims=True), 1)
        threshold = jnp.take_along_axis(desc, n_keep - 1, axis=-1)
        threshold = jnp.where(_col(use_p), threshold, -jnp.inf)
        return jnp.where(x >= jnp.maximum(kth, threshold), x, -jnp.inf)

    def by_top_k():
        kth = kth_of(jax.lax.top_k(x, min(TOP_K_BOUND, V))[0])
        return jnp.where(x >= kth, x, -jnp.inf)

    return branch(
        _any(use_p | (use_k & (k > TOP_K_BOUND))),
        by_sort,
        lambda: branch(_any(use_k), by_top_k, lambda: x),
    )


def _min_p(x, min_p):
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
    def apply():
        top = jnp.max(x, axis=-1, keepdims=True)
        log_m = jnp.log(jnp.maximum(min_p, np.float32(_F32.tiny)))
        threshold = jnp.where(_col(min_p > 0), top + _col(log_m), -jnp.inf)
        return jnp.where(x >= threshold, x, -jnp.inf)

    return branch(_any(min_p > 0), apply, lambda: x)


def _sampled_logits(logits, p: SamplingParams):
    """float32 logits [..., V] -> the sampled rows' filtered logits (greedy rows: unused)."""
    x = _temper(logits, p.temperature)
    return _min_p(_top_k_top_p(x, p.top_k, p.top_p), p.min_p)


def filtered_logits(logits, sampling):
    """logits [..., V] -> float32 [..., V]: tempered logits shifted so each row's largest is 0,
    ``-inf`` where a filter removed one.

    ``sampling``: a ``SamplingConfig`` or ``SamplingParams`` (per row). For a greedy row every
    token but the argmax (the first one on ties) is removed, and the kept logit is returned
    unshifted.
    """
    p = as_params(sampling)
    logits = jnp.asarray(logits, jnp.float32)
    greedy = p.temperature <= 0

    def one_hot():
        keep = jnp.arange(logits.shape[-1]) == argmax(logits)[..., None]
        return jnp.where(keep, logits, -jnp.inf)

    def mixed():
        return jnp.where(_col(greedy), one_hot(), _sampled_logits(logits, p))

    return branch(~_any(~greedy), one_hot, mixed)


def probabilities(logits, sampling):
    """logits [..., V] -> float32 [..., V]: the exact distribution ``sample`` draws from.

    Greedy rows give a one-hot. Speculative sampling uses this for the draft's q and the
    target's p.
    """
    p = as_params(sampling)
    greedy = p.temperature <= 0

    def one_hot():
        return jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)

    def mixed():
        return jax.nn.softmax(filtered_logits(logits, p), axis=-1)

    return branch(~_any(~greedy), one_hot, mixed)


def all_greedy(sampling):
    """Every row of ``sampling`` is greedy: a host bool for a ``SamplingConfig``, else a traced
    scalar (for ``lax.cond``)."""
    return ~_any(~(as_params(sampling).temperature <= 0))


def sample(logits, key, sampling):
    """logits [B, V] -> token ids [B] int32.

    ``key``: one PRNG key for the batch, or one per row (keys [B]: row b draws alone, as at
    batch 1, so its tokens do not depend on the other rows). ``sampling``: a ``SamplingConfig``
    or ``SamplingParams`` (scalar or [B]); greedy rows take the argmax and ignore the key.
    """
    p = as_params(sampling)
    best = argmax(logits)
    sampled = p.temperature > 0

    def draw():
        x = _sampled_logits(jnp.asarray(logits, jnp.float32), p)
        typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        if (key.shape if typed else key.shape[:-1]) == best.shape and best.ndim:
            drawn = jax.vmap(lambda row, k: jax.random.categorical(k, row[None], axis=-1)[0])(
                x, key
            )
        else:
            drawn = jax.random.categorical(key, x, axis=-1)
        return jnp.where(sampled, drawn.astype(jnp.int32), best)

    return branch(_any(sampled), draw, lambda: best)


# --------------------------------------------------------------------------------- logprobs

# The most alternatives a request may ask for (OpenAI's top_logprobs bound): the steps always
# take this many (a static shape, so requests asking for fewer, or none, never recompile).
MAX_LOGPROBS = 20
# What a token's log-probability is measured under (``token_logprobs``).
LOGPROBS_MODES = ("raw", "processed")


@struct.dataclass
class Logprobs:
    """Log-probabilities of a step's tokens, per row (``rows`` = the tokens' shape).

    Attributes:
      chosen: float32 [rows], the log-probability of the token the row emitted.
      top_ids: int32 [rows, N], the N = min(MAX_LOGPROBS, V) most likely tokens, most likely
        first (ties: the smaller id first).
      top: float32 [rows, N], their log-probabilities (``-inf`` for a token a filter removed).
    """

    chosen: jax.Array
    top_ids: jax.Array
    top: jax.Array


def check_logprobs_mode(mode) -> str:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {mode!r}")
    return mode


def _reported_logits(logits, p: SamplingParams, mode: str):
    """float32 logits [..., V] whose log-softmax is what ``token_logprobs`` reports."""
    logits = jnp.asarray(logits, jnp.float32)
    if mode == "raw":
        return logits
    sampled = p.temperature > 0
    return branch(
        _any(sampled),
        lambda: jnp.where(_col(sampled), _sampled_logits(logits, p), logits),
        lambda: logits,
    )


def token_logprobs(logits, tokens, sampling, mode: str = "raw", wanted=None) -> Logprobs:
    """logits [..., V], the emitted tokens [...] -> their ``Logprobs`` (float32).

    ``mode`` (static) says which distribution the log-probabilities are of:

    * ``"raw"``: the model's own, ``log_softmax(logits)``, whatever the sampling settings.
      This is vLLM's default (``--logprobs-mode raw_logprobs``) and what OpenAI's API reports:
      its logprobs do not change with ``temperature`` or ``top_p``.
    * ``"processed"``: the distribution the token was drawn from: ``log_softmax`` of the
      tempered logits after top-k, top-p and min-p, renormalised over the survivors (removed
      tokens ``-inf``), vLLM's ``processed_logprobs``; what importance weights need.

    A greedy row (temperature 0) reports the raw distribution in both modes (its sampling
    distribution is a one-hot, which says nothing), so its token is always its most likely
    one (``chosen == top[..., 0]``).

    ``wanted`` [...] bool (or None: every row): rows that asked. When no row of the batch asks,
    nothing is computed (``lax.cond``) and the result is zeros; otherwise every row pays one
    log-sum-exp and one ``lax.top_k`` of ``MAX_LOGPROBS`` over V (plus, in ``"processed"``
    mode with sampled rows, the sampling filters again).
    """
    p = as_params(sampling)
    tokens = jnp.asarray(tokens, jnp.int32)
    logits = jnp.asarray(logits)
    N = min(MAX_LOGPROBS, logits.shape[-1])

    def compute():
        x = _reported_logits(logits, p, mode)
        lse = jax.nn.logsumexp(x, axis=-1)
        chosen = jnp.take_along_axis(x, tokens[..., None], axis=-1)[..., 0] - lse
        top, ids = jax.lax.top_k(x, N)
        return Logprobs(chosen=chosen, top_ids=ids.astype(jnp.int32), top=top - lse[..., None])

    def skip():
        shape = tokens.shape
        return Logprobs(
            chosen=jnp.zeros(shape, jnp.float32),
            top_ids=jnp.zeros((*shape, N), jnp.int32),
            top=jnp.zeros((*shape, N), jnp.float32),
        )

    if wanted is None:
        return compute()
    return branch(_any(wanted), compute, skip)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its most likely alternatives (host values).

    ``top``: ``(token id, logprob)`` pairs, most likely first, as many as the request asked
    for (``Engine.submit(logprobs=n)``).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def logprob_records(tokens, lp: Logprobs, n: int) -> list[TokenLogprob]:
    """Host arrays: tokens [T], ``lp`` of shape [T] -> one ``TokenLogprob`` per token, each
    with its ``n`` most likely alternatives."""
    chosen, ids, top = (np.asarray(x) for x in (lp.chosen, lp.top_ids, lp.top))
    return [
        TokenLogprob(
            int(t),
            float(chosen[j]),
            tuple(zip(ids[j, :n].tolist(), top[j, :n].astype(float).tolist(), strict=True)),
        )
        for j, t in enumerate(tokens)
    ]
