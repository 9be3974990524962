"""Jitted generation on the tiny model: greedy == full-forward argmax, paged == contiguous,
per-row EOS, seeds, no recompilation across similar calls, pool errors before work."""

from __future__ import annotations

import collections
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from decoding import paging
from decoding.generate import compiled_count, decode_step, generate, prefill
from decoding.sampling import SamplingConfig
from models import KVCache

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [100, 50, 3, 3, 3, 3, 3, 3, 9]]  # B = 3 -> padded to 4
NEW = 12
TOP_P = SamplingConfig(temperature=1.0, top_p=0.9)


def full_forward_greedy(model, prompts, n):
    """n greedy tokens per prompt by re-running the full (uncached) forward on the growing
    sequences, right-padded to one fixed length (causal: padding never affects earlier logits)."""
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
    L = max(len(p) for p in prompts) + n
    seqs = np.zeros((len(prompts), L), np.int32)
    for b, p in enumerate(prompts):
        seqs[b, : len(p)] = p
    lengths = np.array([len(p) for p in prompts])
    for _ in range(n):
        logits = np.asarray(forward(params, jnp.asarray(seqs)))
        rows = np.arange(len(prompts))
        seqs[rows, lengths] = logits[rows, lengths - 1].argmax(-1)
        lengths += 1
    return [seqs[b, len(p) : len(p) + n].tolist() for b, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def greedy_paged(tiny_model):
    return generate(tiny_model, PROMPTS, max_new_tokens=NEW)


def test_greedy_equals_full_forward_argmax(tiny_model, greedy_paged):
    assert [len(t) for t in greedy_paged.tokens] == [NEW] * len(PROMPTS)
    assert greedy_paged.tokens == full_forward_greedy(tiny_model, PROMPTS, NEW)
    assert len({tuple(t) for t in greedy_paged.tokens}) == len(PROMPTS)  # not degenerate


def test_paged_equals_contiguous(tiny_model):
    """Sampled (so every logit matters, not just the argmax), same seed, both caches."""
    sampled = [
        generate(tiny_model, PROMPTS, max_new_tokens=NEW, sampling=TOP_P, seed=3, cache=kind)
        for kind in ("paged", "contiguous")
    ]
    assert sampled[0].tokens == sampled[1].tokens


def test_same_seed_same_tokens_other_seed_differs(tiny_model):
    runs = [
        generate(tiny_model, PROMPTS, max_new_tokens=NEW, sampling=TOP_P, seed=s) for s in (5, 5, 6)
    ]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].tokens != runs[2].tokens


def test_eos_stops_each_row_and_is_included(tiny_model, greedy_paged):
    eos = greedy_paged.tokens[0][4]
    res = generate(tiny_model, PROMPTS, max_new_tokens=NEW, eos_id=eos)
    for full, got in zip(greedy_paged.tokens, res.tokens, strict=True):
        want = full[: full.index(eos) + 1] if eos in full else full
        assert got == want
    assert res.tokens[0][-1] == eos and len(res.tokens[0]) == 5
    assert res.stats["new_tokens"] == sum(len(t) for t in res.tokens)


def test_array_prompts_and_single_token(tiny_model, greedy_paged):
    res = generate(tiny_model, np.array([PROMPTS[0], PROMPTS[0]], np.int32), max_new_tokens=1)
    assert res.tokens == [greedy_paged.tokens[0][:1]] * 2
    assert res.stats["steps"] == 1


def test_similar_calls_do_not_recompile(tiny_model):
    generate(tiny_model, PROMPTS, max_new_tokens=NEW)  # compiled (or reused) here
    before = compiled_count()
    generate(tiny_model, PROMPTS[:2], max_new_tokens=NEW + 20, eos_id=3)  # batch 2 -> 2
    res = generate(tiny_model, [[5] * 14, [6], [7, 8], [9]], max_new_tokens=7)  # prompt 14 -> 16
    assert res.stats["compile_s"] == 0.0
    after_similar = compiled_count()
    res = generate(tiny_model, [[5] * 70, [6], [7]], max_new_tokens=NEW)  # prompt bucket 80
    assert after_similar - before <= 2  # only batch 2 (prefill + loop) may be new
    assert compiled_count() == after_similar + 2
    assert res.stats["compile_s"] > 0


def test_stats_fields(greedy_paged):
    stats = greedy_paged.stats
    for key in ("prefill_s", "decode_s", "new_tokens", "tokens_per_s"):
        assert stats[key] > 0
    assert stats["new_tokens"] == len(PROMPTS) * NEW


def test_pool_too_small_raises_before_work(tiny_model):
    before = compiled_count()
    with pytest.raises(paging.OutOfPagesError, match="num_pages"):
        generate(tiny_model, PROMPTS, max_new_tokens=NEW, num_pages=4, sampling=TOP_P)
    assert compiled_count() == before


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"cache": "ring"}, "cache"),
        ({"page_size": 0}, "page_size"),
        ({"eos_id": 10_000}, "eos_id"),
        ({"prompts": []}, "prompts"),
        ({"prompts": [[1], []]}, "prompt 1"),
        ({"prompts": [[1, 999]]}, "token ids"),
        ({"max_new_tokens": 600}, "max_position"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**32}, "seed"),
        ({"prompts": np.ones((2, 3, 1), np.int32)}, "prompts"),
    ],
)
def test_bad_arguments_raise(tiny_model, kwargs, match):
    args = {"prompts": PROMPTS, "max_new_tokens": 4} | kwargs
    with pytest.raises(ValueError, match=match):
        generate(tiny_model, args.pop("prompts"), **args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"eos_id": 2.9}, "eos_id"),
        ({"eos_id": True}, "eos_id"),
        ({"seed": 1.5}, "seed"),
        ({"prompts": [[1, 2.7]]}, "prompt 0"),
        ({"prompts": [[1], [np.float32(3.0)]]}, "prompt 1"),
        ({"prompts": np.ones((1, 3), np.float32)}, "prompts"),
    ],
)
def test_non_int_ids_and_seed_are_type_errors(tiny_model, kwargs, match):
    """Floats were truncated silently (2.9 -> 2); now the argument is named."""
    args = {"prompts": PROMPTS, "max_new_tokens": 4} | kwargs
    with pytest.raises(TypeError, match=match):
        generate(tiny_model, args.pop("prompts"), **args)


def test_seed_range_ends_are_accepted(tiny_model, greedy_paged):
    for seed in (0, np.uint32(2**32 - 1)):  # greedy: the seed is used but cannot matter
        assert generate(tiny_model, PROMPTS, max_new_tokens=NEW, seed=seed).tokens == (
            greedy_paged.tokens
        )


class _Allocated(Exception):
    pass


def test_page_size_is_capped_at_what_the_request_uses(tiny_model, monkeypatch):
    """A page of 1e6 positions for 12 new tokens allocated [B, 1e6, Hkv, D] per layer."""
    sizes = []

    def spy(config, num_pages, page_size, block_table, **placement):
        sizes.append((num_pages, page_size))
        raise _Allocated  # stop before allocating or compiling anything

    monkeypatch.setattr(KVCache, "paged", spy)
    with pytest.raises(_Allocated):
        generate(tiny_model, PROMPTS, max_new_tokens=NEW, page_size=1_000_000)
    [(num_pages, page_size)] = sizes
    assert page_size == 16 + 64  # bucketed prompt (9 -> 16) + new tokens
    assert num_pages == 4 + 1  # B = 3 padded to 4, one page each, and the scratch page


def test_prefill_and_decode_step_compose_and_roll_back(tiny_model, greedy_paged):
    """The pieces speculative decoding builds on: prefill, decode_step, and rollback by length."""
    graphdef, params = nnx.split(tiny_model)
    greedy = SamplingConfig()
    eos = jnp.int32(-1)
    prompt = PROMPTS[0]

    @jax.jit
    def run(params, tokens, lengths, cache):
        model = nnx.merge(graphdef, params)
        done = jnp.zeros((1,), bool)
        s = prefill(
            model,
            tokens,
            lengths,
            cache,
            key=jax.random.key(0),
            done=done,
            eos_id=eos,
            num_new_max=8,
            sampling=greedy,
        )
        for _ in range(3):
            s = decode_step(model, s, eos_id=eos, sampling=greedy)
        # Roll back the last two fed tokens and feed them again: same tokens come out.
        back = s.replace(
            cache=s.cache.replace(lengths=s.cache.lengths - 2),
            last=s.tokens[:, 1],
            num_new=s.num_new - 2,
            step=s.step - 2,
        )
        for _ in range(2):
            back = decode_step(model, back, eos_id=eos, sampling=greedy)
        return s.tokens, back.tokens

    tokens = jnp.zeros((1, 16), jnp.int32).at[0, : len(prompt)].set(jnp.asarray(prompt))
    cache = KVCache.contiguous(tiny_model.config, 1, 32)
    first, again = run(params, tokens, jnp.asarray([len(prompt)], jnp.int32), cache)
    assert first[0, :4].tolist() == greedy_paged.tokens[0][:4]
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))


def test_decode_layout_model_greedy_equals_full_forward_argmax():
    """A model wide enough for ``attach_decode_weights`` (dim 512): the decode loop's transposed-kernel
    products give the full forward's greedy tokens, batched (few-row products)."""
    from models import Transformer, TransformerConfig

    config = TransformerConfig.preset("tiny", attn_impl="xla", dim=512, mlp_dim=1024)
    model = Transformer(config, rngs=nnx.Rngs(3))
    res = generate(model, PROMPTS, max_new_tokens=8)
    assert res.tokens == full_forward_greedy(model, PROMPTS, 8)


def test_twenty_sampling_settings_compile_the_loop_once(tiny_model):
    """Settings are data: 20 temperatures / top-p / top-k / min-p values (and greedy) share one
    prefill and one loop; each still samples as itself (same seed, different settings)."""
    generate(tiny_model, PROMPTS, max_new_tokens=NEW, sampling=TOP_P)  # compiled (or reused)
    before = compiled_count()
    outs = set()
    for i, t in enumerate(np.linspace(0.0, 1.9, 20)):
        cfg = SamplingConfig(temperature=float(t), top_p=1.0 - i / 40, top_k=i % 7, min_p=i / 100)
        res = generate(tiny_model, PROMPTS, max_new_tokens=NEW, sampling=cfg, seed=1)
        assert res.stats["compile_s"] == 0.0
        outs.add(tuple(map(tuple, res.tokens)))
    assert compiled_count() == before
    assert len(outs) > 10


def test_executable_cache_is_bounded(tiny_model, monkeypatch):
    gen = importlib.import_module("decoding.generate")  # the module, not the function
    monkeypatch.setattr(gen, "MAX_EXECUTABLES", 2)
    monkeypatch.setattr(gen, "_EXECUTABLES", collections.OrderedDict())  # none compiled yet
    before = compiled_count()
    for n in (3, 20, 40):  # three prompt buckets: 6 executables
        generate(tiny_model, [[1] * n], max_new_tokens=2)
    assert len(gen._EXECUTABLES) <= 2 and compiled_count() >= before + 4


def test_padding_rows_take_no_pages(tiny_model):
    """Three prompts (padded to four rows) fit the pool four prompts need, less the fourth's
    page (they took a full row of 5 more pages for the padding row)."""
    four = PROMPTS + [[4, 4]]
    pages = 6  # pages of 16 for 17, 16, 21 and 16 positions
    want = generate(tiny_model, four, max_new_tokens=NEW, num_pages=pages)
    res = generate(tiny_model, PROMPTS, max_new_tokens=NEW, num_pages=pages - 1)
    assert res.tokens == want.tokens[:3]
    with pytest.raises(paging.OutOfPagesError):
        generate(tiny_model, PROMPTS, max_new_tokens=NEW, num_pages=pages - 2)


def test_numpy_scalars_accepted(tiny_model, greedy_paged):
    res = generate(
        tiny_model,
        PROMPTS,
        max_new_tokens=np.int64(NEW),
        eos_id=np.int32(0),
        seed=np.uint32(3),
        page_size=np.int64(16),
        num_pages=np.int64(8),
    )
    assert res.tokens == generate(tiny_model, PROMPTS, max_new_tokens=NEW, eos_id=0).tokens


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"page_size": True}, "page_size"),
        ({"num_pages": True}, "num_pages"),
        ({"num_pages": 2.0}, "num_pages"),
        ({"seed": True}, "seed"),
        ({"model": "tiny"}, "model"),
        ({"model": object()}, "model"),
        ({"sampling": "greedy"}, "sampling"),
    ],
)
def test_bools_and_wrong_objects_are_type_errors(tiny_model, kwargs, match):
    args = {"model": tiny_model, "max_new_tokens": 4} | kwargs
    with pytest.raises(TypeError, match=match):
        generate(args.pop("model"), PROMPTS, **args)
