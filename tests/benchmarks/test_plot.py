"""``python -m benchmarks plot``: recipes render synthetic and committed results into PNGs."""

from __future__ import annotations

import json

import pytest

from benchmarks import __main__ as cli
from benchmarks import registry
from benchmarks.plot import Plot, render_all

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _payload(name):
    rows = [
        dict(impl=impl, T=T, causal=c, ms=T * (1 + i), MiB=float(T))
        for i, impl in enumerate(("a", "b"))
        for T in (64, 128, 256)
        for c in (False, True)
    ]
    rows.append(dict(impl="a", T=512, causal=True, error="OOM"))  # no y value: skipped
    machine = dict(device="cpu", backend="cpu")
    return dict(name=name, date="2026-01-02T03:04:05+00:00", machine=machine, rows=rows)


def test_plot_renders_each_recipe_of_matching_results(tmp_path):
    (tmp_path / "synth.json").write_text(json.dumps(_payload("synth")))
    (tmp_path / "synth_quick.json").write_text(json.dumps(_payload("synth_quick")))
    (tmp_path / "other.json").write_text(json.dumps(_payload("other")))  # no recipe
    recipes = {
        "synth": (
            Plot("lines", x="T", y=("ms", "MiB"), series=("impl",), facet="causal", logx=True),
            Plot("bars", x=("impl", "T"), y=("ms", "MiB"), kind="bar", overlay=True),
            Plot("none", x="T", y=("ms",), where=(("impl", "zzz"),)),  # no rows: no file
        )
    }
    out = tmp_path / "png"
    written = render_all(tmp_path, recipes, out)
    names = sorted(p.name for p in written)
    assert names == [
        "synth_bars.png",
        "synth_lines.png",
        "synth_quick_bars.png",
        "synth_quick_lines.png",
    ]
    for path in written:
        assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000


def test_plot_recipe_rejects_bad_fields():
    with pytest.raises(ValueError, match="kind"):
        Plot("p", x="T", y=("ms",), kind="pie")
    with pytest.raises(TypeError, match="y"):
        Plot("p", x="T", y="ms")
    with pytest.raises(TypeError, match="x"):
        Plot("p", x=("a", "b"), y=("ms",))


def test_every_listed_recipe_renders_the_committed_results(tmp_path, capsys):
    recipes = registry.plot_recipes()
    assert {"attention_cpu", "decode_cpu", "generate_cpu"} <= set(recipes)
    assert cli.main(["plot", "--out-dir", str(tmp_path)]) == 0
    produced = {p.name for p in tmp_path.glob("*.png")}
    assert {"attention_cpu_time.png", "decode_cpu_time.png"} <= produced
    assert "wrote" in capsys.readouterr().out


@pytest.mark.slow  # ~20 s on 2 loaded cores: ten small compilations
def test_gpu_recipes_draw_the_rows_the_gpu_code_paths_write(tmp_path):
    """The GPU branches of the scripts run off GPU on tiny shapes (stand-in impls), and their
    rows, as written, render with the GPU recipes; so the recipes cannot drift from the keys."""
    from benchmarks import attention, decode

    impls = {"pallas": attention.ours("reference"), "cudnn": attention.jax_nn("xla")}
    rows, _ = attention.run_gpu(1, impls=impls, configs=[(8, 64, True), (16, 64, True)], tokens=16)
    drows = decode.run([(1, 16, None), (1, 32, None)], "xla", "float32", 1, bundled=False)
    recipes = registry.plot_recipes()
    for name, part in (("attention_gpu", rows), ("decode_gpu", drows)):
        (tmp_path / f"{name}.json").write_text(json.dumps(dict(name=name, rows=part)))
    written = render_all(tmp_path, recipes)
    assert {p.name for p in written} == {
        f"{name}_{plot.name}.png"
        for name in ("attention_gpu", "decode_gpu")
        for plot in recipes[name]
    }
