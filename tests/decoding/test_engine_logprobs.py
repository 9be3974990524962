"""Log-probabilities from the engine (``Engine.submit(logprobs=n)``, ``pop_logprobs``): equal to
``log_softmax`` of a full forward pass over the same tokens (greedy: the raw distribution, the
token its most likely one; sampled: raw, or the tempered and filtered distribution in
``"processed"`` mode), for plain and speculative rows, with preemption; only requests that ask
get records; no recompiles as they come and go; bad values refused at submit.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import test_engine
from conftest import random_transformer
from flax import nnx

from decoding import PromptLookup, engine_steps
from decoding.engine import Engine
from decoding.sampling import MAX_LOGPROBS, SamplingConfig, TokenLogprob

MAX_SEQ = test_engine.MAX_SEQ
MAX_NEW = 10
# One pool size for every engine here (one compiled shape), small enough that the preemption
# test's requests do not all fit.
POOL = 12
TOL = 1e-5

_rng = np.random.default_rng(7)
PROMPTS = [_rng.integers(0, 256, n).tolist() for n in (5, 19, 12, 30)]


def make_engine(model, **kwargs) -> Engine:
    """``test_engine``'s engine (batch 4, pages of 8, chunks of 32, max_seq_len 64), pool POOL."""
    return test_engine.make_engine(model, num_pages=POOL, **kwargs)


@pytest.fixture(scope="module")
def model():
    """Small weights (as the speculative tests): logits of a size whose float32 rounding between
    the engine's paged steps and a full forward pass stays far below the tolerance."""
    return random_transformer(0, scale=0.1)


@jax.jit
def _forward(graphdef, params, tokens):
    return nnx.merge(graphdef, params)(tokens)


def forward_logits(model, prompt, out) -> np.ndarray:
    """Float32 logits [len(out), V] at the positions that predicted ``out``: a full causal
    forward pass (no cache) over prompt + out, right-padded to ``MAX_SEQ`` (one compilation;
    the padding comes after every position read)."""
    seq = np.zeros((1, MAX_SEQ), np.int32)
    seq[0, : len(prompt) + len(out)] = prompt + out
    graphdef, params = nnx.split(model)
    logits = np.asarray(_forward(graphdef, params, seq)[0], np.float32)
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(out)]


def check_records(records, out, ref_logprobs, n, *, greedy):
    """``records`` of the tokens ``out`` against reference log-probabilities [len(out), V]."""
    assert [r.token for r in records] == out
    for rec, ref in zip(records, ref_logprobs, strict=True):
        assert isinstance(rec, TokenLogprob) and len(rec.top) == n
        assert abs(rec.logprob - ref[rec.token]) < TOL
        ids = [i for i, _ in rec.top]
        want = np.argsort(-ref, kind="stable")[:n]
        assert ids == want.tolist()
        np.testing.assert_allclose([lp for _, lp in rec.top], ref[want], atol=TOL)
        assert np.sum(np.exp([lp for _, lp in rec.top])) <= 1 + 1e-5
        if greedy and n:  # greedy picks the most likely token: it heads the list
            assert ids[0] == rec.token and rec.top[0][1] == rec.logprob


def test_greedy_logprobs_equal_forward_pass(model):
    eng = make_engine(model)
    asks = [3, None, 0, MAX_LOGPROBS]
    ids = [eng.submit(p, MAX_NEW, logprobs=n) for p, n in zip(PROMPTS, asks, strict=True)]
    streamed = {}
    while eng.busy:
        events = eng.step()
        popped = eng.pop_logprobs()
        for rid, records in popped.items():  # the records of exactly the tokens just returned
            assert [r.token for r in records] == events[rid]
            streamed.setdefault(rid, []).extend(records)
    out = eng.pop_finished()
    plain = [eng.submit(p, MAX_NEW) for p in PROMPTS]
    again = eng.run_until_done()
    assert [out[r] for r in ids] == [again[r] for r in plain]  # asking changes no token
    assert set(streamed) == {ids[0], ids[2], ids[3]}  # only those that asked
    for rid, p, n in zip(ids, PROMPTS, asks, strict=True):
        if n is not None:
            ref = jax.nn.log_softmax(forward_logits(model, p, out[rid]), axis=-1)
            check_records(streamed[rid], out[rid], np.asarray(ref), n, greedy=True)
    assert eng.pop_logprobs() == {}  # each handed out once


def test_sampled_raw_and_processed(model):
    """Raw mode reports the model's distribution whatever the settings; processed mode the
    tempered top-k one the token was drawn from (5 survivors: their mass is 1, the rest -inf)."""
    cfg = SamplingConfig(temperature=0.7, top_k=5)
    for mode in ("raw", "processed"):
        eng = make_engine(model, logprobs_mode=mode)
        ids = [eng.submit(p, MAX_NEW, sampling=cfg, seed=11, logprobs=8) for p in PROMPTS[:2]]
        out = eng.run_until_done()
        records = eng.pop_logprobs()
        for rid, p in zip(ids, PROMPTS[:2], strict=True):
            logits = forward_logits(model, p, out[rid])
            if mode == "raw":
                ref = jax.nn.log_softmax(logits, axis=-1)
            else:
                x = logits / cfg.temperature
                kth = np.sort(x, axis=-1)[:, -cfg.top_k][:, None]
                ref = jax.nn.log_softmax(np.where(x >= kth, x, -np.inf), axis=-1)
            ref = np.asarray(ref)
            recs = records[rid]
            assert [r.token for r in recs] == out[rid]
            for rec, row in zip(recs, ref, strict=True):
                assert abs(rec.logprob - row[rec.token]) < TOL
                top = np.array([lp for _, lp in rec.top])
                np.testing.assert_allclose(top[:5], np.sort(row)[::-1][:5], atol=TOL)
                if mode == "processed":
                    assert abs(np.exp(top[:5]).sum() - 1) < 1e-5 and np.all(top[5:] == -np.inf)
                else:
                    assert np.isfinite(top).all() and np.exp(top).sum() < 1


def test_speculative_rows_report_target_logprobs(model):
    """Accepted draft tokens and the token after them: the target's log-probabilities at their
    positions (greedy and sampled-processed), and the same tokens as plain decoding."""
    rng = np.random.default_rng(3)
    base = rng.integers(0, 256, 9).tolist()
    plain = make_engine(model)  # the plain steps, compiled already: the greedy continuation
    rid = plain.submit(base, 12)
    cont = plain.run_until_done()[rid]
    prompts = [base + cont + base + cont[:2], PROMPTS[1]]  # repeats: drafts get accepted
    cfg = SamplingConfig(temperature=0.8)
    eng = make_engine(model, draft=PromptLookup(), num_draft_tokens=3, logprobs_mode="processed")
    greedy = [eng.submit(p, 12, logprobs=2) for p in prompts]
    sampled = eng.submit(prompts[0], 12, sampling=cfg, seed=5, logprobs=2)
    out = eng.run_until_done()
    records = eng.pop_logprobs()
    assert eng.stats()["draft_accepted"] > 0
    for rid, p in zip(greedy, prompts, strict=True):
        # Greedy: each token is the forward pass's most likely (check_records), as plain decoding.
        ref = np.asarray(jax.nn.log_softmax(forward_logits(model, p, out[rid]), axis=-1))
        check_records(records[rid], out[rid], ref, 2, greedy=True)
    x = forward_logits(model, prompts[0], out[sampled]) / cfg.temperature
    ref = np.asarray(jax.nn.log_softmax(x, axis=-1))
    check_records(records[sampled], out[sampled], ref, 2, greedy=False)


def test_preemption_keeps_records_and_no_recompiles(model):
    """A pool too small for every request: preempted requests are recomputed, their records
    are those of their tokens, one per token; asking or not never retraces the steps."""
    eng = make_engine(model)
    eng.warmup()  # every step shape traced once
    before = dict(engine_steps.TRACES)
    ids = [eng.submit(p, 24, logprobs=1 if i % 2 else None) for i, p in enumerate(PROMPTS)]
    out = eng.run_until_done()
    records = eng.pop_logprobs()
    assert eng.stats()["preemptions"] > 0
    assert set(records) == {ids[1], ids[3]}
    for rid in (ids[1], ids[3]):
        p = PROMPTS[ids.index(rid)]
        ref = np.asarray(jax.nn.log_softmax(forward_logits(model, p, out[rid]), axis=-1))
        check_records(records[rid], out[rid], ref, 1, greedy=True)
    assert dict(engine_steps.TRACES) == before


def test_abort_drops_records(model):
    eng = make_engine(model)
    rid = eng.submit(PROMPTS[0], MAX_NEW, logprobs=2)
    while not eng.step():
        pass
    eng.abort(rid)
    eng.run_until_done()
    assert eng.pop_logprobs() == {}


@pytest.mark.parametrize(
    "value, error",
    [(-1, ValueError), (MAX_LOGPROBS + 1, ValueError), (True, TypeError), (1.5, TypeError)],
)
def test_bad_logprobs_refused(model, value, error):
    eng = make_engine(model)
    with pytest.raises(error, match="logprobs"):
        eng.submit(PROMPTS[0], 2, logprobs=value)
    assert not eng.busy


def test_bad_logprobs_mode_refused(model):
    with pytest.raises(ValueError, match="logprobs_mode"):
        make_engine(model, logprobs_mode="logits")
