"""A plain (non-editable) install is the same program: the wheel carries every file the package
reads at run time (the native kernels' C++ sources, compiled on first use, and the shipped models)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_carries_native_sources_and_shipped_models(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("pallas_attn-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for pattern in ("pallas_attn/native/*", "models/shipped/*/*"):
        wanted = {str(p.relative_to(ROOT)) for p in ROOT.glob(pattern) if p.is_file()}
        assert wanted and wanted <= names, sorted(wanted - names)
