"""The online-softmax helpers every impl calls, against a float64 softmax computed directly."""

import jax.numpy as jnp
import numpy as np

from pallas_attn import softmax


def _direct(s, v, mask):
    """float64 softmax(s) v over visible keys, and the natural-log lse; rows with none: 0, -inf."""
    out = np.zeros((s.shape[0], v.shape[1]))
    lse = np.full(s.shape[0], -np.inf)
    for i in range(s.shape[0]):
        keys = np.flatnonzero(mask[i])
        if keys.size:
            p = np.exp(s[i, keys] - s[i, keys].max())
            out[i] = p @ v[keys] / p.sum()
            lse[i] = s[i, keys].max() + np.log(p.sum())
    return out, lse


def _run(s, v, mask, tiles):
    """Online softmax over key tiles ``tiles`` (slices), then finalize."""
    carry = softmax.init((s.shape[0],), v.shape[1])
    s2 = jnp.asarray(s * softmax.LOG2E, jnp.float32)
    for t in tiles:
        carry = softmax.step(carry, s2[:, t], jnp.asarray(v[t], jnp.float32), jnp.dot, mask[:, t])
    return softmax.finalize(*carry)


def test_tiled_steps_finalize_and_combine_match_direct_softmax():
    rng = np.random.default_rng(0)
    s = rng.normal(size=(4, 10)) * 5
    v = rng.normal(size=(10, 3))
    mask = rng.random((4, 10)) < 0.6
    mask[2] = False  # a row that sees no key
    mask[3, :] = [True] + [False] * 9  # a row that sees one key, in the first tile only
    want_out, want_lse = _direct(s, v, mask)
    tiles = [slice(0, 3), slice(3, 7), slice(7, 10)]
    out, lse = _run(s, v, mask, tiles)
    np.testing.assert_allclose(out, want_out, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, atol=1e-5)
    assert np.all(np.asarray(out)[2] == 0) and np.isneginf(lse[2])
    # Split-KV: finalize each split on its own, then combine.
    parts = [_run(s, v, mask, [t]) for t in tiles]
    out_c, lse_c = softmax.combine(
        jnp.stack([p[0] for p in parts]), jnp.stack([p[1] for p in parts]), axis=-2
    )
    np.testing.assert_allclose(out_c, want_out, atol=1e-5)
    np.testing.assert_allclose(lse_c, want_lse, atol=1e-5)
    assert np.all(np.isfinite(np.asarray(out_c)))


def test_scale_scores_softcap_and_score_grad():
    s = jnp.array([[-3.0, 0.5, 8.0]])
    s2, t = softmax.scale_scores(s, 0.5, 2.0)
    np.testing.assert_allclose(
        s2, 2.0 * np.tanh(0.5 * np.asarray(s) / 2.0) * softmax.LOG2E, rtol=1e-6
    )
    np.testing.assert_allclose(softmax.scale_scores(s, 0.5, 0.0)[0], s * 0.5 * softmax.LOG2E)
    p, dp, delta = jnp.array([[0.2, 0.3, 0.5]]), jnp.array([[1.0, -2.0, 0.5]]), 0.25
    want = np.asarray(p * (dp - delta) * (1 - t * t))
    np.testing.assert_allclose(softmax.score_grad(p, dp, delta, t), want, rtol=1e-6)
