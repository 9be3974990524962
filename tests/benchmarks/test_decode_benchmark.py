"""benchmarks.decode's CPU rows at code-target's shapes."""

from __future__ import annotations

from benchmarks import decode
from pallas_attn import native


def test_small_heads_times_both_paths(monkeypatch):
    monkeypatch.setattr(decode, "SMALL_CALLS", 3)
    rows = decode.small_heads(runs=1, warmup=0)
    impls = {"native", "xla"} if native.available() else {"xla"}
    assert {(r["impl"], r["Tq"]) for r in rows} == {(i, t) for i in impls for t in (1, 3, 5)}
    for r in rows:
        assert r["case"] == "code-target" and r["S"] == decode.SMALL["S"] and r["us_per_call"] > 0
