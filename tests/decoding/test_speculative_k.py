"""The draft length chosen from measured step costs: injected cost tables (deterministic) pick a
small k for a compute-bound target and a larger one for a memory-bound target; the measuring
function itself times every Tq once per shape; ``speculative_generate`` uses the rule."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import random_transformer

from decoding import PromptLookup, drafts, speculative
from decoding.drafts import (
    AcceptanceEstimate,
    ObservedCosts,
    StepCosts,
    choose_num_draft_tokens,
    expected_tokens,
    measure_step_costs,
)
from decoding.speculative import speculative_generate

K = 8
COMPUTE_BOUND = StepCosts(tuple(1.0 + 0.9 * t for t in range(K + 1)))  # Tq = t + 1
MEMORY_BOUND = StepCosts(tuple(1.0 + 0.03 * t for t in range(K + 1)))


def test_expected_tokens():
    assert expected_tokens(3, 0.0) == 1.0
    assert expected_tokens(3, 1.0) == 4.0
    assert expected_tokens(2, 0.5) == pytest.approx(1.75)


@pytest.mark.parametrize("a", [0.3, 0.5, 0.8])
def test_compute_bound_small_k_memory_bound_larger(a):
    small = choose_num_draft_tokens(COMPUTE_BOUND, a)
    large = choose_num_draft_tokens(MEMORY_BOUND, a)
    assert small == 1
    assert large > small
    assert large >= 3 if a >= 0.5 else large >= 2


def test_k_grows_with_acceptance_and_shrinks_with_draft_cost():
    ks = [choose_num_draft_tokens(MEMORY_BOUND, a) for a in (0.2, 0.5, 0.8, 0.95)]
    assert ks == sorted(ks) and ks[-1] > ks[0]
    cheap = choose_num_draft_tokens(MEMORY_BOUND._replace(draft=0.01), 0.8)
    dear = choose_num_draft_tokens(MEMORY_BOUND._replace(draft=0.5), 0.8)
    assert dear < cheap
    assert choose_num_draft_tokens(MEMORY_BOUND, 0.99, max_k=3) == 3
    # The rule itself: no other k has more expected tokens per second.
    best = choose_num_draft_tokens(MEMORY_BOUND, 0.7)
    rate = [expected_tokens(k, 0.7) / MEMORY_BOUND.target[k] for k in range(1, K + 1)]
    assert rate[best - 1] == max(rate)
    with pytest.raises(ValueError, match="K >= 1"):
        choose_num_draft_tokens(StepCosts((1.0,)), 0.5)


def test_acceptance_estimate_starts_at_the_prior_and_follows_observations():
    est = AcceptanceEstimate(0.5, weight=10, horizon=1e9)
    assert est.rate == 0.5
    for _ in range(30):
        est.update(3, 3)  # every drafted token accepted: nothing rejected
    assert est.rate == pytest.approx((90 + 5) / (90 + 10), rel=1e-6)
    for _ in range(300):
        est.update(0, 4)  # the first token rejected: one position tested
    assert est.rate < 0.3


def test_acceptance_estimate_recovers_the_per_token_rate_at_any_k():
    # Steps that accept each token with probability a until the first rejection: the estimate
    # is a (the rate expected_tokens assumes), where accepted / proposed falls with k.
    rng, naive = np.random.default_rng(0), []
    for k in (2, 6):
        est, accepted = AcceptanceEstimate(0.5, weight=1.0, horizon=1e9), 0
        for _ in range(4000):
            n = 0
            while n < k and rng.random() < 0.7:
                n += 1
            est.update(n, k)
            accepted += n
        assert est.rate == pytest.approx(0.7, abs=0.02)
        naive.append(accepted / (4000 * k))
    assert naive[0] < 0.65 and naive[1] < 0.4  # (a + .. + a^k) / k: 0.6 and 0.34


def test_acceptance_estimate_follows_the_workload_running_now():
    est = AcceptanceEstimate(0.5, weight=4, horizon=64)
    for _ in range(500):
        est.update(0, 4)  # open chat: nothing copies
    assert est.rate < 0.1
    for _ in range(100):
        est.update(4, 4)  # then a copy task: every token accepted
    assert est.rate > 0.9  # the old rejections have faded (without fading: 400 / 900)


def test_measured_costs_keep_each_tqs_fastest_call_and_never_fall_with_tq(monkeypatch):
    model = random_transformer(seed=7, num_layers=1)
    # Two rounds of (Tq = 1, Tq = 2): durations 3, 1 then 2, 5.
    reads = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0, 30.0, 35.0])
    monkeypatch.setattr(drafts.time, "perf_counter", lambda: next(reads))
    drafts._COSTS.clear()
    try:
        costs = measure_step_costs(model, 2, batch=1, context=8, repeats=2)
    finally:
        drafts._COSTS.clear()
    assert costs == (2.0, 2.0)  # Tq = 1: min(3, 2); Tq = 2: min(1, 5) raised to Tq = 1's


def test_measure_step_costs_times_each_tq_once_per_shape(monkeypatch):
    model = random_transformer(seed=5, num_layers=1)
    calls = []
    real = drafts.time.perf_counter
    monkeypatch.setattr(drafts.time, "perf_counter", lambda: calls.append(1) or real())
    costs = measure_step_costs(model, 2, batch=2, context=16, repeats=2)
    assert len(costs) == 2 and all(c > 0 for c in costs)
    assert len(calls) == 2 * 2 * 2  # two timer reads per repeat per Tq
    again = measure_step_costs(random_transformer(seed=6, num_layers=1), 2, batch=2, context=16)
    assert again is costs and len(calls) == 8  # same shapes and dtypes: cached, not re-timed
    with pytest.raises(ValueError, match="max_tq"):
        measure_step_costs(model, 0)


def test_speculative_generate_uses_the_rule(monkeypatch):
    target = random_transformer(seed=0, num_layers=1)
    for costs, want in ((COMPUTE_BOUND, 1), (MEMORY_BOUND, None)):
        monkeypatch.setattr(drafts, "measure_step_costs", lambda *a, c=costs, **k: c.target)
        monkeypatch.setattr(speculative, "_ESTIMATES", {})  # nothing observed yet: the prior
        monkeypatch.setattr(speculative, "_LAST_K", {})
        res = speculative_generate(target, PromptLookup(), [[1, 2, 3, 1, 2]], max_new_tokens=3)
        prior = drafts.PRIOR_ACCEPTANCE["prompt-lookup"]
        want = want or choose_num_draft_tokens(costs, prior, draft_calls=lambda k: 0)
        assert res.stats["num_draft_tokens"] == want
    assert want > 1


def test_zero_only_when_allowed_and_when_no_k_pays():
    """k = 0 (a plain step) is a choice only with ``allow_zero``, and wins where verification
    costs as much as the tokens it may save: a compute-bound target at low acceptance."""
    assert choose_num_draft_tokens(COMPUTE_BOUND, 0.2) >= 1
    assert choose_num_draft_tokens(COMPUTE_BOUND, 0.2, allow_zero=True) == 0
    assert choose_num_draft_tokens(MEMORY_BOUND, 0.5, allow_zero=True) > 0


def test_rows_without_a_draft_weigh_against_verifying():
    """``drafting`` f: rows with nothing to propose emit one token at a verification's cost.
    Verification at 1.45 decode steps and a = 0.45 roughly breaks even when every row drafts,
    and loses when a fifth of them has no match (SmolLM2's engine at batch 8)."""
    costs = StepCosts((1.0, 1.45, 1.9))
    assert choose_num_draft_tokens(costs, 0.5, allow_zero=True) == 1
    assert choose_num_draft_tokens(costs, 0.5, allow_zero=True, drafting=0.8) == 0
    assert choose_num_draft_tokens(MEMORY_BOUND, 0.5, allow_zero=True, drafting=0.3) > 0
    for f in (0.0, 1e-9):  # nothing ever drafted: a plain step (or the smallest k)
        assert choose_num_draft_tokens(MEMORY_BOUND, 0.9, allow_zero=True, drafting=f) == 0
        assert choose_num_draft_tokens(MEMORY_BOUND, 0.9, drafting=f) == 1


def test_observed_costs_replace_measured_ones_and_scale_the_rest():
    """Observed step times replace the measured cost of their k; a k not observed keeps its
    measured cost times the mean observed / measured ratio; a draft's calls are folded in."""
    measured = StepCosts((1.0, 1.2, 1.4, 1.6), draft=0.5)
    obs = ObservedCosts()
    assert obs.apply(measured, lambda k: k).target == (1.0, 1.7, 2.4, 3.1)  # nothing observed
    obs.observe(1, 3.4)  # twice its measured 1.7
    assert obs.count(1) == 1 and obs.count(0) == 0
    assert obs.apply(measured, lambda k: k) == StepCosts((2.0, 3.4, 4.8, 6.2), 0.0)
    obs.observe(0, 1.0)  # ratios 1 and 2: the others scale by 1.5
    out = obs.apply(measured, lambda k: k).target
    assert out[:2] == (1.0, 3.4) and np.allclose(out[2:], (3.6, 4.65))
    for _ in range(200):  # a running mean over the last HORIZON_STEPS or so
        obs.observe(0, 2.0)
    assert abs(obs.seconds[0] - 2.0) < 1e-3 and obs.count(0) == ObservedCosts.HORIZON_STEPS
    obs = ObservedCosts()
    obs.observe(0, 1.0)
    obs.observe(0, 3.0)
    assert obs.seconds[0] == 2.0  # the mean of the first observations


def test_speculative_generate_follows_the_acceptance_it_observed(monkeypatch):
    """Each call adds its verifications' judged positions to the process's estimate for the
    (target, draft kind), and the next call with num_draft_tokens=None chooses k at that rate."""
    target = random_transformer(seed=0, num_layers=1)
    monkeypatch.setattr(drafts, "measure_step_costs", lambda *a, **k: MEMORY_BOUND.target)
    monkeypatch.setattr(speculative, "_ESTIMATES", {})
    monkeypatch.setattr(speculative, "_LAST_K", {})
    draft = PromptLookup()
    est = speculative.acceptance_estimate(target, draft, None)
    assert est.rate == drafts.PRIOR_ACCEPTANCE["prompt-lookup"] and est.tested == 0
    first = speculative_generate(target, draft, [[1, 2, 3] * 5], max_new_tokens=24)
    assert est.tested > 0  # the positions its verifications judged
    kept = first.stats["num_draft_tokens"]
    want = choose_num_draft_tokens(MEMORY_BOUND, est.rate, draft_calls=lambda k: 0, keep=kept)
    second = speculative_generate(target, draft, [[1, 2, 3] * 5], max_new_tokens=24)
    assert second.stats["num_draft_tokens"] == want
    assert second.tokens == first.tokens  # k never changes the (greedy) output


def test_the_k_in_use_stays_unless_another_is_clearly_faster():
    """``keep``: near the optimum the expected rate is flat in k; the k in use stays unless the
    best is more than KEEP_MARGIN faster (each new k is a compilation)."""
    a = 0.6
    best = choose_num_draft_tokens(MEMORY_BOUND, a)
    rate = lambda k: drafts.expected_tokens(k, a) / MEMORY_BOUND.target[k]  # noqa: E731
    near = [
        k for k in range(1, 9) if k != best and rate(best) <= rate(k) * (1 + drafts.KEEP_MARGIN)
    ]
    far = [k for k in range(1, 9) if rate(best) > rate(k) * (1 + drafts.KEEP_MARGIN)]
    assert near and far
    for k in near:
        assert choose_num_draft_tokens(MEMORY_BOUND, a, keep=k) == k
    for k in far:
        assert choose_num_draft_tokens(MEMORY_BOUND, a, keep=k) == best
