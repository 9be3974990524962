"""The benchmark harness: warm-up and median logic, the results JSON, the registry and ``all``."""

from __future__ import annotations

import json

import pytest

from benchmarks import __main__ as cli
from benchmarks import common, registry


class _Clock:
    """A fake ``perf_counter`` whose timed intervals are the given durations, in order."""

    def __init__(self, durations):
        self.durations = list(durations)
        self.now = 0.0
        self.started = False

    def __call__(self):
        if self.started:  # end of a timed call
            self.now += self.durations.pop(0)
        self.started = not self.started
        return self.now


def test_measure_warms_up_untimed_then_takes_the_median(monkeypatch):
    calls = []
    monkeypatch.setattr(common.time, "perf_counter", _Clock([5.0, 1.0, 3.0, 2.0, 4.0]))
    m = common.measure(lambda x: calls.append(x) or len(calls), 7, runs=5, warmup=2)
    assert calls == [7] * 7  # 2 warm-up + 5 timed calls
    assert m.times == (5.0, 1.0, 3.0, 2.0, 4.0)  # warm-up calls never touched the clock
    assert (m.median, m.min, m.result) == (3.0, 1.0, 7)


def test_time_fn_is_the_median_of_an_even_number_of_runs(monkeypatch):
    monkeypatch.setattr(common.time, "perf_counter", _Clock([4.0, 1.0, 2.0, 10.0]))
    assert common.time_fn(lambda: None, runs=4, warmup=0) == 3.0


@pytest.mark.parametrize("kwargs", [dict(runs=0), dict(runs=1.5), dict(warmup=-1)])
def test_measure_rejects_bad_counts(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        common.measure(lambda: None, **kwargs)


def test_results_json_records_machine_versions_date_and_load(tmp_path):
    rows = [dict(impl="xla", T=8, ms=1.5)]
    path = common.write_results("unit", rows, results_dir=tmp_path, runs=3)
    payload = json.loads(path.read_text())
    assert path == tmp_path / "unit.json"
    assert payload["rows"] == rows and payload["runs"] == 3 and payload["name"] == "unit"
    assert payload["machine"]["backend"] in ("cpu", "gpu", "tpu")
    assert {"python", "jax", "jaxlib", "numpy"} <= set(payload["versions"])
    assert payload["versions"]["jax"] == payload["machine"]["jax"]
    assert set(payload["machine"]["cpu_features"]) <= set(common.CPU_FEATURES)
    assert payload["date"].endswith("+00:00")
    assert len(payload["load_average"]) == 3


def test_cpu_model_reads_the_model_name_and_the_kernels_instruction_sets(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx avx2 fma avx512f "
        "avx512_vnni\n\nprocessor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2\n"
    )
    real_path = common.Path
    monkeypatch.setattr(common, "Path", lambda p: cpuinfo if p == "/proc/cpuinfo" else real_path(p))
    assert common.cpu_model() == ("AMD EPYC", ["avx2", "fma", "avx512f", "avx512_vnni"])
    monkeypatch.setattr(common, "Path", lambda p: tmp_path / "missing")
    assert common.cpu_model() == (None, [])


def test_finish_writes_quick_results_apart_and_prints_the_table(tmp_path, capsys):
    args = common.parser("doc line\nmore").parse_args(
        ["--quick", "--runs", "2", "--results-dir", str(tmp_path)]
    )
    path = common.finish(args, "unit", [dict(a=1, b=0.123456)], ["a", "b"])
    assert path.name == "unit_quick.json"
    payload = json.loads(path.read_text())
    assert (payload["quick"], payload["runs"], payload["warmup"]) == (True, 2, 1)
    assert "0.1235" in capsys.readouterr().out


def test_parser_rejects_zero_runs():
    with pytest.raises(SystemExit):
        common.parser("doc").parse_args(["--runs", "0"])


def test_registry_lists_existing_script_modules():
    for script in registry.SCRIPTS:
        path = registry.BENCHMARKS_DIR / f"{script.name}.py"
        assert path.is_file(), script
        assert '__name__ == "__main__"' in path.read_text(), script
    assert "attention" not in registry.unlisted()
    with pytest.raises(ValueError, match="only"):
        registry.scripts("cpu", only=["no_such_script"])


def test_all_dry_run_lists_every_cpu_script_with_its_quick_arguments(capsys):
    assert cli.main(["all", "--quick", "--dry-run", "--backend", "cpu"]) == 0
    lines = [x for x in capsys.readouterr().out.splitlines() if not x.startswith("note:")]
    expected = registry.scripts("cpu")
    assert len(lines) == len(expected) >= 3
    for line, script in zip(lines, expected, strict=True):
        assert line.endswith(" ".join([f"benchmarks.{script.name}", *script.quick]))
