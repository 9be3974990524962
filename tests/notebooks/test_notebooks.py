"""Every ``notebooks/*.ipynb`` runs top to bottom (nbclient, this interpreter, 180 s per cell).

The notebooks are committed with their outputs; this test re-executes them in memory (nothing is
saved), so a notebook whose code no longer runs against the package fails CI. Refresh the committed
outputs with ``python notebooks/execute.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("nbclient", reason="the notebooks extra is not installed")
pytest.importorskip("ipykernel", reason="the notebooks extra is not installed")
pytest.importorskip("matplotlib", reason="the notebooks extra is not installed")

EXECUTE = Path(__file__).resolve().parents[2] / "notebooks" / "execute.py"
_spec = importlib.util.spec_from_file_location("notebooks_execute", EXECUTE)
execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(execute)

NOTEBOOKS = execute.notebooks()


def test_there_are_notebooks():
    assert NOTEBOOKS, f"no notebooks in {execute.NOTEBOOKS_DIR}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = execute.execute(path, timeout=180)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code)
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs), "no plot drawn"
