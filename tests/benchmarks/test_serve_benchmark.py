"""The serving benchmark's bookkeeping (no model, no server)."""

import math

import pytest

from benchmarks import serve


def test_static_padding_counts_each_batch_at_its_longest():
    # batch 2: rows (3 + 1) and (1 + 5) both run for prompt 3 and output 5
    requests = [([0] * 3, 1), ([0] * 1, 5), ([0] * 2, 2)]
    need = 4 + 6 + 4
    assert serve.static_padding(requests, 2) == pytest.approx((2 * 8 + 1 * 4) / need)
    assert serve.static_padding(requests, 1) == 1.0


def test_saturation_ratios_at_the_highest_rate():
    rows = [
        dict(system="decoding.serve", rate=1.0, requests_per_s=1.0),
        dict(system="decoding.serve", rate=math.inf, requests_per_s=6.0),
        dict(system="transformers batch 8", rate=1.0, requests_per_s=0.9),
        dict(system="transformers batch 8", rate=math.inf, requests_per_s=1.5),
    ]
    assert serve.saturation_ratios(rows) == {"transformers batch 8": pytest.approx(4.0)}


def test_saturation_ratios_from_the_saturation_pass():
    # the inf rate over the rates' 64 requests, then the saturation pass over 256: the latter
    rows = [
        dict(system="decoding.serve", rate=math.inf, requests=64, requests_per_s=4.0),
        dict(system="decoding.serve", rate=math.inf, requests=256, requests_per_s=6.0),
        dict(system="transformers batch 8", rate=math.inf, requests=64, requests_per_s=0.8),
        dict(system="transformers batch 8", rate=math.inf, requests=256, requests_per_s=0.75),
    ]
    assert serve.saturation_ratios(rows) == {"transformers batch 8": pytest.approx(8.0)}


def test_passes_are_the_rates_then_the_saturation_pass():
    few, many = [([1], 2)], [([1], 2), ([3], 4)]
    assert serve.passes(few, [1.0, math.inf], many) == [
        (1.0, few),
        (math.inf, few),
        (math.inf, many),
    ]
    assert serve.passes(few, [1.0], []) == [(1.0, few)]


def test_engine_breakdown_from_stats_deltas():
    def stats(generated, busy, steps, prefill, compile_s=0.0):
        tps = generated / (busy - compile_s) if busy > compile_s else 0.0
        return dict(
            generated_tokens=generated,
            tokens_per_s=tps,
            compile_s=compile_s,
            decode_steps=steps,
            prefill_tokens=prefill,
            preemptions=0,
        )

    out = serve.engine_breakdown(stats(100, 10.0, 20, 50, 2.0), stats(400, 16.0, 50, 150, 2.0), 8.0)
    assert out["engine_busy_frac"] == pytest.approx(6.0 / 8.0)
    assert out["mean_decode_rows"] == pytest.approx(300 / 30)
    assert out["prefill_tokens"] == 100
    assert out["compile_s"] == 0.0
