"""The blockwise XLA path against the float32 reference: forward, lse and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_utils import check_close, max_err, random_qkv

from pallas_attn import BlockSizes, flash_attention, reference

# Awkward shapes, each with a different option mix; small blocks so several key/query blocks,
# partial last blocks and skipped blocks are all exercised.
CASES = [
    dict(T=1, S=1, Hq=1, Hkv=1, D=16),
    dict(T=1, S=129, Hq=8, Hkv=1, D=64, causal=True),
    dict(T=7, S=7, Hq=4, Hkv=1, D=40, causal=True),
    dict(T=33, S=33, Hq=4, Hkv=4, D=80, window=(8, 0)),
    dict(T=33, S=129, Hq=8, Hkv=2, D=128, causal=True, softcap=5.0),
    dict(T=129, S=33, Hq=4, Hkv=1, D=64, causal=True),
    dict(T=200, S=200, Hq=8, Hkv=1, D=16, window=(17, 5), softcap=2.0),
    dict(T=200, S=129, Hq=2, Hkv=2, D=40, segments=True),
    dict(T=129, S=129, Hq=4, Hkv=1, D=64, causal=True, segments=True),
]


def _segments(B, T, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, 3, (B, T)), axis=1), jnp.int32)


def _run(case, dtype, seed=0):
    """Returns (value, grads) for xla, the f32 oracle and the same-precision reference."""
    case = dict(case)
    opts = dict(
        causal=case.pop("causal", False),
        window_size=case.pop("window", (-1, -1)),
        softcap=case.pop("softcap", 0.0),
    )
    segments = case.pop("segments", False)
    B = 2
    q, k, v = random_qkv(seed, B, **case, dtype=dtype)
    if segments:
        # Same segment layout for q and k when T == S, else ids drawn independently.
        opts["q_segment_ids"] = _segments(B, case["T"], seed)
        opts["kv_segment_ids"] = _segments(B, case["S"], seed + (case["T"] != case["S"]))
    kd, kl = jax.random.split(jax.random.key(seed + 100))
    d_out = jax.random.normal(kd, q.shape, jnp.float32).astype(dtype)
    d_lse = jax.random.normal(kl, (B, case["Hq"], case["T"]), jnp.float32)

    def loss(fn, q, k, v):
        out, lse = fn(q, k, v)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(lse * d_lse), (out, lse)

    scale = case["D"] ** -0.5
    window = (opts["window_size"][0], 0 if opts["causal"] else opts["window_size"][1])
    ref_kw = dict(
        softmax_scale=scale,
        window=window,
        softcap=opts["softcap"],
        q_segment_ids=opts.get("q_segment_ids"),
        kv_segment_ids=opts.get("kv_segment_ids"),
    )
    fns = {
        "xla": functools.partial(
            flash_attention,
            **opts,
            return_lse=True,
            impl="xla",
            block_sizes=BlockSizes(block_q=16, block_k=32),
        ),
        "oracle": lambda q, k, v: reference.attention(
            *(x.astype(jnp.float32) for x in (q, k, v)), **ref_kw
        ),
        "same": lambda q, k, v: reference.attention(q, k, v, **ref_kw, upcast=False),
    }
    results = {}
    for name, fn in fns.items():
        grad_fn = jax.jit(jax.grad(functools.partial(loss, fn), argnums=(0, 1, 2), has_aux=True))
        grads, (out, lse) = grad_fn(q, k, v)
        results[name] = (out, lse, grads)
    return results


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_xla_matches_reference(case, dtype):
    r = _run(case, dtype)
    out, lse, grads = r["xla"]
    ref_out, ref_lse, ref_grads = r["oracle"]
    same_out, _, same_grads = r["same"]
    floor = 1e-5 if dtype == jnp.float32 else 1e-3
    check_close(out, ref_out, same_out, factor=2, floor=floor)
    assert max_err(lse, ref_lse) <= 1e-4
    for name, g, g_ref, g_same in zip("qkv", grads, ref_grads, same_grads, strict=True):
        assert g.dtype == dtype, name
        check_close(g, g_ref, g_same, factor=3, floor=10 * floor)


def test_fully_masked_rows_give_zero_and_no_nan():
    # T > S with causal: the first T - S queries sit before key 0 and see nothing.
    q, k, v = random_qkv(3, 2, 20, 8, 4, 2, 16)
    seg_q = jnp.zeros((2, 20), jnp.int32).at[:, -3:].set(7)  # last rows: a segment with no keys
    seg_k = jnp.zeros((2, 8), jnp.int32)

    def f(q, k, v):
        out, lse = flash_attention(
            q,
            k,
            v,
            causal=True,
            q_segment_ids=seg_q,
            kv_segment_ids=seg_k,
            return_lse=True,
            impl="xla",
            block_sizes=BlockSizes(block_q=8, block_k=8),
        )
        return jnp.sum(out**2), (out, lse)

    grads, (out, lse) = jax.grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    hidden = np.zeros((20,), bool)
    hidden[:12] = True
    hidden[-3:] = True
    assert np.all(np.asarray(out)[:, hidden] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[:, :, hidden]))
    assert np.all(np.isfinite(np.asarray(lse)[:, :, ~hidden]))
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g)))
    assert np.all(np.asarray(grads[0])[:, hidden] == 0)


def test_xla_is_deterministic():
    q, k, v = random_qkv(4, 1, 65, 65, 4, 2, 32)
    f = jax.jit(
        jax.grad(lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, impl="xla")))
    )
    a, b = f(q, k, v), f(q, k, v)
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_xla_memory_is_linear_in_sequence_length():
    """T = 16384, H = 8, D = 64 float32: the T^2 score matrix alone would be 8 GiB."""
    T, H, D = 16384, 8, 64
    spec = jax.ShapeDtypeStruct((1, T, H, D), jnp.float32)

    def fwd_bwd(q, k, v):
        return jax.grad(
            lambda q, k, v: jnp.sum(flash_attention(q, k, v, causal=True, impl="xla")),
            argnums=(0, 1, 2),
        )(q, k, v)

    compiled = jax.jit(fwd_bwd).trace(spec, spec, spec).lower().compile()
    mem = compiled.memory_analysis()
    temp = mem.temp_size_in_bytes
    scores = H * T * T * 4
    assert temp < scores / 20, f"temp {temp / 2**20:.0f} MiB vs scores {scores / 2**20:.0f} MiB"
