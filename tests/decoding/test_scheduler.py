"""decoding.scheduler alone, no model: the step plans it makes and what they do to its requests.

A fake device (``FakePool``) runs each plan the way the engine's runner does (page copies first,
then the prefill chunks, then the decode rows) on a pool whose slots hold, instead of keys and
values, the token prefix a position's key was computed from. Every read checks that the slot
holds the right prefix and every write that its page is private, so a plan that copied too late,
wrote a shared or cached page, or kept a preempted request's work in it fails here. The sampled
tokens are a fixed function of (request, index), so outputs are known whatever the schedule.
"""

from __future__ import annotations

import collections
import random

import pytest

from decoding.paging import pages_for
from decoding.sampling import SamplingConfig
from decoding.scheduler import Request, Scheduler, StepPlan

P = 4  # positions per page


def token(rid: int, i: int) -> int:
    """The i-th new token of request rid (what every run of it samples)."""
    return 100 + (7 * rid + 3 * i) % 50


def expected(rid: int, max_new: int) -> list[int]:
    return [token(rid, i) for i in range(max_new)]


def make(num_pages=16, max_batch=3, max_prefill=8, prefix=True, replay=0) -> Scheduler:
    return Scheduler(
        max_batch=max_batch,
        num_pages=num_pages,
        page_size=P,
        max_pages=8,
        prefix_caching=prefix,
        max_prefill_tokens=max_prefill,
        replay_tokens=replay,
    )


def request(rid: int, prompt, max_new: int) -> Request:
    return Request(rid, len(prompt), max_new, SamplingConfig(), None, rid, list(prompt))


class FakePool:
    """Slots [page][offset] holding the token prefix whose key is there (None: never written)."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.slots = collections.defaultdict(lambda: [None] * P)

    def read(self, req: Request, pages, stop: int) -> None:
        for q in range(stop):
            got = self.slots[pages[q // P]][q % P]
            assert got == tuple(req.tokens[: q + 1]), (req.rid, q)

    def write(self, req: Request, pages, pos: int, prefix) -> None:
        page = pages[pos // P]
        alloc = self.sched.allocator
        assert alloc.refcount(page) == 1 and not alloc.is_cached(page), (req.rid, pos, page)
        self.slots[page][pos % P] = prefix

    def run(self, plan: StepPlan, accept=None) -> list[list[int]]:
        """Runs ``plan``; ``accept(req)``: drafts a verifying row accepts (default none)."""
        dsts = [d for _, d in plan.copies]
        assert len(set(dsts)) == len(dsts)
        for i, (src, _) in enumerate(plan.copies):
            assert src not in dsts[:i]  # read before anything in the plan writes it
        rows = {p for r in self.sched.running for p in self.sched.tables.rows[r.row]}
        assert set(dsts) <= rows  # a copy for a request that left the plan is not in it
        before = {src: list(self.slots[src]) for src, _ in plan.copies}
        for src, dst in plan.copies:
            self.slots[dst] = list(before[src])
        running = set(self.sched.running)
        for c in plan.prefill:
            assert c.req in running and c.stop > c.start
            assert len(c.pages) == pages_for(c.stop, P)
            if c.replay:  # the rings: read the pool, write nothing to it
                self.read(c.req, c.pages, c.stop)
                continue
            self.read(c.req, c.pages, c.start)
            for pos in range(c.start, c.stop):
                self.write(c.req, c.pages, pos, tuple(c.req.tokens[: pos + 1]))
        assert len({r.req.row for r in plan.decode}) == len(plan.decode)
        out = []
        for row in plan.decode:
            req, pos = row.req, row.req.computed
            assert (
                req in running
                and req.decoding
                and row.pages == tuple(self.sched.tables.rows[req.row])
            )
            self.read(req, row.pages, pos)
            self.write(req, row.pages, pos, tuple(req.tokens))
            n_new = len(req.tokens) - req.prompt_len
            left = req.prompt_len + req.max_new - 1 - pos  # positions it may still cache
            drafts = min(accept(req) if accept else 0, plan.ahead - 1, max(left - 1, 0))
            sampled = [token(req.rid, n_new + j) for j in range(drafts + 1)]
            seq = list(req.tokens)
            for j in range(drafts):  # an accepted draft's key is the right one
                seq.append(sampled[j])
                self.write(req, row.pages, pos + 1 + j, tuple(seq))
            out.append(sampled)
        return out


def step(sched, pool, ahead=1, accept=None):
    plan = sched.schedule(ahead)
    return plan, sched.postprocess(plan, pool.run(plan, accept))


def run_all(sched, pool, ahead=1, accept=None, limit=500) -> None:
    for _ in range(limit):
        if not (sched.waiting or sched.running):
            return
        step(sched, pool, ahead, accept)
    raise AssertionError(f"not done after {limit} steps")


def assert_released(sched) -> None:
    a = sched.allocator
    assert all(a.refcount(p) == 0 for p in range(a.num_pages))
    assert a.num_available == a.num_pages


def test_chunked_prefill_then_decode_in_the_same_step():
    sched, pool = make(max_prefill=8), None
    pool = FakePool(sched)
    sched.add(request(0, range(1, 21), 3))  # 20 tokens: chunks of 8, 8, then 3 (+ decode)
    spans = []
    for _ in range(3):
        plan, emitted = step(sched, pool)
        spans.append([(c.start, c.stop) for c in plan.prefill])
        if len(spans) < 3:
            assert plan.decode == () and emitted == []
    assert spans == [[(0, 8)], [(8, 16)], [(16, 19)]]
    assert [r.req.rid for r in plan.decode] == [0] and emitted == [[token(0, 0)]]
    run_all(sched, pool)
    assert sched.finished == {0: expected(0, 3)}
    assert sched.counts["prefill_tokens"] == 19 and sched.counts["generated_tokens"] == 3
    assert_released(sched)


def test_the_prefill_budget_is_per_step_and_chunks_do_not_depend_on_the_batch():
    sched = make(max_prefill=8)
    pool = FakePool(sched)
    sched.add(request(0, range(1, 7), 2))  # 5 to prefill
    sched.add(request(1, range(50, 60), 2))  # 9 to prefill: chunks of 8 then 1, never 3 + 6
    plan, _ = step(sched, pool)
    assert [(c.req.rid, c.start, c.stop) for c in plan.prefill] == [(0, 0, 5)]
    plan, _ = step(sched, pool)
    assert [(c.req.rid, c.start, c.stop) for c in plan.prefill] == [(1, 0, 8)]
    plan, _ = step(sched, pool)
    assert [(c.req.rid, c.start, c.stop) for c in plan.prefill] == [(1, 8, 9)]
    run_all(sched, pool)
    assert sched.finished == {0: expected(0, 2), 1: expected(1, 2)}


def test_admission_with_prefix_hits_shares_pages_and_copies_on_write():
    sched = make()
    pool = FakePool(sched)
    shared = list(range(1, 9))  # two full pages
    sched.add(request(0, shared + [20, 21, 22], 6))
    sched.add(request(1, shared + [30], 4))  # waits: request 0 is computing its pages
    plan, _ = step(sched, pool)
    assert [r.rid for r in plan.admitted] == [0] and [r.rid for r in sched.waiting] == [1]
    plan, _ = step(sched, pool)
    (b,) = plan.admitted
    assert b.rid == 1 and sched.counts["prefix_cache_hits"] == 2
    a_pages = sched.tables.rows[sched.live[0].row]
    assert sched.tables.rows[b.row][:2] == a_pages[:2]  # shared by reference
    assert [(c.req.rid, c.start, c.stop) for c in plan.prefill] == [(0, 8, 10)]  # not 1's
    assert [r.req.rid for r in plan.decode] == [0, 1]  # 1: 8 positions cached, its last fed
    sched.add(request(2, shared, 3))  # exactly the cached pages: its last token's write copies
    plan, _ = step(sched, pool)
    (c,) = plan.admitted
    assert c.rid == 2 and len(plan.copies) == 1 and plan.copies[0][0] == a_pages[1]
    assert sched.tables.rows[c.row][1] == plan.copies[0][1] != a_pages[1]
    run_all(sched, pool)
    assert sched.finished == {0: expected(0, 6), 1: expected(1, 4), 2: expected(2, 3)}
    assert sched.counts["prefix_cache_hits"] == 4
    assert_released(sched)


def test_decoding_rows_grow_a_page_at_a_boundary_and_ahead_positions():
    sched = make()
    pool = FakePool(sched)
    sched.add(request(0, [1, 2, 3], 9))
    plan, _ = step(sched, pool)  # prefill [0, 2), decode position 2
    assert len(plan.decode[0].pages) == 1
    plan, _ = step(sched, pool)  # position 3: still page 0
    assert len(plan.decode[0].pages) == 1
    plan, _ = step(sched, pool)  # position 4: a second page
    assert len(plan.decode[0].pages) == 2
    plan, _ = step(sched, pool, ahead=5)  # positions 5..9: a third page
    assert len(plan.decode[0].pages) == 3 and plan.ahead == 5
    run_all(sched, pool, ahead=5, accept=lambda r: 4)
    assert sched.finished == {0: expected(0, 9)}
    assert_released(sched)


def test_a_verification_never_asks_pages_past_the_last_cached_position():
    sched = make(num_pages=2)  # 8 positions: prompt 3 + max_new 6 caches positions 0..7
    pool = FakePool(sched)
    sched.add(request(0, [1, 2, 3], 6))
    run_all(sched, pool, ahead=8, accept=lambda r: 7)
    assert sched.finished == {0: expected(0, 6)} and sched.counts["preemptions"] == 0


def test_preemption_when_out_of_pages_drops_the_newest_request_from_the_plan():
    sched = make(num_pages=5, max_batch=2)
    pool = FakePool(sched)
    sched.add(request(0, range(1, 8), 10))  # 7 tokens: 2 pages, grows to 4
    sched.add(request(1, range(20, 27), 10))  # the same: the two cannot both finish
    preempted = []
    for _ in range(200):
        if not (sched.waiting or sched.running):
            break
        plan, _ = step(sched, pool)
        for req in plan.preempted:
            assert req.row == -1 and req.computed == 0 and sched.waiting[0] is req
            assert req not in {r.req for r in plan.decode} | {c.req for c in plan.prefill}
            assert req not in plan.admitted
            preempted.append(req.rid)
    assert preempted and set(preempted) == {1}  # always the most recently admitted
    assert sched.counts["preemptions"] == len(preempted)
    assert sched.finished == {0: expected(0, 10), 1: expected(1, 10)}
    assert_released(sched)


def test_a_request_preempted_in_the_plan_that_admitted_it_leaves_nothing_in_it():
    """Admitted with a prefill chunk, then preempted by an older row's growth in the same
    plan: its pages may serve that row now, so its chunk must not run."""
    sched = make(num_pages=4, max_batch=2)
    pool = FakePool(sched)
    sched.add(request(0, range(11, 17), 10))  # at most 4 pages
    step(sched, pool, ahead=3)  # 2 pages, 6 positions cached
    sched.add(request(1, [21, 22, 23, 24], 5))
    plan = sched.schedule(3)
    (victim,) = plan.preempted
    assert victim.rid == 1 and plan.admitted == () and [r.req.rid for r in plan.decode] == [0]
    assert plan.prefill == () and plan.copies == ()
    sched.postprocess(plan, pool.run(plan))
    run_all(sched, pool, ahead=3, accept=lambda r: 1)
    assert sched.finished == {0: expected(0, 10), 1: expected(1, 5)}
    assert_released(sched)


def test_abort_frees_pages_at_once_and_the_next_plan_reports_it():
    sched = make(max_batch=2)
    pool = FakePool(sched)
    sched.add(request(0, range(1, 10), 8))  # prefilled in step 1, decodes in it too
    sched.add(request(1, range(20, 29), 8))
    sched.add(request(2, [5], 8))  # no row: waits
    step(sched, pool)
    free, held = sched.allocator.num_available, len(sched.tables.rows[sched.live[0].row])
    assert sched.abort(0) == [token(0, 0)]
    assert sched.allocator.num_available == free + held  # released (its full pages cached)
    assert sched.abort(2) == [] and not sched.waiting
    plan, _ = step(sched, pool)
    assert plan.aborted == (0, 2) and [c.req.rid for c in plan.prefill] == [1]
    assert step(sched, pool)[0].aborted == ()  # reported once
    with pytest.raises(KeyError, match="no request with id 0"):
        sched.abort(0)
    run_all(sched, pool)
    assert sched.finished == {1: expected(1, 8)}
    assert_released(sched)


def test_retire_on_eos_and_on_max_new():
    sched = make()
    pool = FakePool(sched)
    eos = token(0, 2)
    req = request(0, [1, 2], 8)
    req.eos_id = eos
    sched.add(req)
    sched.add(request(1, [3], 2))
    run_all(sched, pool)
    assert sched.finished == {0: expected(0, 3), 1: expected(1, 2)}
    assert sched.counts["finished"] == 2 and not sched.live
    assert_released(sched)


def test_postprocess_rejects_the_wrong_number_of_rows():
    sched = make()
    sched.add(request(0, [1], 2))
    plan = sched.schedule()
    with pytest.raises(ValueError, match="1 decode rows"):
        sched.postprocess(plan, [])


def test_ring_replay_chunks_come_before_the_prefill_and_write_nothing():
    sched = make(replay=5)
    pool = FakePool(sched)
    shared = list(range(1, 9))
    sched.add(request(0, shared + [9], 2))
    run_all(sched, pool)
    sched.add(request(1, shared + [40, 41], 2))
    plan, _ = step(sched, pool)
    spans = [(c.start, c.stop, c.replay) for c in plan.prefill]
    assert spans == [(3, 8, True), (8, 9, False)]  # position 9: the first decode's
    run_all(sched, pool)
    assert sched.finished[1] == expected(1, 2) and sched.counts["replay_tokens"] == 5


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_keeps_every_plan_consistent(seed):
    """Arrivals, shared prefixes, aborts, speculation and a pool too small for all: every read
    finds its prefix, every write a private page, every result its tokens, no page leaks."""
    rng = random.Random(seed)
    sched = make(num_pages=rng.choice([6, 9, 14]), max_batch=3, max_prefill=rng.choice([4, 8]))
    pool = FakePool(sched)
    ahead = rng.choice([1, 3])
    stems = [[rng.randrange(1, 99) for _ in range(rng.choice([4, 8]))] for _ in range(2)]
    want, aborted, rid = {}, set(), 0
    for _ in range(300):
        if rid < 12 and rng.random() < 0.3:
            prompt = rng.choice(stems)[: rng.randrange(1, 9)] + [rng.randrange(1, 99)]
            n = rng.randrange(1, 8)
            sched.add(request(rid, prompt, n))
            want[rid], rid = expected(rid, n), rid + 1
        if sched.live and rng.random() < 0.05:
            victim = rng.choice(sorted(sched.live))
            sched.abort(victim)
            aborted.add(victim)
        if rid >= 12 and not (sched.waiting or sched.running):
            break
        step(sched, pool, ahead, accept=lambda r: rng.randrange(ahead))
    else:
        raise AssertionError("traffic did not drain")
    assert sched.finished == {r: w for r, w in want.items() if r not in aborted}
    assert_released(sched)
