"""Prompt lookup in the engine verifies ragged drafts (``Runner.verify_ragged``): each row its
own host-made draft (``drafts.lookup_draft``), a row of one token per draft token, so a row
without a match costs one row; the acceptance rule on per-row draft lengths stays exact; with k
chosen each row's draft length follows its own acceptance."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_transformer

from decoding import PromptLookup, drafts
from decoding.acceptance import accept
from decoding.engine import Engine
from decoding.generate import generate
from decoding.runner import MIN_CHUNK, draft_bucket
from decoding.sampling import SamplingConfig
from decoding.scheduler import DecodeRow, Request
from models.linear import DECODE_MAX_ROWS


def test_lookup_draft_is_the_jitted_lookups_proposal_without_filler():
    rng = np.random.default_rng(4)
    rows = [rng.integers(0, 6, n).tolist() for n in (2, 5, 9, 17, 30)]
    rows += [[3], [1, 2, 3, 1, 2], [7, 8, 9, 7, 8], list(range(12))]
    L = max(len(r) for r in rows)
    seq = np.zeros((len(rows), L), np.int32)
    for i, r in enumerate(rows):
        seq[i, : len(r)] = r
    lengths = jnp.asarray([len(r) for r in rows], jnp.int32)
    for lo, hi in ((1, 3), (2, 2), (1, 1)):
        for k in (1, 3, 6):
            found, want = drafts.lookup(jnp.asarray(seq), lengths, k, lo, hi, return_found=True)
            for r, f, w in zip(rows, np.asarray(found), np.asarray(want), strict=True):
                got = drafts.lookup_draft(r, lo, hi, k)
                assert bool(got) == bool(f) == drafts.lookup_found(r, lo, hi)
                assert got == w[: len(got)].tolist()
                if len(got) < k:  # cut short only by the end of the known text
                    assert got == r[len(r) - len(got) :]
    assert drafts.lookup_draft([1, 2, 3, 1, 2], 1, 3, 8) == [3, 1, 2]  # ends with the text
    assert drafts.lookup_draft([1, 2, 3, 4], 1, 3, 8) == []
    assert drafts.lookup_draft([1, 2, 3, 1, 2], 1, 3, 0) == []


def test_ngram_index_drafts_what_lookup_draft_does_as_the_tokens_grow():
    """The engine's incremental index (``drafts.NgramIndex``, kept with each request) proposes
    ``lookup_draft``'s draft after every appended token, for every n-gram range and k; a list
    that did not grow from the indexed one (a shorter one, another token where it ended) is
    indexed anew."""
    rng = np.random.default_rng(5)
    for lo, hi in ((1, 3), (2, 2), (1, 1), (2, 4)):
        for vocab in (2, 5, 40):
            index, tokens = drafts.NgramIndex(lo, hi), []
            for _ in range(70):
                tokens.append(int(rng.integers(0, vocab)))
                k = int(rng.integers(0, 7))
                assert index.draft(tokens, k) == drafts.lookup_draft(tokens, lo, hi, k)
            for other in (tokens[:40], tokens[:-1] + [vocab], tokens + [vocab] * 3):
                assert index.draft(other, 4) == drafts.lookup_draft(other, lo, hi, 4)


@pytest.mark.parametrize("length", [0, 1, 2])
def test_accept_on_a_shorter_draft_is_the_rule_on_that_draft(length):
    """``accept(..., lengths)`` with one-hot q (a copied draft): the first token is
    distributed as p_0; a draft token is kept with probability p(d) while within the row's
    length and never past it; after keeping all ``length`` of them the next token is drawn
    from p at ``length``."""
    V, K, N = 5, 3, 40_000
    rng = np.random.default_rng(length)
    p = jnp.asarray(rng.dirichlet(np.ones(V), K + 1), jnp.float32)  # [K + 1, V]
    d = jnp.argmax(p[:K], axis=-1).astype(jnp.int32)  # likely tokens, also padding
    q = jax.nn.one_hot(d, V)

    def one(key):
        n, nxt = accept(p[None], q[None], d[None], key, jnp.asarray([length]))
        return n[0], nxt[0]

    n, nxt = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(0), N))
    n, nxt, p, d = np.asarray(n), np.asarray(nxt), np.asarray(p), np.asarray(d)
    assert n.max() <= length

    def close(freq, prob, count):
        assert abs(freq - prob) < 5 * np.sqrt(prob * (1 - prob) / count) + 2e-3

    first = np.where(n > 0, d[0], nxt)
    for x in range(V):
        close(np.mean(first == x), p[0, x], N)
    if length:
        close(np.mean(n >= 1), p[0, d[0]], N)
        full = n == length
        expect = p[length]
        for x in range(V):
            close(np.mean(nxt[full] == x), expect[x], full.sum())


@pytest.fixture(scope="module")
def model():
    return random_transformer(0, scale=0.1)


def test_rows_verify_only_their_own_drafts(model):
    """A row that repeats itself drafts and one that does not verifies nothing in the same
    step; a step's rows are its decode batch plus its drafts' tokens (padded to a bucket); no
    draft runs past what its request may still emit; greedy output is ``generate``'s."""
    rng = np.random.default_rng(2)
    p = rng.integers(0, 256, 10).tolist()
    cont = generate(model, [p], max_new_tokens=16).tokens[0]
    prompts = [p + cont + p + cont[:2], rng.integers(0, 256, 23).tolist(), p + cont + p]
    news = [12, 12, 3]
    eng = Engine(
        model,
        max_batch=4,
        num_pages=64,
        page_size=8,
        max_prefill_tokens=64,
        max_seq_len=128,
        draft=PromptLookup(),
        num_draft_tokens=4,
    )
    assert eng.runner.ragged
    steps, real = [], eng.runner.verify_ragged

    def recorded(rows, drafts_, logprobs, **kw):
        left = [r.req.prompt_len + r.req.max_new - len(r.req.tokens) - 1 for r in rows]
        out = real(rows, drafts_, logprobs, **kw)
        steps.append(([len(d) for d in drafts_], left, out.proposed))
        return out

    eng.runner.verify_ragged = recorded
    ids = [eng.submit(q, n) for q, n in zip(prompts, news, strict=True)]
    out = eng.run_until_done()
    for rid, q, n in zip(ids, prompts, news, strict=True):
        assert out[rid] == generate(model, [q], max_new_tokens=n).tokens[0]
    assert steps
    assert any(0 in lens and max(lens) > 0 for lens, _, _ in steps)  # ragged in one step
    for lens, left, proposed in steps:
        assert lens == proposed
        assert all(n <= min(4, m) for n, m in zip(lens, left, strict=True))
    s = eng.stats()
    assert s["draft_proposed"] == sum(sum(lens) for lens, _, _ in steps)
    assert 0 < s["draft_accepted"] <= s["draft_proposed"]


def test_a_step_has_the_batch_and_its_drafts_rows(model, monkeypatch):
    """``verify_ragged`` runs B + draft_bucket(drafted tokens, B) rows (1, 2, 4, then
    multiples of 8, but no more than fill the batch's rows to a multiple of 8); with packed
    weights the drafts are cut (longest first) to the products' rows left."""
    eng = Engine(model, max_batch=2, num_pages=32, page_size=8, draft=PromptLookup())
    shapes = []

    def fn(*args):
        last, drafted = args[4], args[-1]
        shapes.append((last.shape[0], drafted[0].shape[0]))
        raise RuntimeError("stop")

    monkeypatch.setattr(eng.runner, "ragged_fn", fn)
    monkeypatch.setattr(eng.runner, "_call", lambda f, *a: f(*a))
    # drafts of 3 and 6 tokens: a batch of 2 and 14 draft rows (16 in all: two row blocks)
    reqs = [
        Request(i, 20, 60, SamplingConfig(), None, 0, list(range(21)), computed=20, row=i)
        for i in range(2)
    ]
    rows = tuple(DecodeRow(r, (0, 1, 2)) for r in reqs)
    with pytest.raises(RuntimeError, match="stop"):
        eng.runner.verify_ragged(rows, [[1, 2, 3], [4, 5, 6, 7, 8, 9]], frozenset())
    assert shapes == [(2, 14)]
    # 3 rows at a decode batch of 4: the padding row takes the first draft token, the other two
    # one extra row each (draft_bucket(2, 4)); one token fits in the padding row: one extra row
    seen = []
    monkeypatch.setattr(eng.runner, "ragged_fn", lambda *a: seen.append(a) or fn(*a))
    three = tuple(
        DecodeRow(
            Request(i, 20, 60, SamplingConfig(), None, 0, list(range(21)), computed=20, row=i),
            (i, 5),
        )
        for i in range(3)
    )
    for ds, want in (([[7, 8], [9], []], (4, 2)), ([[], [9], []], (4, 1))):
        with pytest.raises(RuntimeError, match="stop"):
            eng.runner.verify_ragged(three, ds, frozenset(), batch=4)
        assert shapes[-1] == want
    (_, _, _, _, last, lengths, table, *_, drafted) = seen[0]
    owner, step, where = drafted[3], drafted[4], drafted[5]
    assert last[3] == 7 and lengths[3] == 21 and list(table[3, :2]) == [0, 5]
    assert (owner[3], step[3], where[0, 0]) == (0, 1, 3)
    assert list(drafted[0]) == [8, 9] and list(drafted[1]) == [22, 21]
    assert list(owner[4:]) == [0, 1] and list(step[4:]) == [2, 1]
    assert (where[0, 1], where[1, 0]) == (4, 5)
    assert [draft_bucket(n, 1) for n in (1, 2, 3, 4, 5, 7, 8, 9)] == [1, 2, 4, 4, 7, 7, 8, 15]
    assert [draft_bucket(n, 8) for n in (1, 3, 5, 8, 9)] == [1, 4, 8, 8, 16]
    assert [draft_bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 64, 65)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        24,
        64,
        128,
    ]
    monkeypatch.setattr(eng.runner, "kernels", {"packed": None})
    room = eng.runner.draft_room(2)
    assert room == (DECODE_MAX_ROWS - 2) // MIN_CHUNK * MIN_CHUNK
    long = [list(range(40)), list(range(30))]
    monkeypatch.setattr(drafts.NgramIndex, "draft", lambda self, t, k: long.pop(0)[:k])
    cut = eng.runner.lookup_drafts(rows, 64)
    assert sum(map(len, cut)) == room and abs(len(cut[0]) - len(cut[1])) <= 1


def test_each_row_drafts_as_far_as_its_own_acceptance_pays(model, monkeypatch):
    """With k chosen (``num_draft_tokens=None``) a row drafts the j tokens whose chance of
    being kept, a^j at its own rate, is at least a row's measured cost against a plain step
    (here 0.25): a request that keeps its drafts gets all k, one that rarely does one
    token, every row none while the k rule chooses 0; outputs stay ``generate``'s."""
    costs = tuple(1.0 + 0.25 * t for t in range(drafts.MAX_K + 1))
    monkeypatch.setattr(drafts, "measure_step_costs", lambda *a, **kw: costs)
    eng = Engine(
        model, max_batch=4, num_pages=64, page_size=8, max_seq_len=128, draft=PromptLookup()
    )
    assert eng._row_threshold == pytest.approx(0.25)
    rng = np.random.default_rng(3)
    prompts = []
    for _ in range(2):  # each repeats itself and its continuation: drafts match
        p = rng.integers(0, 256, 10).tolist()
        cont = generate(model, [p], max_new_tokens=16).tokens[0]
        prompts.append(p + cont + p + cont[:2])
    ids = [eng.submit(q, 10) for q in prompts]
    eng.step()  # prefill: both running
    eng.num_draft_tokens = 3
    eng._row_rate(ids[0]).add(1000, 1000)  # keeps everything
    eng._row_rate(ids[1]).add(300, 1000)  # a = 0.3: 0.3 >= 0.25 > 0.09
    assert eng._row_caps() == {ids[0]: 3, ids[1]: 1}
    seen, real = [], eng.runner.lookup_drafts

    def recorded(rows, k, caps=None):
        out = real(rows, k, caps)
        seen.append(({r.req.rid: len(d) for r, d in zip(rows, out, strict=True)}, dict(caps)))
        return out

    monkeypatch.setattr(eng.runner, "lookup_drafts", recorded)
    monkeypatch.setattr("decoding.engine.RECHOOSE_STEPS", 1 << 30)  # keep k = 3
    for _ in range(6):  # until a row has a match
        if not seen:
            eng.step()
    lengths, caps = seen[0]
    assert caps == {ids[0]: 3, ids[1]: 1}  # each row its own cap, at most k
    assert all(lengths[r] <= caps[r] for r in ids) and max(lengths.values()) > 0
    eng.num_draft_tokens = 0
    assert set(eng._row_caps().values()) == {0}
    out = eng.run_until_done()
    for rid, q in zip(ids, prompts, strict=True):
        assert out[rid] == generate(model, [q], max_new_tokens=10).tokens[0]
    assert eng._row_caps() == {} and not eng._row_rates  # finished requests forgotten
