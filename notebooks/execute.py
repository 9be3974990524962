"""Executes notebooks headless with nbclient, on this interpreter, with the repository importable.

``python notebooks/execute.py [NOTEBOOK ...]`` (default: every ``notebooks/*.ipynb``) runs each
notebook top to bottom in ``notebooks/`` and saves it in place with its outputs and plots;
``tests/notebooks/test_notebooks.py`` calls :func:`execute` without saving, so a notebook that no
longer runs fails the test suite.

The kernel is a ``python3`` kernelspec written to a temporary directory whose command is
``sys.executable -m ipykernel_launcher``, so the notebook runs in the same virtual environment as
the caller (never a ``python3`` kernel installed elsewhere on the machine), with the repository
root first on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

NOTEBOOKS_DIR = Path(__file__).resolve().parent
ROOT = NOTEBOOKS_DIR.parent
KERNEL_NAME = "python3"


def notebooks() -> list[Path]:
    """Every ``notebooks/*.ipynb``, sorted."""
    return sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


def _kernel_manager(kernel_dir: Path):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    spec_dir = kernel_dir / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"Python ({sys.executable})",
        "language": "python",
        "env": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(kernel_dir)], ensure_native_kernel=False)
    return AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=specs)


def execute(path: Path, *, timeout: int = 180, save: bool = False):
    """Runs the notebook at ``path`` in ``notebooks/``; returns the executed ``NotebookNode``.

    Raises ``nbclient.exceptions.CellExecutionError`` on the first failing cell and
    ``CellTimeoutError`` when a cell runs longer than ``timeout`` seconds.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # timestamps of an earlier run would only churn the diff
        cell.metadata.pop("execution", None)
    with tempfile.TemporaryDirectory() as tmp:
        client = NotebookClient(
            nb,
            km=_kernel_manager(Path(tmp)),
            timeout=timeout,
            record_timing=False,
            kernel_name=KERNEL_NAME,
            resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
        )
        client.execute()
    if save:
        nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "Python 3"}
        nbformat.write(nb, path)
    return nb


def main(argv=None) -> None:
    paths = [Path(a) for a in (sys.argv[1:] if argv is None else argv)] or notebooks()
    for path in paths:
        start = time.perf_counter()
        execute(path, save=True)
        print(f"executed {path} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
