"""Plot recipes and their rendering: results JSON -> PNG (matplotlib, Agg backend).

A script declares ``PLOTS = {"<results name>": (Plot(...), ...)}``; ``python -m benchmarks plot``
renders, for every ``benchmarks/results/*.json`` whose name (less a ``_quick`` suffix) has a
recipe, ``<json stem>_<plot name>.png`` beside it. The title carries the device, the date and the
load average, so a PNG is never separated from where it was measured.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

KINDS = ("line", "bar")


@dataclasses.dataclass(frozen=True)
class Plot:
    """How to draw one figure from the ``rows`` of a results file.

    Attributes:
      name: the PNG is ``<results stem>_<name>.png``.
      x: the x row key (numeric, for ``kind="line"``), or keys joined into bar category labels.
      y: row keys to plot; one panel each, or all in one panel when ``overlay``.
      series: row keys whose values tell the lines (bar groups) of a panel apart.
      facet: a row key; one row of panels per value.
      where: ``((key, value), ...)``; only rows with these values are drawn.
      kind: ``"line"`` or ``"bar"``.
    """

    name: str
    x: str | tuple[str, ...]
    y: tuple[str, ...]
    series: tuple[str, ...] = ()
    facet: str | None = None
    where: tuple[tuple[str, Any], ...] = ()
    kind: str = "line"
    overlay: bool = False
    logx: bool = False
    logy: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not self.y or isinstance(self.y, str):
            raise TypeError(f"y must be a non-empty tuple of row keys, got {self.y!r}")
        if self.kind == "line" and not isinstance(self.x, str):
            raise TypeError(f"a line plot needs one numeric x key, got {self.x!r}")


def _label(row: dict, keys) -> str:
    return ", ".join(f"{k}={row.get(k)}" for k in keys)


def _x_value(plot: Plot, row: dict):
    if isinstance(plot.x, str):
        return row.get(plot.x)
    return " ".join(str(row.get(k)) for k in plot.x)


def _selected(plot: Plot, rows: list[dict]) -> list[dict]:
    keep = [r for r in rows if all(r.get(k) == v for k, v in plot.where)]
    return [r for r in keep if _x_value(plot, r) is not None]


def _title(payload: Mapping) -> str:
    mach = payload.get("machine", {})
    load = payload.get("load_average") or [payload.get("load_average_1min")]
    load_text = "unknown" if load[0] is None else f"{load[0]:.1f}"
    return (
        f"{payload.get('name', '?')}: {mach.get('device', '?')} ({mach.get('backend', '?')}), "
        f"{str(payload.get('date', '?'))[:10]}, load avg {load_text}"
    )


def _draw_panel(ax, plot: Plot, rows: list[dict], ys: tuple[str, ...]) -> None:
    ax.set_xscale("log" if plot.logx else "linear")
    ax.set_yscale("log" if plot.logy else "linear")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in plot.series), []).append(r)
    lines = [(key, y) for key in groups for y in ys]
    categories = list(dict.fromkeys(_x_value(plot, r) for r in rows))
    width = 0.8 / max(len(lines), 1)
    for n, (key, y) in enumerate(lines):
        pts = [(_x_value(plot, r), r[y]) for r in groups[key] if r.get(y) is not None]
        parts = [y] if len(ys) > 1 else []
        parts += [_label(dict(zip(plot.series, key, strict=True)), plot.series)] * bool(plot.series)
        label = ", ".join(parts) or y
        if plot.kind == "line":
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        else:
            where = [categories.index(p[0]) + (n - (len(lines) - 1) / 2) * width for p in pts]
            ax.bar(where, [p[1] for p in pts], width=width, label=label)
    if plot.kind == "bar":
        ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    elif plot.logx:  # label the measured x values, not powers of ten
        ax.set_xticks(sorted(categories), [f"{x:g}" for x in sorted(categories)])
        ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    ax.set_xlabel(plot.x if isinstance(plot.x, str) else " ".join(plot.x))
    ax.set_ylabel(ys[0] if len(ys) == 1 else ", ".join(ys))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def render(payload: Mapping, plot: Plot, path: Path) -> Path | None:
    """Draws ``plot`` from ``payload["rows"]`` into ``path``; None (nothing written) when no row fits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _selected(plot, list(payload.get("rows", [])))
    if not rows:
        return None
    facets = [None] if plot.facet is None else list(dict.fromkeys(r[plot.facet] for r in rows))
    panels = [plot.y] if plot.overlay else [(y,) for y in plot.y]
    fig, axes = plt.subplots(
        len(facets), len(panels), figsize=(4.5 * len(panels), 3.4 * len(facets)), squeeze=False
    )
    for i, facet in enumerate(facets):
        part = [r for r in rows if facet is None or r[plot.facet] == facet]
        for j, ys in enumerate(panels):
            _draw_panel(axes[i][j], plot, part, ys)
            if facet is not None:
                axes[i][j].set_title(f"{plot.facet}={facet}", fontsize=9)
    fig.suptitle(_title(payload), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_all(results_dir: Path, recipes: Mapping[str, tuple[Plot, ...]], out_dir=None):
    """Renders every ``results_dir/*.json`` that has a recipe; returns the PNG paths written."""
    out_dir = Path(out_dir or results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(Path(results_dir).glob("*.json")):
        stem = path.stem
        base = stem.removesuffix("_quick")
        for plot in recipes.get(base, ()):
            payload = json.loads(path.read_text())
            png = render(payload, plot, out_dir / f"{stem}_{plot.name}.png")
            if png is not None:
                written.append(png)
    return written
