"""The acceptance rule of speculative decoding (Leviathan et al., 2023; Chen et al., 2023), shared by
every loop that verifies drafts (``decoding.speculative``, ``decoding.medusa``, the engine's
``decoding.engine_steps``): which drafted tokens a target keeps, and the one token it adds, so
that the output is distributed exactly as the target's."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from decoding.sampling import all_greedy, argmax, branch, probabilities


def accept(p, q, draft_tokens, key, lengths=None):
    """The speculative sampling rule: p [B, k+1, V] (target), q [B, k, V] (draft), draft_tokens
    [B, k] drawn from q -> (n [B], the number of draft tokens kept, and next [B], one more token).

    ``d_1 .. d_n, next`` is distributed exactly as n + 1 tokens sampled one by one from the
    target (p_i is the target's distribution after d_1 .. d_{i-1}), whatever q is. Greedy (one-hot
    p and q) accepts while the draft equals the target's argmax, then takes the argmax.

    ``lengths`` [B] (or None: k each): row b's draft is its first ``lengths[b]`` tokens, the
    rest padding: the rule on the shorter draft (n <= lengths[b]; all of it accepted, next is
    drawn from p at ``lengths[b]``), with the same random draws whatever the padding holds.
    """
    B, k, V = q.shape
    key_u, key_r = jax.random.split(key)
    if lengths is not None:  # past a row's draft: q = 0 there, and never accepted
        live = jnp.arange(k)[None] < jnp.asarray(lengths)[:, None]
        q = jnp.where(live[..., None], q, 0.0)
    p_d = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]  # p_i(d_i)
    q_d = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]  # q_i(d_i)
    u = 1.0 - jax.random.uniform(key_u, (B, k))  # u ~ U(0, 1]
    # 1. Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)), i.e. iff u_i <= p_i / q_i.
    ok = u * q_d <= p_d
    if lengths is not None:
        ok &= live
    # 2. Keep the draft up to its first rejection: n = leading accepted tokens (k if none fail).
    n = jnp.sum(jnp.cumprod(ok, axis=1), axis=1).astype(jnp.int32)
    # 3. At the first rejection sample from normalize(max(p_n - q_n, 0)); with q_{k+1} = 0 the
    #    same formula gives the bonus token from p_{k+1} when all k were accepted.
    q_pad = jnp.concatenate([q, jnp.zeros((B, 1, V), q.dtype)], axis=1)
    rows = jnp.arange(B)
    residual = jnp.maximum(p[rows, n] - q_pad[rows, n], 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p[rows, n])
    # 4. Sample next ~ residual (unnormalised weights: categorical normalises).
    nxt = jax.random.categorical(key_r, jnp.log(residual), axis=-1).astype(jnp.int32)
    return n, nxt


def accept_greedy(best, draft_tokens):
    """The greedy limit of :func:`accept`, with no randomness and no [V]-sized work: best [B, k+1]
    the target's argmax after each verified input -> (n [B], the leading draft tokens equal to the
    target's argmax; next [B], the argmax after them)."""
    k = draft_tokens.shape[1]
    n = jnp.sum(jnp.cumprod(draft_tokens == best[:, :k], axis=1), axis=1).astype(jnp.int32)
    return n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]


def verify(logits, q, draft_tokens, sampling, key):
    """The target's logits [B, k+1, V] after ``[last, d_1 .. d_k]`` -> (n, next): :func:`accept`
    on ``p = probabilities(logits)``, or :func:`accept_greedy` when every row of ``sampling``
    (a ``SamplingConfig`` or ``SamplingParams``) is greedy: decided on the device for traced
    settings; for a greedy ``SamplingConfig`` while tracing (q is then unused and may be None)."""
    return branch(
        all_greedy(sampling),
        lambda: accept_greedy(argmax(logits), draft_tokens),
        lambda: accept(probabilities(logits, sampling), q, draft_tokens, key),
    )
