"""Speculation inside the engine (``Engine(model, draft=PromptLookup() | Medusa(heads) |
Eagle(head) | draft_model, ...)``):
greedy output of every request identical to ``generate`` alone, with shared prefixes, preemption and arrivals;
sampled output distributed exactly as the target's (chi-square against the enumerated joint) and
independent of the batch; no recompiles as requests come and go; the draft length chosen from
measured costs when not given.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import random_transformer
from flax import nnx
from test_eagle import random_head
from test_medusa import random_heads
from test_speculative_exact import PROMPT, SMALL, V, assert_matches, exact_joints

from decoding import Eagle, Medusa, PromptLookup, TreeSpec, drafts, engine_steps
from decoding.drafts import StepCosts
from decoding.engine import Engine
from decoding.generate import generate
from decoding.sampling import SamplingConfig
from models import Transformer

MAX_NEW = 14
PAGE = 8
K = 3


def make_engine(model, num_pages=64, draft=None, **kwargs) -> Engine:
    kwargs.setdefault("num_draft_tokens", K)
    return Engine(
        model,
        max_batch=4,
        num_pages=num_pages,
        page_size=PAGE,
        max_prefill_tokens=32,
        max_seq_len=128,
        draft=PromptLookup() if draft is None else draft,
        **kwargs,
    )


def medusa_draft(model, lookup_ngram=None) -> Medusa:
    """Heads whose residual layers are small: they mostly predict what the LM head predicts one
    step earlier, so on this model's runs of one token their drafts are accepted, and rejected
    where the run changes."""
    return Medusa(random_heads(model, 4, seed=3, scale=0.05), lookup_ngram=lookup_ngram)


def echo_head(model, seed: int = 0):
    """An EAGLE head whose feature is about the target's hidden state it reads (``fc`` passes h
    on, the token's embedding and the block's weights small): it drafts the target's last guess again, so on this model's
    runs of one token its drafts are accepted, and rejected where the run changes. The block
    still reads its pool, so the pool's contents reach the drafts."""
    head = random_head(model, seed)
    D = model.config.dim
    e_part = head.fc.kernel[...][:D]  # the token after h counts too
    head.fc.kernel[...] = jnp.concatenate([e_part, jnp.eye(D, dtype=e_part.dtype)])
    head.fc.bias[...] = jnp.zeros(D)
    for path, x in nnx.to_flat_state(nnx.state(head.block, nnx.Param)):
        if "norm" not in "/".join(map(str, path)):
            x[...] = 0.05 * x[...]
    return head


def shallow(model, num_layers: int) -> Transformer:
    """A draft model: ``model``'s embedding, first ``num_layers`` layers, norm and head."""
    small = Transformer(model.config.replace(num_layers=num_layers), rngs=nnx.Rngs(0))
    src = dict(nnx.to_flat_state(nnx.state(model)))
    nnx.update(
        small, nnx.from_flat_state([(p, src[p]) for p, _ in nnx.to_flat_state(nnx.state(small))])
    )
    return small


DRAFTS = ["lookup", "medusa", "medusa+lookup", "eagle", "eagle+lookup", "model"]


def draft_of(model, name):
    return {
        "lookup": lambda: PromptLookup(),
        "medusa": lambda: medusa_draft(model),
        "medusa+lookup": lambda: medusa_draft(model, lookup_ngram=2),
        # heads that also read each row's root token (its last known token)
        "medusa-root": lambda: Medusa(random_heads(model, 4, seed=3, scale=0.05, root_token=True)),
        "eagle": lambda: Eagle(echo_head(model)),
        "eagle+lookup": lambda: Eagle(echo_head(model), lookup_ngram=2, head_tokens=2),
        "model": lambda: shallow(model, 1),
    }[name]()


@pytest.fixture(scope="module")
def model():
    """Small weights: greedy output runs of one token with changes between, so drafts are
    accepted and rejected."""
    return random_transformer(0, scale=0.1)


@pytest.fixture(scope="module")
def prompts(model):
    """Prompts that repeat themselves (p, its greedy continuation, p again, a bit of it), so
    lookup drafts get accepted; plus ones with no repeat."""
    rng = np.random.default_rng(1)
    base = [rng.integers(0, 256, n).tolist() for n in (9, 17, 12)]
    out = []
    for p in base:
        cont = generate(model, [p], max_new_tokens=16).tokens[0]
        out.append(p + cont + p + cont[:2])
    return out + [rng.integers(0, 256, 21).tolist(), [5]]


@pytest.fixture(scope="module")
def refs(model, prompts):
    return [generate(model, [p], max_new_tokens=MAX_NEW).tokens[0] for p in prompts]


def arrivals(eng: Engine, prompts, refs, order, after_step=None) -> None:
    """Submits ``prompts[i]`` for i in ``order``, one every other step, steps until done
    (calling ``after_step(eng)`` after each step) and checks every request's greedy tokens
    against ``refs``."""
    ids, step, order = {}, 0, list(order)
    while order or eng.busy:
        if order and step % 2 == 0:
            i = order.pop(0)
            ids[eng.submit(prompts[i], MAX_NEW)] = i
        eng.step()
        step += 1
        if after_step is not None:
            after_step(eng)
    out = eng.pop_finished()
    assert {r: out[r] for r in ids} == {r: refs[i] for r, i in ids.items()}


def assert_clean(eng: Engine) -> None:
    s = eng.stats()
    assert (s["running"], s["waiting"], s["pages_used"]) == (0, 0, 0)
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"]


@pytest.mark.parametrize("draft", [*DRAFTS, "medusa-root"])
def test_greedy_equals_generate_alone(model, prompts, refs, draft):
    eng = make_engine(model, draft=draft_of(model, draft))
    ids = [eng.submit(p, MAX_NEW) for p in prompts]
    out = eng.run_until_done()
    assert [out[r] for r in ids] == refs
    s = eng.stats()
    assert s["draft_accepted"] > 0  # drafts were kept, not only rejected
    assert s["decode_steps"] < sum(len(r) for r in refs) / 4 + len(prompts)  # batched, >1/step
    assert s["generated_tokens"] == len(prompts) * MAX_NEW
    assert_clean(eng)


@pytest.mark.parametrize("draft", ["lookup", "medusa", "eagle", "model"])
def test_preemption_prefix_caching_and_arrivals(model, prompts, refs, draft):
    """A pool too small for every row's k + 1 positions: rows are preempted and recomputed;
    repeated prompts hit the prefix cache; requests arrive while others run (Medusa: rows move
    between batch slots, whose kept hidden states must then not be used)."""
    eng = make_engine(model, num_pages=12, draft=draft_of(model, draft))
    arrivals(eng, prompts, refs, [0, 1, 2, 0, 3, 1, 4, 2])
    s = eng.stats()
    assert s["preemptions"] > 0 and s["prefix_cache_hits"] > 0
    assert_clean(eng)


@pytest.mark.parametrize("draft", ["lookup", "medusa", "eagle", "model"])
def test_no_recompiles_as_requests_come_and_go(model, prompts, draft):
    eng = make_engine(model, draft=draft_of(model, draft))
    eng.warmup()  # every shape: chunks, plain decode batches, the verification
    before = dict(engine_steps.TRACES)
    for i, p in enumerate(prompts):  # other rows, lengths, settings
        eng.submit(p, 3 + i, sampling=SamplingConfig(temperature=0.5 + i, top_k=i))
        eng.step()
    eng.run_until_done()
    assert dict(engine_steps.TRACES) == before


@pytest.mark.parametrize("draft", ["lookup", "medusa", "eagle", "model"])
def test_sampled_tokens_do_not_depend_on_the_batch(model, prompts, draft):
    top_p = SamplingConfig(temperature=1.0, top_p=0.9)
    alone = make_engine(model, draft=draft_of(model, draft))
    rid = alone.submit(prompts[0], MAX_NEW, sampling=top_p, seed=7)
    solo = alone.run_until_done()[rid]
    crowd = make_engine(model, draft=draft_of(model, draft))
    others = [crowd.submit(p, MAX_NEW, sampling=top_p, seed=s) for s, p in enumerate(prompts[1:])]
    crowd.step()
    rid, rid8 = (crowd.submit(prompts[0], MAX_NEW, sampling=top_p, seed=s) for s in (7, 8))
    out = crowd.run_until_done()
    assert out[rid] == solo and out[rid8] != solo
    assert all(len(out[r]) == MAX_NEW for r in others)


@pytest.mark.parametrize("draft", ["lookup", "medusa", "eagle", "model"])
def test_sampled_distribution_exact(draft):
    """N requests of one prompt, 3 new tokens each, from k = 2 drafts: the first step's
    accepted drafts, residual samples and bonus tokens; joints of (t1, t2) and (t2, t3).
    Medusa: the rows' first step drafts from zeros, the second from the kept hidden state. A
    draft model: drawn from its own distributions (q not one-hot)."""
    n, sampling = 6000, SamplingConfig(temperature=1.0)
    target = random_transformer(10, num_layers=2, **SMALL)
    # pages of 4: every request but the first takes the prompt from the cache
    eng = Engine(
        target,
        max_batch=n,
        num_pages=n + 8,
        page_size=4,
        max_prefill_tokens=64,
        max_seq_len=16,
        draft={
            "lookup": PromptLookup,
            "medusa": lambda: Medusa(random_heads(target, 2, seed=6)),
            "eagle": lambda: Eagle(echo_head(target, 6)),
            "model": lambda: shallow(target, 1),
        }[draft](),
        num_draft_tokens=2,
    )
    ids = [eng.submit(PROMPT, 3, sampling=sampling, seed=s) for s in range(n)]
    out = eng.run_until_done()
    tokens = np.array([out[r] for r in ids])
    assert eng.stats()["draft_accepted"] > 0
    joint12, joint23 = exact_joints(target, sampling)
    assert_matches(tokens[:, :2], joint12)
    assert_matches(tokens[:, 1:], joint23)
    assert V == target.config.vocab_size


def test_draft_length_chosen_from_costs(model, monkeypatch, prompts, refs):
    flat = StepCosts(tuple(1.0 + 0.01 * t for t in range(drafts.MAX_K + 1)))
    steep = StepCosts(tuple(1.0 + t for t in range(drafts.MAX_K + 1)))
    ks = {}
    for name, costs in (("flat", flat), ("steep", steep)):
        monkeypatch.setattr(drafts, "measure_step_costs", lambda *a, c=costs, **kw: c.target)
        eng = make_engine(model, num_draft_tokens=None)
        ks[name] = eng.num_draft_tokens
        rid = eng.submit(prompts[0], MAX_NEW)
        assert eng.run_until_done()[rid] == refs[0]
    # steep: verifying k + 1 tokens costs k + 1 steps, so no k pays at the prior: k = 0
    assert ks["steep"] == 0 and ks["flat"] > 1


def test_the_k_rule_looks_the_measured_costs_up_once(model, monkeypatch, prompts, refs):
    """However often the engine chooses k again, it looks the measured costs up once
    (``speculative.draft_step_costs``: the lookup reads every parameter's dtype, 40 ms on
    SmolLM2)."""
    from decoding import speculative

    calls, real = [], speculative.draft_step_costs
    flat = tuple(1.0 + 0.01 * t for t in range(drafts.MAX_K + 1))
    monkeypatch.setattr(drafts, "measure_step_costs", lambda *a, **kw: flat)
    monkeypatch.setattr(
        "decoding.engine.draft_step_costs", lambda *a, **kw: calls.append(1) or real(*a, **kw)
    )
    monkeypatch.setattr("decoding.engine.RECHOOSE_STEPS", 1)
    eng = make_engine(model, num_draft_tokens=None)
    rid = eng.submit(prompts[0], MAX_NEW)
    assert eng.run_until_done()[rid] == refs[0]
    assert eng.stats()["decode_steps"] > 2 and calls == [1]


def test_no_draft_while_it_does_not_pay(model, monkeypatch, prompts, refs):
    """k = 0 (chosen where no k pays) runs plain decode steps, greedy output unchanged; the
    acceptance estimate keeps following the draft's first token against the tokens produced
    (so k can come back), and k may change between steps in both directions."""
    steep = StepCosts(tuple(1.0 + t for t in range(drafts.MAX_K + 1)))
    monkeypatch.setattr(drafts, "measure_step_costs", lambda *a, **kw: steep.target)
    eng = make_engine(model, num_draft_tokens=None)
    assert eng.num_draft_tokens == 0
    prior = eng.acceptance.rate
    rid = eng.submit(prompts[0], MAX_NEW)
    assert eng.run_until_done()[rid] == refs[0]
    st = eng.stats()
    assert st["draft_proposed"] == 0 and st["decode_steps"] > 0
    assert eng.acceptance.tested > 0 and eng.acceptance.rate != prior
    ks = iter([0, 3, 0, 2, 1] * 20)
    monkeypatch.setattr("decoding.engine.chosen_num_draft_tokens", lambda *a, **kw: next(ks))
    # cheap extra rows: a row's own draft length (Engine._row_caps) does not veto the k in use
    flat = tuple(1.0 + 0.01 * t for t in range(drafts.MAX_K + 1))
    monkeypatch.setattr(drafts, "measure_step_costs", lambda *a, **kw: flat)
    monkeypatch.setattr("decoding.engine.RECHOOSE_STEPS", 1)
    eng = make_engine(model, num_draft_tokens=None)
    rids = [eng.submit(p, MAX_NEW) for p in prompts]
    out = eng.run_until_done()
    assert [out[r] for r in rids] == refs
    assert eng.stats()["draft_proposed"] > 0


def test_k_follows_the_engines_own_step_costs(model, monkeypatch, prompts, refs):
    """The engine times its steps (``RunOutput.seconds``; compiling calls excluded): while
    prompt lookup drafts, a plain step now and then (``EXPLORE_STEPS``), whose tokens are
    the same. Its k rule then weighs those times (``drafts.ObservedCosts``) and the share of
    rows with a match, not the measured forward alone: verifications seen to cost 3 plain
    steps turn drafting off, seen to cost as little as one turn it back on."""
    flat = StepCosts(tuple(1.0 + 0.01 * t for t in range(drafts.MAX_K + 1)))
    monkeypatch.setattr(drafts, "measure_step_costs", lambda *a, **kw: flat.target)
    monkeypatch.setattr("decoding.engine.EXPLORE_STEPS", 4)
    eng = make_engine(model, num_draft_tokens=None)
    eng.warmup()
    k = eng.num_draft_tokens
    assert k > 0
    plain, run = [], eng.runner.run

    def counted(plan, logprobs=frozenset(), plain_=False, **kw):
        plain.append(kw.get("plain", plain_))
        return run(plan, logprobs, **kw)

    monkeypatch.setattr(eng.runner, "run", counted)
    rids = [eng.submit(p, MAX_NEW) for p in prompts[:4]]  # 4 rows: a verification's batch
    out = eng.run_until_done()
    assert [out[r] for r in rids] == refs[:4]
    assert any(plain) and not all(plain)
    obs = eng._observed
    # a ragged verification's time is not a k's: only plain steps are observed there
    seen = any(obs.count(j) > 0 for j in range(1, drafts.MAX_K + 1))
    assert obs.count(0) > 0 and seen != eng.runner.ragged
    assert all(s > 0 for s in obs.seconds.values())
    assert 0 < eng._drafting.rate <= 1
    for _ in range(64):
        obs.observe(0, 0.01)
        for j in range(1, drafts.MAX_K + 1):
            obs.observe(j, 0.03)
    eng._choose_k()
    assert eng.num_draft_tokens == 0
    eng.acceptance.add(1000, 1000)  # every draft accepted
    eng._drafting.add(1000, 1000)
    for _ in range(64):
        for j in range(1, drafts.MAX_K + 1):
            obs.observe(j, 0.01 * (1 + 0.001 * j))
    eng._choose_k()
    assert eng.num_draft_tokens > 0
    fixed = make_engine(model)  # num_draft_tokens=K: nothing reads the times, no plain probe
    probes, fixed_run = [], fixed.runner.run

    def probed(plan, logprobs=frozenset(), **kw):
        probes.append(kw.get("plain", False))
        return fixed_run(plan, logprobs, **kw)

    monkeypatch.setattr(fixed.runner, "run", probed)
    rids = [fixed.submit(p, MAX_NEW) for p in prompts[:4]]
    out = fixed.run_until_done()
    assert [out[r] for r in rids] == refs[:4]
    assert probes and not any(probes)


def test_host_lookup_is_the_drafts_first_token():
    """``drafts.lookup_next`` (the engine's estimate while k = 0) proposes what the jitted
    lookup's first token is, on sequences with and without repeats."""
    import jax.numpy as jnp

    rng = np.random.default_rng(4)
    rows = [rng.integers(0, 6, n).tolist() for n in (2, 5, 9, 17, 30)] + [[3], [1, 2, 3, 1, 2]]
    L = max(len(r) for r in rows)
    seq = np.zeros((len(rows), L), np.int32)
    for i, r in enumerate(rows):
        seq[i, : len(r)] = r
    lengths = jnp.asarray([len(r) for r in rows], jnp.int32)
    for lo, hi in ((1, 3), (2, 2), (1, 1)):
        want = np.asarray(drafts.lookup(jnp.asarray(seq), lengths, 2, lo, hi))[:, 0]
        got = [drafts.lookup_next(r, lo, hi) for r in rows]
        assert got == want.tolist(), (lo, hi)


def test_bad_arguments(tiny_model):
    with pytest.raises(TypeError, match="draft"):
        Engine(tiny_model, num_pages=8, draft="prompt-lookup")
    other_vocab = random_transformer(1, vocab_size=tiny_model.config.vocab_size + 1)
    with pytest.raises(ValueError, match="vocab"):
        Engine(tiny_model, num_pages=8, draft=other_vocab)
    short = random_transformer(1, max_position=64)
    with pytest.raises(ValueError, match="max_position=64"):
        Engine(tiny_model, num_pages=8, draft=short, max_seq_len=128)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        Engine(tiny_model, num_pages=8, num_draft_tokens=2)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        Engine(tiny_model, num_pages=8, draft=PromptLookup(), num_draft_tokens=0)


def test_medusa_chain_only_and_heads_enough(tiny_model):
    heads = random_heads(tiny_model, 3)
    with pytest.raises(ValueError, match="chains"):
        Engine(tiny_model, num_pages=8, draft=Medusa(heads, tree=TreeSpec.default(3)))
    with pytest.raises(ValueError, match="num_heads=3"):
        Engine(tiny_model, num_pages=8, draft=Medusa(heads), num_draft_tokens=4)


def test_medusa_with_a_draft_vocabulary_keeps_every_greedy_output(model, prompts, refs):
    """Heads that draft from half the tokens: rows whose next tokens lie outside it are
    rejected there, and every request's tokens are still its plain greedy ones."""
    vocab = list(range(0, model.config.vocab_size, 2))
    heads = random_heads(model, 4, seed=3, scale=0.05, vocab=vocab)
    eng = make_engine(model, draft=Medusa(heads))
    arrivals(eng, prompts, refs, range(len(prompts)))
    assert 0 < eng.stats()["draft_accepted"] < eng.stats()["draft_proposed"]


def test_medusa_hidden_state_is_the_rows_own(model, prompts, refs):
    """The hidden state a slot keeps is used only by the request that left it, at the token
    count it left it at: a new request in the slot drafts from zeros, and so does a request
    that was preempted and readmitted elsewhere."""
    eng = make_engine(model, draft=medusa_draft(model))
    rid = eng.submit(prompts[0], MAX_NEW)
    req = eng.scheduler.waiting[0]
    while len(req.tokens) == req.prompt_len:  # prefill, then the first verification (from zeros)
        eng.step()
    runner, slot = eng.runner, req.row
    assert runner._hidden_of[slot] == (rid, len(req.tokens))
    assert eng.run_until_done()[rid] == refs[0]
    rid2 = eng.submit(prompts[1], MAX_NEW)
    req2 = eng.scheduler.waiting[0]
    while len(req2.tokens) == req2.prompt_len:
        eng.step()
    assert runner._hidden_of[req2.row] == (rid2, len(req2.tokens))
    eng.run_until_done()
    eng.runner.recover()
    assert eng.runner._hidden_of == [None] * eng.max_batch


def test_medusa_decodes_plainly_where_no_k_pays_and_probes(model, monkeypatch, prompts, refs):
    """Where no k pays the rule chooses k = 0 for Medusa too: plain decode steps, which keep
    each row's hidden state in its slot (the state its LM head read, as a verification's), and
    one step in ``PROBE_EVERY`` verifies one head token per row, so the heads are still judged
    (these heads mostly repeat the LM head's last guess, so probes accept some) and k can come
    back; greedy output stays ``generate``'s."""
    import jax.numpy as jnp

    from decoding import engine as engine_mod

    steep = tuple(1.0 + 8.0 * t for t in range(drafts.MAX_K + 1))
    monkeypatch.setattr(drafts, "measure_step_costs", lambda *a, **kw: steep)
    monkeypatch.setattr(engine_mod, "PROBE_EVERY", 1 << 30)  # none yet: plain steps only
    eng = make_engine(model, draft=medusa_draft(model), num_draft_tokens=None)
    assert eng.num_draft_tokens == 0
    rid = eng.submit(prompts[0], MAX_NEW)
    req = eng.scheduler.waiting[0]
    while len(req.tokens) < req.prompt_len + 3:
        eng.step()
    assert eng.stats()["draft_proposed"] == 0
    slot, tokens = req.row, list(req.tokens)
    assert eng.runner._hidden_of[slot] == (rid, len(tokens))
    _, want = model(jnp.array([tokens[:-1]]), return_hidden=True)
    np.testing.assert_allclose(eng.runner.hidden[slot], want[0, -1], rtol=1e-4, atol=1e-5)
    assert eng.run_until_done()[rid] == refs[0]
    monkeypatch.setattr(engine_mod, "PROBE_EVERY", 4)
    rids = [eng.submit(p, MAX_NEW) for p in prompts]
    out = eng.run_until_done()
    assert [out[r] for r in rids] == refs
    s = eng.stats()
    assert 0 < s["draft_proposed"] < s["generated_tokens"] / 2  # probes, one token per row
    assert s["draft_accepted"] > 0 and eng.acceptance.tested > 0
    eng.acceptance.add(1000, 1000)  # heads seen to be always right: drafting pays again
    monkeypatch.setattr(drafts, "measure_step_costs", lambda *a, **kw: steep[:1] * 9)
    eng._step_costs.cache_clear()
    eng._observed = drafts.ObservedCosts()
    eng._choose_k()
    assert eng.num_draft_tokens > 0


def test_medusa_with_lookup_keeps_a_k_per_source(model, monkeypatch, prompts, refs):
    """``Medusa(heads, lookup_ngram=n)``: a step where some row's n-gram matched verifies
    ``num_draft_tokens``, one where none did ``heads_draft_tokens``, each chosen on its own
    source's running acceptance; with the heads judged useless and the lookup sure, steps
    without a match decode plainly (but for probes, which judge the heads alone) while those
    with one draft long, and every greedy output stays ``generate``'s."""
    from decoding import engine as engine_mod

    costs = tuple(1.0 + 0.1 * t for t in range(drafts.MAX_K + 1))
    monkeypatch.setattr(drafts, "measure_step_costs", lambda *a, **kw: costs)
    monkeypatch.setattr(engine_mod, "PROBE_EVERY", 4)
    eng = make_engine(model, draft=medusa_draft(model, lookup_ngram=2), num_draft_tokens=None)
    eng.acceptance.add(1000, 1000)
    eng._heads_acceptance.add(0, 1000)
    eng._choose_k()
    k_found, k_none = eng.num_draft_tokens, eng.heads_draft_tokens
    # the lookup's drafts run past the 4 heads (rows without a match: the last head again)
    assert k_found == drafts.MAX_K and k_none == 0 and eng.stats()["heads_draft_tokens"] == 0
    steps, run = [], eng.runner.run

    def recorded(plan, *args, **kwargs):
        out = run(plan, *args, **kwargs)
        if plan.decode:
            steps.append((any(out.found), out.k, kwargs["ks"]))
        return out

    monkeypatch.setattr(eng.runner, "run", recorded)
    monkeypatch.setattr(engine_mod, "RECHOOSE_STEPS", 1 << 30)  # the ks stay as set
    judged = {"lookup": [], "heads": []}  # (accepted, proposed) each estimate was given
    for name, est in (("lookup", eng.acceptance), ("heads", eng._heads_acceptance)):
        monkeypatch.setattr(est, "update", lambda n, m, j=judged[name]: j.append(m))
    for p, ref in zip(prompts, refs, strict=True):  # alone: more steps without any match
        rid = eng.submit(p, MAX_NEW)
        assert eng.run_until_done()[rid] == ref
    for found, k, ks in steps:
        assert k == (ks[0] if found else ks[1])
    assert {k for found, k, _ in steps if found} == {k_found}
    assert {k for found, k, _ in steps if not found} == {0, 1}  # plain steps, and probes
    # each verified row judged its step's source: the probes' one head token, the lookup's k
    probes = sum(1 for found, k, _ in steps if not found and k)
    assert judged["heads"] == [1] * probes and set(judged["lookup"]) == {k_found}
    fixed = make_engine(model, draft=medusa_draft(model, lookup_ngram=2), num_draft_tokens=6)
    assert (fixed.num_draft_tokens, fixed.heads_draft_tokens) == (6, 4)  # 4 heads
    rids = [fixed.submit(p, MAX_NEW) for p in prompts]
    out = fixed.run_until_done()
    assert [out[r] for r in rids] == refs
    fixed._heads_acceptance.add(1000, 1000)
    eng._heads_acceptance, eng.heads_draft_tokens = fixed._heads_acceptance, None
    eng._choose_k()
    assert eng.heads_draft_tokens == 4  # the heads, always right, draft all they have
    assert make_engine(model, draft=medusa_draft(model)).stats()["heads_draft_tokens"] is None


def test_a_step_without_any_match_is_a_plain_step(model):
    """Prompt lookup with no running row whose last n-gram occurred before: the step decodes one
    token per row instead of verifying filler, proposes nothing and judges nothing."""
    eng = make_engine(model, draft=PromptLookup(min_ngram=3, max_ngram=3))
    distinct = list(range(10, 40))
    rid = eng.submit(distinct, 3)
    before = eng.acceptance.tested
    assert eng.run_until_done()[rid] == generate(model, [distinct], max_new_tokens=3).tokens[0]
    s = eng.stats()
    assert s["draft_proposed"] == 0 and s["decode_steps"] == s["generated_tokens"] == 3
    assert eng.acceptance.tested == before


def test_model_draft_pool_follows_the_target(tiny_model):
    """The target as its own draft: its pool (same page ids, prefilled with the target's chunks,
    copied with its pages, reused on prefix hits, re-fed after a fully accepted step) holds the
    target's own keys, so every drafted token is accepted, through preemptions and prefix hits;
    greedy output equals ``generate`` alone."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (29, 37, 1, 22)]
    refs = [generate(tiny_model, [p], max_new_tokens=MAX_NEW).tokens[0] for p in prompts]
    eng = make_engine(tiny_model, num_pages=10, draft=tiny_model)
    arrivals(eng, prompts, refs, [0, 1, 2, 0, 3, 1, 2])
    s = eng.stats()
    assert s["preemptions"] > 0 and s["prefix_cache_hits"] > 0, s
    assert s["draft_proposed"] > 0 and s["draft_accepted"] == s["draft_proposed"]
    assert_clean(eng)


def eagle_pool_check(model, head, checked: list):
    """An ``arrivals`` callback: after a step, each running row's head pool (at its pages) and
    its slot's feature equal the head's uncached run over the row's whole sequence (rows whose
    slot state is another request's, or at another token count, skipped)."""

    def check(eng):
        runner, P = eng.runner, eng.page_size
        for req in eng.scheduler.running:
            L = req.computed
            if runner._hidden_of[req.row] != (req.rid, len(req.tokens)) or L < 2:
                continue
            x = jnp.asarray(req.tokens[: L + 1])[None]
            _, h = model(x[:, :L], return_hidden=True)
            cache = head.cache(1, L + 8)
            kv = (cache.k[0], cache.v[0], jnp.zeros(1, jnp.int32), None)
            f, (kc, _) = head.features(h, model.embed(x[:, 1:]), jnp.arange(L)[None], kv=kv)
            pages = eng.scheduler.tables.rows[req.row][: -(-L // P)]
            pool = np.asarray(runner.draft_k[0])[np.asarray(pages)].reshape(-1, *kc.shape[2:])
            np.testing.assert_allclose(pool[:L], np.asarray(kc[0, :L]), atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(runner.hidden[req.row], f[0, L - 1], atol=2e-5, rtol=2e-5)
            checked.append(req.rid)

    return check


def eagle_arrivals_checked(eng, model, head, prompts, refs) -> dict:
    """``arrivals`` with :func:`eagle_pool_check` after every step, on a pool small enough to
    preempt and prompts that share prefixes -> the engine's stats (both seen; the engine clean
    after)."""
    checked = []
    order = [0, 1, 2, 0, 3, 1, 4, 2]
    arrivals(eng, prompts, refs, order, after_step=eagle_pool_check(model, head, checked))
    s = eng.stats()
    assert s["preemptions"] > 0 and s["prefix_cache_hits"] > 0, s
    assert len(checked) > 20
    assert_clean(eng)
    return s


def test_eagle_pool_follows_the_target(model, prompts, refs):
    """The EAGLE head's pool (the target's page ids; pairs of each chunk's hidden states and
    the tokens after them at prefill, of each verification's kept positions after it; copied
    with its pages; shared on prefix hits only where the token after the page agrees too) and
    each slot's feature are, after every step, the head's uncached run over the row's whole
    sequence: through preemptions, prefix hits and arrivals; greedy output is ``generate``'s."""
    head = echo_head(model)
    eng = make_engine(model, num_pages=12, draft=Eagle(head))
    s = eagle_arrivals_checked(eng, model, head, prompts, refs)
    assert s["draft_accepted"] > 0


def test_eagle_decodes_plainly_where_no_k_pays_and_probes(model, monkeypatch, prompts, refs):
    """Where no k pays the rule chooses k = 0 for an EAGLE head too: plain decode steps feed
    each row's pair (its hidden state, the token drawn) into the head's pool and keep its
    feature, so after every step pool and feature are still the head's uncached run over the
    row (as after verifications), and one step in ``PROBE_EVERY`` verifies one head token per
    row, so the head is still judged and k can come back; greedy output stays ``generate``'s,
    through preemptions and prefix hits."""
    from decoding import engine as engine_mod

    steep = tuple(1.0 + 8.0 * t for t in range(drafts.MAX_K + 1))
    monkeypatch.setattr(drafts, "measure_step_costs", lambda *a, **kw: steep)
    monkeypatch.setattr(engine_mod, "PROBE_EVERY", 4)
    head = echo_head(model)
    eng = make_engine(model, num_pages=12, draft=Eagle(head), num_draft_tokens=None)
    assert eng.num_draft_tokens == 0
    plain, decode = [], eng.runner.decode

    def counted(rows, *a, **kw):
        plain.append(len(rows))
        return decode(rows, *a, **kw)

    monkeypatch.setattr(eng.runner, "decode", counted)
    s = eagle_arrivals_checked(eng, model, head, prompts, refs)
    assert 0 < s["draft_proposed"] < s["generated_tokens"] / 2  # probes, one token per row
    assert s["draft_accepted"] > 0 and eng.acceptance.tested > 0
    assert sum(1 for n in plain if n) > s["decode_steps"] / 2  # most steps were plain ones
    eng.acceptance.add(1000, 1000)  # the head seen to be always right: drafting pays again
    monkeypatch.setattr(drafts, "measure_step_costs", lambda *a, **kw: steep[:1] * 9)
    eng._step_costs.cache_clear()
    eng._observed = drafts.ObservedCosts()
    eng._choose_k()
    assert eng.num_draft_tokens > 0


def test_eagle_prefix_pages_agree_on_the_next_token(model):
    """With an EAGLE head a page is shared only by sequences that agree on the token after it
    too (the head's pair at the page's last position reads it): a prompt that differs from a
    cached one only at that token gets no hit on that page; one that agrees does."""
    rng = np.random.default_rng(5)
    base = rng.integers(0, 256, 3 * PAGE + 3).tolist()
    other = base[:PAGE] + [(base[PAGE] + 1) % 256] + base[PAGE + 1 :]
    for draft, want in ((Eagle(echo_head(model)), 0), (PromptLookup(), 1)):
        eng = make_engine(model, draft=draft)
        eng.submit(base, 2)
        eng.run_until_done()
        hits = eng.stats()["prefix_cache_hits"]
        eng.submit(other, 2)  # page 0 agrees; the token after it does not
        eng.run_until_done()
        assert eng.stats()["prefix_cache_hits"] - hits == want
        eng.submit(base, 2)
        eng.run_until_done()
        assert eng.stats()["prefix_cache_hits"] - hits >= want + 2
