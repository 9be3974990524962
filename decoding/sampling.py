"""Sampling from next-token logits: greedy, temperature, top-k, top-p (nucleus) and min-p.

A ``SamplingConfig`` is a frozen, hashable dataclass, so it can be a static argument of ``jax.jit``.
The filters compose in the order Hugging Face applies them: temperature, then top-k, then top-p
on the top-k survivors' renormalised probabilities, then min-p on those of the top-p survivors.
Ties at a filter's threshold are all kept (a token whose logit equals the k-th largest survives
top-k), so the filtered distribution does not depend on the order of equal logits.
Randomness comes only from the explicit PRNG key: same key, same tokens. Seeds are ints in
[0, 2**32), the uint32 a key is made from (``check_seed``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

_F32 = np.finfo(np.float32)
SEED_LIMIT = 2**32


def check_seed(seed) -> int:
    """``seed`` as a Python int; TypeError unless an int, ValueError unless in [0, 2**32)."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    return int(seed)


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
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not t >= 0 or t == float("inf"):
            raise ValueError(f"temperature must be a finite float >= 0, got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.min_p, int | float) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", float(self.min_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _temper(logits, temperature: float):
    """float32 logits [..., V] -> (logits - row max) / temperature, so every value is <= 0.

    Shifting first means a tiny temperature can only send a value to -inf (the row max stays
    0): dividing first overflows to inf and gives inf - inf = NaN in the softmax. The
    temperature is clamped to float32's normal range, so it is neither flushed to zero (as
    denormals are on CPU, giving 0 / 0) nor rounded to inf.
    """
    t = np.float32(min(max(temperature, float(_F32.tiny)), float(_F32.max)))
    return (logits - jnp.max(logits, axis=-1, keepdims=True)) / t


def filtered_logits(logits, config: SamplingConfig):
    """logits [..., V] -> float32 [..., V]: tempered logits shifted so each row's largest is 0,
    ``-inf`` where a filter removed one.

    For a greedy config every token but the argmax (the first one on ties) is removed, and the
    kept logit is returned unshifted.
    """
    logits = jnp.asarray(logits, jnp.float32)
    V = logits.shape[-1]
    if config.greedy:
        best = jnp.argmax(logits, axis=-1)
        keep = jnp.arange(V) == best[..., None]
        return jnp.where(keep, logits, -jnp.inf)
    logits = _temper(logits, config.temperature)
    if 0 < config.top_k < V:
        kth = jax.lax.top_k(logits, config.top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if config.top_p < 1.0:
        # The smallest prefix of the sorted distribution whose mass reaches top_p; its last
        # logit is the threshold (tokens tied with it survive too).
        desc = -jnp.sort(-logits, axis=-1)
        probs = jax.nn.softmax(desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        n_keep = jnp.maximum(jnp.sum(mass_before < config.top_p, axis=-1, keepdims=True), 1)
        threshold = jnp.take_along_axis(desc, n_keep - 1, axis=-1)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    if config.min_p > 0.0:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
        top = jnp.max(logits, axis=-1, keepdims=True)
        logits = jnp.where(logits >= top + jnp.log(config.min_p), logits, -jnp.inf)
    return logits


def probabilities(logits, config: SamplingConfig):
    """logits [..., V] -> float32 [..., V]: the exact distribution ``sample`` draws from.

    Greedy gives a one-hot. Speculative sampling uses this for the draft's q and the target's p.
    """
    return jax.nn.softmax(filtered_logits(logits, config), axis=-1)


def sample(logits, key, config: SamplingConfig):
    """logits [B, V] -> token ids [B] int32, drawn with ``key`` (unused when greedy)."""
    if config.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits, config), axis=-1).astype(jnp.int32)
