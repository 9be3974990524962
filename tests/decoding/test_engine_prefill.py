"""Prefill chunks of one bucket run together (``Runner.prefill_chunks``) where the CPU's packed
few-row products serve them: fewer calls, the same keys bit for bit as one call per chunk,
greedy output equal to ``generate`` alone. From a decode batch of ``MIX_MIN_BATCH`` on, chunks
ride in the decode step instead (``Runner.fold``): the same outputs and keys (up to float32
reassociation), and nothing compiles after ``Engine.warmup``."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import random_transformer

from decoding import PromptLookup, drafts, engine_steps
from decoding import runner as runner_mod
from decoding.engine import Engine
from decoding.generate import generate
from models import rows_matmul

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not rows_matmul.available(),
    reason="grouping needs the CPU's packed few-row products",
)

MAX_NEW = 6


@pytest.fixture(scope="module")
def model():
    """Wide enough (256 x 256 kernels) for packed weights, so grouping applies."""
    return random_transformer(3, dim=256, mlp_dim=512, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    # chunk buckets 8, 16, 8, 32, 16, 56, 8 (a chunk is the prompt less its last token)
    return [rng.integers(0, 256, n).tolist() for n in (9, 17, 5, 30, 12, 50, 3)]


def run(model, prompts, monkeypatch, grouped: bool):
    monkeypatch.setattr(runner_mod, "MIX_MIN_BATCH", 1 << 30)  # no chunk rides in a decode step
    if not grouped:  # every bucket's calls hold one chunk
        monkeypatch.setattr(runner_mod, "DECODE_MAX_ROWS", 1)
    eng = Engine(model, max_batch=8, num_pages=64, page_size=8, max_seq_len=96)
    sizes = []
    real = eng.runner.prefill

    def counted(chunks, C, replay=False):
        sizes.append((C, len(chunks)))
        return real(chunks, C, replay)

    monkeypatch.setattr(eng.runner, "prefill", counted)
    ids = [eng.submit(p, MAX_NEW) for p in prompts]
    eng.step()  # every prompt's prefill, then the first decode step
    pool = [np.asarray(x) for x in (*eng.runner.k, *eng.runner.v)]
    out = eng.run_until_done()
    monkeypatch.undo()
    return [out[r] for r in ids], sizes, pool


def test_chunks_of_a_bucket_share_a_call(model, prompts, monkeypatch):
    got, sizes, pool = run(model, prompts, monkeypatch, grouped=True)
    alone, sizes1, pool1 = run(model, prompts, monkeypatch, grouped=False)
    assert sorted(sizes) == [(8, 3), (16, 2), (32, 1), (56, 1)]
    assert all(n == 1 for _, n in sizes1) and len(sizes1) == len(prompts)
    want = [generate(model, [p], max_new_tokens=MAX_NEW).tokens[0] for p in prompts]
    assert got == alone == want
    for a, b in zip(pool, pool1, strict=True):  # every key and value bit for bit
        np.testing.assert_array_equal(a[:-1], b[:-1])  # (the last page is scratch: padding)


def test_prompts_cut_over_steps(model):
    """Prompts longer than max_prefill_tokens are cut in chunks over steps, beside short ones
    (a step's chunks of one request, a ring replay then its prefill, keep their order:
    test_engine_windows' preemption test covers it on sliding-window models)."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 256, n).tolist() for n in (40, 37, 8)]
    eng = Engine(
        model, max_batch=4, num_pages=64, page_size=8, max_seq_len=96, max_prefill_tokens=16
    )
    ids = [eng.submit(p, MAX_NEW) for p in prompts]
    out = eng.run_until_done()
    want = [generate(model, [p], max_new_tokens=MAX_NEW).tokens[0] for p in prompts]
    assert [out[r] for r in ids] == want


def arrive(eng, running, arriving, running_new: int):
    """Submits ``running``, steps 3 times (they decode), then submits ``arriving`` (prompts
    that arrive while they decode) and runs to the end -> (request ids, outputs)."""
    ids = [eng.submit(p, running_new) for p in running]
    for _ in range(3):
        eng.step()
    ids += [eng.submit(p, MAX_NEW) for p in arriving]
    return ids, eng.run_until_done()


def test_chunks_fold_into_decode_steps(model, monkeypatch):
    """Prompts arriving while 6 rows decode (a decode batch of 8): their chunks are rows of the
    decode step where they fit in its free rows (a 60-token one does not: its own call), and a
    request whose prompt ends there decodes in the same step. Outputs equal ``generate`` alone
    and the engine's without folding; the keys written agree to float32 reassociation."""
    rng = np.random.default_rng(7)
    running = [rng.integers(0, 256, 4).tolist() for _ in range(6)]
    arriving = [rng.integers(0, 256, n).tolist() for n in (3, 17, 9, 60, 30, 1, 12)]

    def serve(fold: bool):
        if not fold:
            monkeypatch.setattr(runner_mod, "MIX_MIN_BATCH", 1 << 30)
        eng = Engine(model, max_batch=8, num_pages=96, page_size=8, max_seq_len=96)
        eng.warmup()
        traces = dict(engine_steps.TRACES)
        folded, real = [], eng.runner.decode

        def counted(rows, logprobs, batch=None, folded_=(), fold_rows=None, **kw):
            folded.extend(c.req.rid for c in kw.get("folded", folded_))
            return real(rows, logprobs, batch, **kw)

        monkeypatch.setattr(eng.runner, "decode", counted)
        ids, out = arrive(eng, running, arriving, 40)
        pool = [np.asarray(x)[:-1] for x in (*eng.runner.k, *eng.runner.v)]
        assert dict(engine_steps.TRACES) == traces
        monkeypatch.undo()
        return [out[r] for r in ids], folded, pool

    got, folded, pool = serve(fold=True)
    plain, none, pool0 = serve(fold=False)
    assert none == [] and set(range(6)) < set(folded)  # every running prompt, some arriving
    assert 6 + 3 not in folded  # the 60-token prompt: more than the step's free rows
    want = [
        generate(model, [p], max_new_tokens=len(o)).tokens[0]
        for p, o in zip(running + arriving, got, strict=True)
    ]
    assert got == plain == want
    for a, b in zip(pool, pool0, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [None, 2])
def test_prompt_lookup_folds_chunks_into_its_steps(model, monkeypatch, k):
    """With prompt lookup, chunks ride in the plain steps (k = 0 chosen where verifying costs
    too much; or no running row has a match) and in the ragged verifications, as rows after the
    draft rows; outputs equal ``generate`` alone, and nothing compiles after the warm-up."""
    steep = drafts.StepCosts(tuple(1.0 + t for t in range(drafts.MAX_K + 1)))
    monkeypatch.setattr(drafts, "measure_step_costs", lambda *a, **kw: steep.target)
    rng = np.random.default_rng(8)
    running = [rng.integers(0, 256, 4).tolist() * 3 for _ in range(6)]  # repeats: matches
    arriving = [rng.integers(0, 256, n).tolist() for n in (3, 17, 9, 30, 1, 12)]
    eng = Engine(
        model,
        max_batch=8,
        num_pages=96,
        page_size=8,
        max_seq_len=96,
        draft=PromptLookup(),
        num_draft_tokens=k,
    )
    assert eng.num_draft_tokens == (0 if k is None else k)
    eng.warmup()
    traces = dict(engine_steps.TRACES)
    assert eng.runner.ragged  # its verifications: verify_ragged
    steps, decode, verify = [], eng.runner.decode, eng.runner.verify_ragged

    def decoded(rows, logprobs, batch=None, **kw):
        steps.append(("plain", [c.req.rid for c in kw.get("folded", ())]))
        return decode(rows, logprobs, batch, **kw)

    def verified(rows, drafts, logprobs, **kw):
        steps.append(("verify", [c.req.rid for c in kw.get("folded", ())]))
        return verify(rows, drafts, logprobs, **kw)

    monkeypatch.setattr(eng.runner, "decode", decoded)
    monkeypatch.setattr(eng.runner, "verify_ragged", verified)
    ids, out = arrive(eng, running, arriving, 30)
    assert dict(engine_steps.TRACES) == traces
    folded = [rid for kind, rids in steps if kind == "plain" for rid in rids]
    assert folded  # some prompt rode in a plain step
    if k is None:
        assert all(kind == "plain" for kind, _ in steps)
    else:
        assert any(kind == "verify" and rids for kind, rids in steps)  # a prompt rode in one
    got = [out[r] for r in ids]
    want = [
        generate(model, [p], max_new_tokens=len(o)).tokens[0]
        for p, o in zip(running + arriving, got, strict=True)
    ]
    assert got == want


def test_prefill_pieces():
    """A long chunk whose bucket pads it by more than SPLIT_PADDING tokens runs as pieces."""
    assert runner_mod.prefill_pieces(130) == [128, 2]
    assert runner_mod.prefill_pieces(99) == [64, 35]
    assert runner_mod.prefill_pieces(200) == [128, 64, 8]
    assert runner_mod.prefill_pieces(250) == [250]  # 6 padded tokens: one call
    assert runner_mod.prefill_pieces(64) == [64]
    assert runner_mod.prefill_pieces(5) == [5]
    for n in range(1, 600):
        pieces = runner_mod.prefill_pieces(n)
        assert sum(pieces) == n and all(p > 0 for p in pieces)
        assert all(runner_mod.chunk_bucket(p) == p for p in pieces[:-1])  # unpadded but the last


def test_long_chunks_run_as_pieces(model, monkeypatch):
    """Prompts of 131 and 100 tokens prefill as 128 + 2 and 64 + 35 tokens, in order, to the
    same outputs as ``generate`` and keys within float32 rounding (three layers) of one padded
    call each."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 256, n).tolist() for n in (131, 100)]
    monkeypatch.setattr(runner_mod, "MIX_MIN_BATCH", 1 << 30)

    def run(split: bool):
        if not split:
            monkeypatch.setattr(runner_mod, "SPLIT_PADDING", 1 << 30)
        eng = Engine(model, max_batch=2, num_pages=64, page_size=8, max_seq_len=160)
        calls = []
        real = eng.runner.prefill

        def counted(chunks, C, replay=False):
            calls.append([(c.req.rid, c.start, c.stop, C) for c in chunks])
            return real(chunks, C, replay)

        monkeypatch.setattr(eng.runner, "prefill", counted)
        ids = [eng.submit(p, MAX_NEW) for p in prompts]
        eng.step()
        pool = [np.asarray(x) for x in (*eng.runner.k, *eng.runner.v)]
        out = eng.run_until_done()
        monkeypatch.undo()
        monkeypatch.setattr(runner_mod, "MIX_MIN_BATCH", 1 << 30)
        return [out[r] for r in ids], calls, pool, ids

    got, calls, pool, ids = run(split=True)
    a, b = ids
    assert sorted(c for call in calls for c in call) == [
        (a, 0, 128, 128),
        (a, 128, 130, 8),
        (b, 0, 64, 64),
        (b, 64, 99, 40),
    ]
    order = [c[:2] for call in calls for c in call]  # a request's pieces in order
    assert order.index((a, 0)) < order.index((a, 128)) and order.index((b, 0)) < order.index(
        (b, 64)
    )
    whole, calls1, pool1, _ = run(split=False)
    assert sorted(c[3] for call in calls1 for c in call) == [128, 256]
    want = [generate(model, [p], max_new_tokens=MAX_NEW).tokens[0] for p in prompts]
    assert got == whole == want
    for x, y in zip(pool, pool1, strict=True):
        np.testing.assert_allclose(x[:-1], y[:-1], rtol=1e-4, atol=2e-4)  # float32 reassociation
