"""pallas_attn.cache.set_rows: the native in-place row write for 16-bit caches on CPU equals the
jnp scatter (mode="drop") it stands for."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import cache, native

pytestmark = pytest.mark.skipif(not native.available(), reason="native CPU kernels not built")


def _plain(x, i0, i1, values):
    return x.at[i0, i1].set(values.astype(x.dtype), mode="drop")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize(
    "shape,idx", [((9, 4, 3, 5), (2, 3)), ((6, 7, 2), (5,)), ((5, 1, 40), (4,))]
)
def test_matches_the_scatter(dtype, shape, idx):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    # in range, repeated rows (the last write wins, as in the scatter's order), negative (from
    # the end) and out of range in either index (dropped)
    i0 = rng.integers(-1, shape[0] + 2, idx).astype(np.int32)
    i1 = rng.integers(0, shape[1] + 1, idx).astype(np.int32)
    i0.flat[0], i1.flat[0] = 1, 0
    i0.flat[-1], i1.flat[-1] = -1, shape[1] - 1  # counts from the end, as in jnp
    i0.flat[1 % i0.size], i1.flat[1 % i0.size] = -shape[0] - 1, 0  # below -dim: dropped
    values = jnp.asarray(rng.standard_normal((*idx, *shape[2:])), jnp.float32)
    got = jax.jit(cache.set_rows)(x, i0, i1, values)
    want = jax.jit(_plain)(x, i0, i1, values)
    assert got.dtype == x.dtype and got.shape == x.shape
    # distinct positions: equal bit for bit (the scatter leaves repeated ones unordered)
    norm = lambda i, d: i + d if -d <= i < 0 else i  # noqa: E731
    flat = [(norm(a, shape[0]), b) for a, b in zip(i0.ravel(), i1.ravel(), strict=True)]
    if len(set(flat)) == len(flat):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        keep = np.ones(shape[:2], bool)
        for a, b in flat:
            if 0 <= a < shape[0] and 0 <= b < shape[1] and flat.count((a, b)) > 1:
                keep[a, b] = False
        np.testing.assert_array_equal(np.asarray(got)[keep], np.asarray(want)[keep])


def test_in_place_under_donation():
    """Donated, the cache's buffer is written where it lies (no copy of a large pool)."""
    x = jnp.zeros((4096, 16, 3, 64), jnp.bfloat16)  # 25 MB
    ptr = x.unsafe_buffer_pointer()
    f = jax.jit(cache.set_rows, donate_argnums=0)
    i0, i1 = jnp.array([[7, 4095]], jnp.int32), jnp.array([[3, 15]], jnp.int32)
    y = f(x, i0, i1, jnp.ones((1, 2, 3, 64)))
    assert y.unsafe_buffer_pointer() == ptr
    assert float(y[7, 3].astype(jnp.float32).sum()) == 3 * 64 and float(y.sum()) == 2 * 3 * 64
