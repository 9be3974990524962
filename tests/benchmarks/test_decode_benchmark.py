"""benchmarks.decode's CPU rows at code-target's and SmolLM2's shapes."""

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


def test_smollm2_heads_times_decode_and_verification(monkeypatch):
    monkeypatch.setitem(decode.SMOLLM2, "layers", 2)
    rows = decode.smollm2_heads(runs=1, warmup=0, quick=True)
    if not native.available():  # the native kernel's rows only
        assert rows == []
        return
    assert [(r["B"], r["S"], r["kv_dtype"], r["Tq"]) for r in rows] == [
        (1, S, c, Tq) for S in (256, 1024, 4096) for c in ("float32", "bfloat16") for Tq in (1, 2)
    ]
    assert all(r["case"] == "smollm2" and r["ms"] > 0 and r["GB_per_s"] > 0 for r in rows)
