"""The continuous-batching engine on the tiny model: every request's output equals ``generate`` on
it alone (greedy, and sampled with the same seed) whatever else is batched, with shared prefixes,
preemption, late arrivals; no page leaks, no recompiles, bad requests rejected at submit.

Every engine here has the same shapes (batch 4, pages of 8, chunks of at most 32 tokens, one of
two pool sizes), so the whole module compiles a handful of steps.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import models
from decoding import engine_steps
from decoding.engine import Engine
from decoding.generate import generate
from decoding.sampling import SamplingConfig
from models import rows_matmul

MAX_NEW = 14
PAGE = 8
BIG_POOL, SMALL_POOL = 48, 12
MAX_SEQ = 64  # a block table of 8 pages

_rng = np.random.default_rng(0)
_SHARED = _rng.integers(0, 256, 21).tolist()  # 2 full pages of 8 and a partial one
PROMPTS = [
    _SHARED + _rng.integers(0, 256, 6).tolist(),
    _SHARED + _rng.integers(0, 256, 19).tolist(),
    _SHARED[:16],  # exactly the two shared full pages
    _rng.integers(0, 256, 45).tolist(),  # two chunks of at most 32
    [5],
    _SHARED[:11] + [3, 3, 3],
]
TOP_P = SamplingConfig(temperature=1.0, top_p=0.9)


def make_engine(model, num_pages=BIG_POOL, **kwargs) -> Engine:
    return Engine(
        model,
        max_batch=4,
        num_pages=num_pages,
        page_size=PAGE,
        max_prefill_tokens=32,
        max_seq_len=MAX_SEQ,
        **kwargs,
    )


@pytest.fixture(scope="module")
def greedy_refs(tiny_model):
    """``generate`` on each prompt alone; greedy, so a shorter run is a prefix of it."""
    refs = [generate(tiny_model, [p], max_new_tokens=MAX_NEW).tokens[0] for p in PROMPTS]
    assert len({tuple(r) for r in refs}) == len(refs)  # not degenerate
    return refs


def assert_clean(eng: Engine) -> None:
    """Nothing running or waiting, and every page back in the pool (free or cached)."""
    s = eng.stats()
    assert (s["running"], s["waiting"], s["pages_used"]) == (0, 0, 0)
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"]
    assert all(eng.allocator.refcount(p) == 0 for p in range(s["pages_total"]))


def run_schedule(eng: Engine, schedule):
    """schedule: (arrival step, prompt index, max_new_tokens) -> ({rid: (index, n)}, streamed)."""
    pending = sorted(schedule, key=lambda a: a[0])
    ids, streamed, step = {}, {}, 0
    while pending or eng.busy:
        while pending and pending[0][0] <= step:
            _, i, n = pending.pop(0)
            ids[eng.submit(PROMPTS[i], n)] = (i, n)
        for rid, tokens in eng.step().items():
            streamed.setdefault(rid, []).extend(tokens)
        step += 1
    return ids, streamed


def test_greedy_equals_generate_alone(tiny_model, greedy_refs):
    eng = make_engine(tiny_model)
    ids = [eng.submit(p, MAX_NEW) for p in PROMPTS]
    out = eng.run_until_done()
    assert [out[r] for r in ids] == greedy_refs
    s = eng.stats()
    assert s["decode_steps"] < len(PROMPTS) * MAX_NEW  # rows were batched
    assert s["generated_tokens"] == len(PROMPTS) * MAX_NEW
    assert_clean(eng)


def test_packed_weights_greedy_equals_generate():
    """A model wide enough that its decode steps multiply packed weights on CPU
    (``models.transformer.pack_decode_weights``): the engine's batched steps equal ``generate``."""
    from conftest import random_transformer

    model = random_transformer(seed=3, scale=0.1, dim=256, mlp_dim=512)
    refs = [generate(model, [p], max_new_tokens=12).tokens[0] for p in PROMPTS]
    eng = make_engine(model)
    assert eng.runner.kernels or jax.default_backend() != "cpu" or not rows_matmul.available()
    ids = [eng.submit(p, 12) for p in PROMPTS]
    out = eng.run_until_done()
    assert [out[r] for r in ids] == refs
    assert_clean(eng)


def test_bfloat16_cache_greedy_equals_generate():
    """A float32 model with ``kv_dtype="bfloat16"`` (``models.configure``): the engine's pool
    and ``generate``'s cache are bfloat16, and its greedy rows equal ``generate`` alone."""
    from conftest import random_transformer

    model = models.configure(random_transformer(seed=3, scale=0.1), kv_dtype="bfloat16")
    refs = [generate(model, [p], max_new_tokens=12).tokens[0] for p in PROMPTS]
    eng = make_engine(model)
    assert all(k.dtype == jnp.bfloat16 for k in eng.runner.k + eng.runner.v)
    ids = [eng.submit(p, 12) for p in PROMPTS]
    out = eng.run_until_done()
    assert [out[r] for r in ids] == refs
    assert_clean(eng)


def test_shared_prefix_pages_reused(tiny_model, greedy_refs):
    eng = make_engine(tiny_model)
    first = eng.submit(PROMPTS[0], MAX_NEW)
    eng.step()  # its 27-token prompt is prefilled: pages 0..2 registered
    ids = [first] + [eng.submit(p, MAX_NEW) for p in PROMPTS[1:3]]
    out = eng.run_until_done()
    assert [out[r] for r in ids] == greedy_refs[:3]
    s = eng.stats()
    # Prompt 1 reuses the two shared pages; prompt 2 (exactly those pages) reuses both and copies
    # the last one before feeding its last token (copy on write).
    assert s["prefix_cache_hits"] == 4 and s["page_copies"] == 1
    prompt_tokens = sum(len(p) for p in PROMPTS[:3])
    assert s["prefill_tokens"] == prompt_tokens - 3 - 16 - 15
    assert_clean(eng)


def test_burst_with_a_common_prefix_computes_it_once(tiny_model, greedy_refs):
    """Submitted together: the second request waits one step for the first one's pages."""
    eng = make_engine(tiny_model)
    ids = [eng.submit(p, MAX_NEW) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[4])]
    assert set(eng.step()) == {ids[0]}  # prompt 1 waits for the shared pages, prompt 4 behind it
    assert eng.stats()["waiting"] == 2
    out = eng.run_until_done()
    assert [out[r] for r in ids] == [greedy_refs[0], greedy_refs[1], greedy_refs[4]]
    s = eng.stats()
    assert s["prefix_cache_hits"] == 2 and s["prefill_tokens"] == 26 + 23


def test_cached_pages_survive_reuse_and_finish(tiny_model, greedy_refs):
    """A prompt served twice from the cache (copy on write each time) still gives the same
    tokens: the cached pages were never written."""
    eng = make_engine(tiny_model)
    outs = []
    for _ in range(3):
        rid = eng.submit(PROMPTS[2], MAX_NEW)
        outs.append(eng.run_until_done()[rid])
    assert outs == [greedy_refs[2]] * 3
    assert eng.stats()["page_copies"] == 2
    assert_clean(eng)


def test_preemption_under_a_small_pool(tiny_model, greedy_refs, monkeypatch):
    eng = make_engine(tiny_model, num_pages=SMALL_POOL)
    victims = []
    preempt = eng.scheduler.preempt

    def spy(req):  # the victim is always the most recently admitted running request
        victims.append(req.admitted == max(r.admitted for r in eng.scheduler.running))
        preempt(req)

    monkeypatch.setattr(eng.scheduler, "preempt", spy)
    ids = [eng.submit(p, MAX_NEW) for p in PROMPTS]
    out = eng.run_until_done()
    assert [out[r] for r in ids] == greedy_refs
    s = eng.stats()
    assert s["preemptions"] == len(victims) > 0 and all(victims)
    assert s["evictions"] > 0
    assert_clean(eng)


def test_arrivals_between_steps_stream_every_token(tiny_model, greedy_refs):
    eng = make_engine(tiny_model)
    schedule = [(0, 3, MAX_NEW), (0, 4, 5), (2, 0, 9), (3, 1, MAX_NEW), (7, 5, 1), (9, 2, 4)]
    ids, streamed = run_schedule(eng, schedule)
    out = eng.run_until_done()
    for rid, (i, n) in ids.items():
        assert out[rid] == streamed[rid] == greedy_refs[i][:n]
    assert_clean(eng)


def test_eos_stops_a_request(tiny_model, greedy_refs):
    eng = make_engine(tiny_model)
    eos = greedy_refs[3][4]
    want = greedy_refs[3][: greedy_refs[3].index(eos) + 1]
    rid = eng.submit(PROMPTS[3], MAX_NEW, eos_id=eos)
    other = eng.submit(PROMPTS[0], MAX_NEW)
    out = eng.run_until_done()
    assert out[rid] == want and out[other] == greedy_refs[0]


def test_no_recompiles_as_requests_come_and_go(tiny_model):
    eng = make_engine(tiny_model)
    eng.warmup()  # every step shape
    before = dict(engine_steps.TRACES)
    run_schedule(eng, [(0, 1, 6), (1, 3, 2), (2, 4, 9), (4, 5, 3), (4, 0, 5), (6, 2, 2)])
    assert dict(engine_steps.TRACES) == before
    assert eng.stats()["page_copies"] == 1  # the warm-up's copy is not counted; this one's is


def test_warmup_compiles_every_shape_and_changes_nothing(tiny_model, greedy_refs):
    """After ``warmup()`` no workload traces a step (prompts of every length up to the
    sequence limit, every batch size, preemption and copies on write), its steps left no trace
    in the counters or the pool, and the outputs are those of an engine never warmed up."""
    engine_steps.jitted.cache_clear()  # new jitted steps: this engine's warm-up compiles them
    eng = make_engine(tiny_model, num_pages=SMALL_POOL)
    assert eng.warmup() > 0 and eng.stats()["compile_s"] > 0
    s = eng.stats()
    assert s["decode_steps"] == s["page_copies"] == s["prefill_tokens"] == 0
    assert s["pages_free"] == SMALL_POOL
    before, t0 = dict(engine_steps.TRACES), time.perf_counter()
    ids = [eng.submit(p, MAX_NEW) for p in PROMPTS]
    out = eng.run_until_done()
    assert [out[r] for r in ids] == greedy_refs
    rng = np.random.default_rng(3)
    for n in [1, 2, 3, 4, 1, 2]:  # n requests at once, lengths across every chunk bucket
        for _ in range(n):
            length = int(rng.integers(1, MAX_SEQ - 4))
            new = int(rng.integers(1, MAX_SEQ - length))
            eng.submit(rng.integers(0, 256, length).tolist(), new)
        eng.run_until_done()
    wall = time.perf_counter() - t0
    assert dict(engine_steps.TRACES) == before
    s = eng.stats()
    assert s["preemptions"] > 0
    # tokens_per_s's time is the steps' (most of the wall time here), not less the warm-up's
    assert s["tokens_per_s"] > 0 and 0.5 * wall < s["generated_tokens"] / s["tokens_per_s"] < wall


def test_warmup_needs_an_idle_engine(tiny_model, greedy_refs):
    eng = make_engine(tiny_model)
    rid = eng.submit(PROMPTS[0], MAX_NEW)
    with pytest.raises(RuntimeError, match="idle"):
        eng.warmup()
    assert eng.run_until_done()[rid] == greedy_refs[0]


def test_sampled_tokens_do_not_depend_on_the_batch(tiny_model):
    """Same seed, same tokens: alone, or batched with other requests (other rows, other steps,
    other sampling configs), and the same as ``generate`` on the request alone."""

    def sampled(eng, seed):
        return eng.submit(PROMPTS[1], MAX_NEW, sampling=TOP_P, seed=seed)

    alone = make_engine(tiny_model)
    rid = sampled(alone, 7)
    solo = alone.run_until_done()[rid]
    want = generate(tiny_model, [PROMPTS[1]], max_new_tokens=MAX_NEW, sampling=TOP_P, seed=7)
    assert solo == want.tokens[0]

    crowd = make_engine(tiny_model)
    others = [crowd.submit(p, MAX_NEW, sampling=TOP_P, seed=s) for s, p in enumerate(PROMPTS[3:])]
    crowd.step()
    rid, rid8 = sampled(crowd, 7), sampled(crowd, 8)
    greedy = crowd.submit(PROMPTS[0], MAX_NEW)  # the engine's default: greedy
    out = crowd.run_until_done()
    assert out[rid] == solo and out[rid8] != solo
    assert out[greedy] == generate(tiny_model, [PROMPTS[0]], max_new_tokens=MAX_NEW).tokens[0]
    assert all(len(out[r]) == MAX_NEW for r in others)


@pytest.mark.parametrize(
    ("prompt", "kwargs", "match"),
    [
        ([], {}, "must not be empty"),
        ([1, 264], {}, r"outside the vocabulary \[0, 264\)"),
        ([1, -1], {}, "outside the vocabulary"),
        ("abc", {}, "prompt_tokens must be a list"),
        ([1.5, 2], {}, "prompt_tokens must hold ints"),
        (np.zeros((2, 2), np.int32), {}, "1-D int array"),
        ([1, 2], {"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ([1, 2], {"max_new_tokens": 2.0}, "max_new_tokens must be an int"),
        ([1] * 95, {"max_new_tokens": 8}, "num_pages=12"),  # 102 positions > 12 pages of 8
        ([1] * 60, {"max_new_tokens": 8}, "exceeds max_seq_len 64"),
        ([1, 2], {"eos_id": 264}, "eos_id"),
        ([1, 2], {"seed": -1}, "seed"),
    ],
)
def test_bad_requests_rejected_others_unharmed(tiny_model, greedy_refs, prompt, kwargs, match):
    eng = make_engine(tiny_model, num_pages=SMALL_POOL)
    good = eng.submit(PROMPTS[0], MAX_NEW)
    eng.step()
    args = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        eng.submit(prompt, args.pop("max_new_tokens"), **args)
    assert eng.stats()["waiting"] == 0
    assert eng.run_until_done() == {good: greedy_refs[0]}


def test_bad_engine_arguments(tiny_model):
    with pytest.raises(TypeError, match="sampling"):
        make_engine(tiny_model).submit([1], 2, sampling="greedy")
    with pytest.raises(ValueError, match="num_pages"):
        make_engine(tiny_model, num_pages=0)
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        Engine(tiny_model, num_pages=4, max_prefill_tokens=0)
    with pytest.raises(TypeError, match="model"):
        Engine("model", num_pages=4)
    with pytest.raises(ValueError, match="max_seq_len must be in"):
        Engine(tiny_model, num_pages=4, max_seq_len=513)


@settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    schedule=st.lists(
        st.tuples(st.integers(0, 12), st.integers(0, len(PROMPTS) - 1), st.integers(1, MAX_NEW)),
        min_size=1,
        max_size=8,
    ),
    small=st.booleans(),
)
def test_random_arrival_schedules(tiny_model, greedy_refs, schedule, small):
    eng = make_engine(tiny_model, num_pages=SMALL_POOL if small else BIG_POOL)
    ids, streamed = run_schedule(eng, schedule)
    for rid, (i, n) in ids.items():
        assert streamed[rid] == greedy_refs[i][:n]
    assert eng.run_until_done() == streamed
    assert_clean(eng)


@pytest.mark.slow
def test_shipped_model_sampled_with_shared_prefixes_and_preemption():
    """The shipped code-draft model on real code prompts sharing a header, sampled (min-p) with
    EOS, in a pool small enough to preempt: every request equals ``generate`` on it alone."""
    from models import pretrained

    model, tok = pretrained("code-draft")
    header = "import os\nimport sys\n\n\ndef main(argv):\n    "
    prompts = [header + s for s in ("return 0\n", "for arg in argv:", "if not argv:", "x = ")]
    prompts += ["def fibonacci(n):", "class Stack:\n    def push(self, item):"]
    prompts = [[tok.bos_id] + tok.encode(p) for p in prompts]
    sampling = SamplingConfig(temperature=1.0, min_p=0.1)
    eng = Engine(model, max_batch=4, num_pages=24, page_size=8, max_prefill_tokens=32)
    ids = [
        eng.submit(p, 96, sampling=sampling, eos_id=tok.eos_id, seed=s)
        for s, p in enumerate(prompts)
    ]
    for p in prompts[:2]:  # a second wave hits the header pages in the cache
        ids.append(eng.submit(p, 96, sampling=sampling, eos_id=tok.eos_id, seed=11))
    out = eng.run_until_done()
    seeds = list(range(len(prompts))) + [11, 11]
    for rid, p, s in zip(ids, prompts + prompts[:2], seeds, strict=True):
        want = generate(model, [p], max_new_tokens=96, sampling=sampling, eos_id=tok.eos_id, seed=s)
        assert out[rid] == want.tokens[0]
    stats = eng.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert_clean(eng)


def test_twenty_sampling_settings_compile_the_decode_step_once(tiny_model, greedy_refs):
    """Settings are data: 20 temperatures / top-p values batched together reuse one decode
    step, and a greedy row among sampled rows gives its tokens alone."""
    eng = make_engine(tiny_model)
    eng.warmup()
    before = engine_steps.TRACES["decode"]
    temperatures = np.linspace(0.05, 2, 20)
    settings = [SamplingConfig(float(t), i % 5, 1 - i / 40) for i, t in enumerate(temperatures)]
    greedy = [eng.submit(PROMPTS[i], MAX_NEW) for i in (0, 4)]
    sampled = [eng.submit(PROMPTS[1], MAX_NEW, sampling=s, seed=3) for s in settings]
    out = eng.run_until_done()
    assert engine_steps.TRACES["decode"] == before
    assert [out[r] for r in greedy] == [greedy_refs[0], greedy_refs[4]]
    for rid, s in zip(sampled, settings, strict=True):  # each row sampled under its own settings
        want = generate(tiny_model, [PROMPTS[1]], max_new_tokens=MAX_NEW, sampling=s, seed=3)
        assert out[rid] == want.tokens[0]
    assert len({tuple(out[r]) for r in sampled}) > 3
    assert_clean(eng)


def test_results_are_handed_out_once(tiny_model, greedy_refs):
    eng = make_engine(tiny_model)
    a = eng.submit(PROMPTS[0], 3)
    while eng.busy:
        eng.step()
    assert eng.pop_finished() == {a: greedy_refs[0][:3]}
    assert eng.pop_finished() == {}
    b = eng.submit(PROMPTS[4], 2)
    assert eng.run_until_done() == {b: greedy_refs[4][:2]}  # a is not handed out again
    assert eng.run_until_done() == {} and eng.stats()["finished"] == 2


def test_abort_waiting_and_running_requests(tiny_model, greedy_refs):
    eng = make_engine(tiny_model, num_pages=SMALL_POOL)
    ids = [eng.submit(p, MAX_NEW) for p in PROMPTS[:5]]  # batch 4: the fifth waits
    for _ in range(4):
        eng.step()
    req = next(r for r in eng.scheduler.running if r.decoding)
    victim = req.rid
    before = eng.allocator.num_available
    held = sum(eng.allocator.refcount(p) == 1 for p in eng.tables.rows[req.row])  # not shared
    got = eng.abort(victim)
    assert 0 < len(got) < MAX_NEW and got == greedy_refs[ids.index(victim)][: len(got)]
    assert held > 0 and eng.allocator.num_available == before + held  # freed at once
    assert eng.abort(ids[4]) == []  # still waiting
    with pytest.raises(KeyError, match="12345"):
        eng.abort(12345)
    with pytest.raises(KeyError, match="True"):
        eng.abort(True)
    with pytest.raises(KeyError, match=str(victim)):
        eng.abort(victim)
    out = eng.run_until_done()
    assert set(out) == set(ids) - {victim, ids[4]}
    for rid in out:
        assert out[rid] == greedy_refs[ids.index(rid)]
    assert eng.stats()["aborted"] == 2 and eng.stats()["finished"] == 3
    assert_clean(eng)
    done = eng.submit(PROMPTS[0], 2)
    while eng.busy:
        eng.step()
    assert eng.abort(done) == greedy_refs[0][:2]  # finished, not handed out: dropped
    assert eng.pop_finished() == {}


def test_stats_rates_exclude_compilation(tiny_model):
    engine_steps.jitted.cache_clear()  # new jitted steps: this engine compiles them
    eng = make_engine(tiny_model)
    eng.submit(PROMPTS[3], 4)
    eng.run_until_done()
    s = eng.stats()
    assert s["compile_s"] > 0
    assert s["tokens_per_s"] == pytest.approx(4 / (eng._busy_s - s["compile_s"]))


def _timed_run(eng, prompts) -> float:
    t0 = time.perf_counter()
    for p in prompts:
        eng.submit(p, MAX_NEW)
    eng.run_until_done()
    return time.perf_counter() - t0


@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler (KeyboardInterrupt) for the test, whatever the test worker
    process had installed before (an ignored SIGINT would make the test vacuous)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def test_sigint_at_random_times_loses_nothing(tiny_model, greedy_refs, ctrl_c_raises):
    """Real SIGINTs (os.kill from timer threads) at random times while the engine steps: each
    interrupt that lands in step() is raised when the step is consistent; stepping on, every
    request finishes with its uninterrupted tokens, each token streamed exactly once, and every
    page comes back. A small pool, so interrupts also land in preemptions and copies."""
    eng = make_engine(tiny_model, num_pages=SMALL_POOL)
    _timed_run(eng, PROMPTS)  # compiles
    span = _timed_run(eng, PROMPTS)  # how long a warm run takes
    rng = np.random.default_rng(0)
    in_step = 0
    deadline = time.monotonic() + 60
    # Timers fire while the main thread is inside step() (or about to enter or just left it:
    # under load a timer thread may run late). The handler sees the frame each interrupt landed
    # in (the engine hands its deferred one the original frame) and raises only inside step():
    # one landing in the test's own code would test the test, not the engine.
    stepping, outside = threading.Event(), []

    def interrupt():
        if stepping.wait(timeout=5):
            os.kill(os.getpid(), signal.SIGINT)

    def handler(signum, frame):
        f = frame
        while f is not None and f.f_code is not Engine.step.__code__:
            f = f.f_back
        if f is None:
            outside.append(1)
        else:
            raise KeyboardInterrupt

    old_handler = signal.signal(signal.SIGINT, handler)
    try:
        for _ in range(8):
            if time.monotonic() > deadline:
                break
            ids = {eng.submit(p, MAX_NEW): i for i, p in enumerate(PROMPTS)}
            streamed: dict[int, list[int]] = {}
            timers = [threading.Timer(t, interrupt) for t in rng.uniform(0, span, 3)]
            for t in timers:
                t.start()
            while eng.busy or any(t.is_alive() for t in timers):
                try:
                    stepping.set()
                    events = eng.step()
                except KeyboardInterrupt:
                    stepping.clear()
                    in_step += 1
                    continue
                stepping.clear()
                for rid, tokens in events.items():
                    streamed.setdefault(rid, []).extend(tokens)
            for t in timers:
                t.join()
            out = eng.pop_finished()
            assert {rid: out[rid] for rid in ids} == {rid: greedy_refs[i] for rid, i in ids.items()}
            assert streamed == {rid: out[rid] for rid in ids}
            assert_clean(eng)
    finally:
        stepping.set()  # releases any timer still waiting
        signal.signal(signal.SIGINT, old_handler)
    assert in_step > 0, (in_step, len(outside))
    assert eng.stats()["rebuilds"] == 0  # nothing was torn down


class _Fault(Exception):
    pass


def _raise_once(eng, fault):
    """Patches ``eng`` so that one exception is raised at the point ``fault`` names, once."""
    fired = []

    def once():
        if fired:
            return False
        fired.append(True)
        return True

    sched = eng.scheduler
    if fault in ("retire", "retire_after_result"):  # the request is done, its retirement cut
        real = sched.retire

        def retire(req):
            if once():
                if fault == "retire_after_result":
                    sched.finished[req.rid] = req.out
                raise _Fault
            real(req)

        sched.retire = retire
    elif fault == "register":  # a decode row has appended its token, the rest of the step not
        real = sched.register

        def register(req):
            if len(req.tokens) > req.prompt_len + 2 and once():
                raise _Fault
            real(req)

        sched.register = register
    elif fault == "logprob_records":  # inside handing the tokens out
        import decoding.engine as engine_module

        real = engine_module.logprob_records

        def records(*args):
            if once():
                raise _Fault
            return real(*args)

        return records
    elif fault == "count_drafts":  # after the tokens were handed out
        real = eng._count_drafts

        def count(*args):
            if once():
                raise _Fault
            real(*args)

        eng._count_drafts = count
    return None


@pytest.mark.parametrize(
    "fault", ["retire", "retire_after_result", "register", "logprob_records", "count_drafts"]
)
def test_an_exception_after_tokens_were_appended(tiny_model, greedy_refs, fault, monkeypatch):
    """An exception in a step after some rows appended their tokens (during postprocessing,
    retirement or handing out): the engine rebuilds, the appended tokens are streamed all the
    same (with their logprobs), a request whose last token was appended finishes with exactly
    its tokens (never decoded past its end), none is lost, no page leaks."""
    eng = make_engine(tiny_model)
    patched = _raise_once(eng, fault)
    if patched is not None:
        monkeypatch.setattr("decoding.engine.logprob_records", patched)
    ids = {eng.submit(p, MAX_NEW, logprobs=2 if i % 2 else None): i for i, p in enumerate(PROMPTS)}
    streamed, records, raised = {}, {}, 0
    for _ in range(200):  # bounded: every request finishes in well under this
        if not eng.busy:
            break
        try:
            events = eng.step()
        except _Fault:
            raised += 1
            continue
        for rid, tokens in events.items():
            streamed.setdefault(rid, []).extend(tokens)
        for rid, lps in eng.pop_logprobs().items():
            records.setdefault(rid, []).extend(lps)
    out = eng.pop_finished()
    assert raised == 1 and eng.stats()["rebuilds"] == 1
    assert out == {rid: greedy_refs[i] for rid, i in ids.items()}
    assert streamed == out
    assert {rid: [r.token for r in lps] for rid, lps in records.items()} == {
        rid: out[rid] for rid, i in ids.items() if i % 2
    }
    assert eng.stats()["finished"] == len(PROMPTS)
    assert_clean(eng)


def test_the_last_steps_tokens_come_after_an_interrupt(tiny_model, greedy_refs, ctrl_c_raises):
    """Ctrl-C in the step that finishes the last request (so nothing is left waiting or
    running), then an exception in one that retires it: the engine stays ``busy`` until a
    ``step()`` has returned those tokens, so ``while eng.busy: eng.step()`` streams them all."""
    for fault in ("sigint", "exception"):
        eng = make_engine(tiny_model)
        rid = eng.submit(PROMPTS[4], MAX_NEW)
        sched, real = eng.scheduler, eng.scheduler.retire

        def retire(req, fault=fault, real=real):
            if fault == "sigint":
                os.kill(os.getpid(), signal.SIGINT)  # held until the step is consistent
                real(req)
            else:
                raise _Fault

        sched.retire = retire
        streamed, raised = [], 0
        for _ in range(2 * MAX_NEW):
            if not eng.busy:
                break
            try:
                streamed += eng.step().get(rid, [])
            except (KeyboardInterrupt, _Fault):
                raised += 1
                sched.retire = real
                assert eng.busy and not (sched.running or sched.waiting)
        assert raised == 1 and not eng.busy
        assert streamed == greedy_refs[4] and eng.pop_finished() == {rid: greedy_refs[4]}
        assert_clean(eng)


class _Alarm(BaseException):
    """Raised asynchronously, like KeyboardInterrupt: not an ``Exception``, so that library code
    with an ``except Exception`` handler around the bytecode it lands on (JAX's ``tree_map`` has
    one, which then fails on its own unbound name) re-raises it unchanged."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # alarm in a gc hook
def test_exceptions_at_random_points_rebuild_the_engine(tiny_model, greedy_refs):
    """An exception raised asynchronously at any bytecode inside step() (a SIGALRM handler,
    signal.setitimer at random times), including between a jitted call's return and the
    assignment of the donated pool: the engine rebuilds itself and every request still finishes
    with its uninterrupted tokens, no page leaked."""

    def alarm(signum, frame):
        raise _Alarm

    eng = make_engine(tiny_model, num_pages=SMALL_POOL)
    eng.warmup()  # every step compiled: no compile inside the alarms' span
    _timed_run(eng, PROMPTS)  # compiles: a span measured with it would outlast the warm runs,
    span = _timed_run(eng, PROMPTS)  # and every timer would be re-armed before it ever fired
    rng = np.random.default_rng(1)
    old = signal.signal(signal.SIGALRM, alarm)
    raised, deadline = 0, time.monotonic() + 60
    try:
        for delay in rng.uniform(0, span, 10):
            if time.monotonic() > deadline:
                break
            ids = {eng.submit(p, MAX_NEW): i for i, p in enumerate(PROMPTS)}
            signal.setitimer(signal.ITIMER_REAL, delay)
            # The handler runs at the interpreter's next check after the signal arrives, and a
            # loop's backward jump is one: a signal that arrives as step() returns is handled at
            # the jump of the loop around it. So the stepping loop is inside the try, and the
            # outer loop only jumps back once the one-shot alarm has been handled.
            while True:
                try:
                    while eng.busy:
                        eng.step()
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    break
                except _Alarm:
                    raised += 1
            try:  # a signal delivered during the disarm is handled at the next bytecode
                signal.setitimer(signal.ITIMER_REAL, 0)
            except _Alarm:
                raised += 1
            out = eng.pop_finished()
            assert {rid: out[rid] for rid in ids} == {rid: greedy_refs[i] for rid, i in ids.items()}
            assert_clean(eng)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    # An alarm that lands before step()'s try block (its usability check) or after it (handing
    # the events out) changed nothing, so it needs no rebuild: every rebuild is one alarm, not
    # every alarm a rebuild.
    assert raised > 0 and 0 < eng.stats()["rebuilds"] <= raised


def test_numpy_scalars_accepted_bools_rejected(tiny_model, greedy_refs):
    eng = Engine(
        tiny_model,
        max_batch=np.int64(4),
        num_pages=np.int32(BIG_POOL),
        page_size=np.int64(PAGE),
        max_prefill_tokens=np.int64(32),
        max_seq_len=np.int64(MAX_SEQ),
        prefix_caching=np.bool_(1),
    )
    rid = eng.submit(np.array(PROMPTS[0]), np.int64(MAX_NEW), eos_id=np.int32(0), seed=np.uint32(1))
    rid2 = eng.submit(PROMPTS[4], MAX_NEW)
    assert eng.abort(np.int64(rid2)) == []
    out = eng.run_until_done()[rid]
    assert out == greedy_refs[0][: greedy_refs[0].index(0) + 1 if 0 in greedy_refs[0] else None]
    for kwargs in ({"max_batch": True}, {"page_size": True}, {"prefix_caching": 1}):
        with pytest.raises(TypeError, match=f"{next(iter(kwargs))} must be"):
            Engine(tiny_model, num_pages=4, **kwargs)
    for kwargs in ({"eos_id": True}, {"seed": False}):
        with pytest.raises(TypeError, match=next(iter(kwargs))):
            eng.submit(PROMPTS[0], 2, **kwargs)
    with pytest.raises(TypeError, match="max_new_tokens"):
        eng.submit(PROMPTS[0], True)
    with pytest.raises(TypeError, match="model"):
        Engine(object(), num_pages=4)
