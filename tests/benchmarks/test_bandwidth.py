"""The memory read probe (benchmarks/bandwidth.py): it runs, times every pass, and rejects bad
arguments by name."""

import shutil

import pytest

from benchmarks import bandwidth

pytestmark = pytest.mark.skipif(not shutil.which("c++"), reason="no C++ compiler")


def test_read_passes_and_figures():
    seconds = bandwidth.read_passes(mb=16, threads=2, runs=3)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    res = bandwidth.read_bandwidth(mb=16, threads=1, runs=3)
    assert res["best_gb_s"] >= res["median_gb_s"] > 0 and res["threads"] == 1


@pytest.mark.parametrize("kw", [dict(mb=0), dict(threads=0), dict(runs=0), dict(mb=1.5)])
def test_bad_arguments(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        bandwidth.read_passes(**kw)
