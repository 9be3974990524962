"""``benchmarks.gpu_suite``'s bookkeeping on CPU (the sections themselves need a GPU): rows land
in the JSON one by one, replace the rows of the same section and name, a section's exception
becomes a failed row, and a check emitted as it landed is written once."""

from __future__ import annotations

import json
import types

import pytest

from benchmarks import gpu_suite


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(gpu_suite.jax, "default_backend", lambda: "gpu")
    device = types.SimpleNamespace(device_kind="Fake GPU")
    monkeypatch.setattr(gpu_suite.jax, "devices", lambda: [device])
    seen = []

    def check(runs, emit, only):
        rows = []
        for name in ("check-a", "check-b"):
            if only and only not in name:
                continue
            rows.append(dict(section="check", name=name, value=0.1, unit="err/bound", ok=True))
            emit(rows[-1])
            seen.append(json.loads((out_dir[0] / "gpu_suite_fake_gpu.json").read_text())["rows"])
        return rows

    def boom(runs, emit, only):
        raise RuntimeError("kernel exploded")

    out_dir = []
    monkeypatch.setattr(gpu_suite, "SECTIONS", {"check": check, "boom": boom})
    return out_dir, seen


def test_rows_land_one_by_one_and_replace_by_name(fake_gpu, tmp_path, capsys):
    out_dir, seen = fake_gpu
    out_dir.append(tmp_path)
    path = tmp_path / "gpu_suite_fake_gpu.json"
    kept = dict(section="decode", name="B1", value=500.0, unit="GB/s", ok=True)
    old = dict(section="check", name="check-a", value=9.0, unit="err/bound", ok=False)
    path.write_text(json.dumps({"rows": [kept, old]}))
    assert gpu_suite.main(["--sections", "check", "--out", str(tmp_path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["section"], r["name"], r["value"]) for r in rows] == [
        ("decode", "B1", 500.0),
        ("check", "check-a", 0.1),
        ("check", "check-b", 0.1),
    ]
    assert len(seen[0]) == 2  # check-a written before check-b ran
    assert capsys.readouterr().out.count("'name': 'check-a'") == 1  # emitted once


def test_a_failing_section_is_a_failed_row_and_the_next_one_runs(fake_gpu, tmp_path):
    out_dir, _ = fake_gpu
    out_dir.append(tmp_path)
    args = ["--sections", "boom,check", "--checks", "check-b", "--out", str(tmp_path)]
    assert gpu_suite.main(args) == 1
    rows = json.loads((tmp_path / "gpu_suite_fake_gpu.json").read_text())["rows"]
    assert [(r["section"], r["name"], r["ok"]) for r in rows] == [
        ("boom", "error", False),
        ("check", "check-b", True),
    ]
    assert "kernel exploded" in rows[0]["error"]


def test_unknown_section_is_an_error(fake_gpu, tmp_path):
    with pytest.raises(SystemExit):
        gpu_suite.main(["--sections", "nope", "--out", str(tmp_path)])
