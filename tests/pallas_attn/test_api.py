"""Bad input raises at the public API, naming the argument."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_attn import BlockSizes, flash_attention, flash_attention_varlen


def _qkv(T=4, S=4, Hq=4, Hkv=2, D=8, B=1, dtype=jnp.float32):
    return (
        jnp.zeros((B, T, Hq, D), dtype),
        jnp.zeros((B, S, Hkv, D), dtype),
        jnp.zeros((B, S, Hkv, D), dtype),
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (_qkv(Hq=6, Hkv=4), {}, ValueError, "Hq=6"),
        ((_qkv()[0], *_qkv(D=16)[1:]), {}, ValueError, "head dim"),
        ((jnp.zeros((4, 4, 8)), *_qkv()[1:]), {}, ValueError, "q must have rank 4"),
        ((_qkv()[0], jnp.zeros((1, 4, 2)), _qkv()[2]), {}, ValueError, "k must have rank 4"),
        (_qkv(), {"impl": "cuda"}, ValueError, "impl"),
        (_qkv(), {"window_size": (2,)}, ValueError, "window_size"),
        (_qkv(), {"window_size": (-2, 0)}, ValueError, "window_size"),
        (_qkv(), {"softcap": -1.0}, ValueError, "softcap"),
        (_qkv(), {"softmax_scale": 0.0}, ValueError, "softmax_scale"),
        (_qkv(), {"q_segment_ids": jnp.zeros((1, 4), jnp.int32)}, ValueError, "segment"),
        (
            _qkv(),
            {
                "q_segment_ids": jnp.zeros((1, 5), jnp.int32),
                "kv_segment_ids": jnp.zeros((1, 4), jnp.int32),
            },
            ValueError,
            "q_segment_ids",
        ),
        (_qkv(dtype=jnp.int32), {}, TypeError, "q must have dtype"),
        ((*_qkv()[:2], _qkv(dtype=jnp.bfloat16)[2]), {}, TypeError, "dtype"),
        ((_qkv()[0], *_qkv(B=2)[1:]), {}, ValueError, "batch"),
        (_qkv(), {"block_sizes": (64, 64)}, TypeError, "block_sizes"),
        (([[1.0]], *_qkv()[1:]), {}, TypeError, "q must be an array"),
    ],
)
def test_bad_input_raises(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        flash_attention(*args, **kwargs)


def test_block_sizes_reject_non_positive():
    with pytest.raises(ValueError, match="block_q"):
        BlockSizes(block_q=0)


def test_auto_dispatch_runs_on_cpu_and_returns_dtype():
    q, k, v = _qkv(dtype=jnp.bfloat16)
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (1, 4, 4)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (_qkv(D=0), "q must have D >= 1"),
        (_qkv(B=0), "q must have B >= 1"),
        (_qkv(T=0), "q must have T >= 1"),
        (_qkv(S=0), "k must have S >= 1"),
        (_qkv(Hq=0), "q must have H >= 1"),
    ],
)
def test_empty_dims_raise_naming_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        flash_attention(*args)


def test_varlen_empty_dims_raise():
    q = jnp.zeros((0, 2, 16))
    cu = jnp.array([0, 0], jnp.int32)
    with pytest.raises(ValueError, match="q must have T >= 1"):
        flash_attention_varlen(q, jnp.zeros((4, 2, 16)), jnp.zeros((4, 2, 16)), cu, cu, 1, 1)
    with pytest.raises(ValueError, match="q must have D >= 1"):
        flash_attention_varlen(jnp.zeros((4, 2, 0)), *[jnp.zeros((4, 2, 0))] * 2, cu, cu, 1, 1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"softcap": float("nan")}, "softcap"),
        ({"softcap": float("inf")}, "softcap"),
        ({"softcap": True}, "softcap"),
        ({"softmax_scale": float("nan")}, "softmax_scale"),
        ({"softmax_scale": np.float32("inf")}, "softmax_scale"),
        ({"softmax_scale": jnp.float32(0.5)}, "softmax_scale"),  # a jax.Array: not static
    ],
)
def test_non_finite_scalars_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        flash_attention(*_qkv(), impl="reference", **kwargs)


def test_numpy_scalars_are_accepted():
    q, k, v = (
        jnp.asarray(np.random.default_rng(i).normal(size=x.shape), jnp.float32)
        for i, x in enumerate(_qkv())
    )
    want = flash_attention(q, k, v, softcap=30.0, softmax_scale=0.25, impl="reference")
    got = flash_attention(
        q, k, v, softcap=np.float32(30.0), softmax_scale=np.float64(0.25), impl="reference"
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_second_derivatives_raise_a_clear_error(impl):
    q, k, v = (x + 0.5 for x in _qkv(D=16))

    def f(q):
        return jnp.sum(flash_attention(q, k, v, causal=True, impl=impl) ** 2)

    assert jnp.all(jnp.isfinite(jax.grad(f)(q)))  # first order works
    with pytest.raises(ValueError, match="second derivatives are not supported"):
        jax.grad(lambda q: jnp.sum(jax.grad(f)(q)))(q)


def test_reference_supports_second_derivatives():
    q, k, v = (x + 0.5 for x in _qkv(D=16))

    def f(q):
        return jnp.sum(flash_attention(q, k, v, causal=True, impl="reference") ** 3)

    assert jnp.all(jnp.isfinite(jax.grad(lambda q: jnp.sum(jax.grad(f)(q)))(q)))


def test_docstring_mask_drawing_is_the_mask_rule():
    """The T = 2, S = 5 drawing in ``flash_attention``'s docstring, row by row, is what
    ``masks.visible`` computes (query ``i`` at key position ``i + S - T``)."""
    from pallas_attn import masks

    lines = [ln.split() for ln in flash_attention.__doc__.splitlines()]
    drawn = [ln for ln in lines if len(ln) == 15 and set("".join(ln)) <= {"0", "1"}]
    assert len(drawn) == 2
    q_pos, k_pos = 3 + np.arange(2)[:, None], np.arange(5)[None, :]
    for col, window in enumerate([(-1, 0), (1, 0), (1, 1)]):
        want = np.array([[int(x) for x in row[5 * col : 5 * col + 5]] for row in drawn])
        got = masks.visible(q_pos, k_pos, window=window)
        np.testing.assert_array_equal(np.asarray(got, int), want)
