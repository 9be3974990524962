"""Memory read bandwidth: ``python -m benchmarks.bandwidth`` from the repository root.

A native streaming read (C++ compiled on first use with ``$CXX -O3 -march=native``, cached
beside the kernels under :func:`pallas_attn.native.cache_dir`): ``--threads`` threads (default
the cores) each sum 64-byte vectors over their own contiguous share of a ``--mb`` MiB buffer
(default 512: far past the last-level cache, so every pass reads DRAM), the buffer written
first by the threads that read it. One pass is timed from the threads' start to the last one's
end; the figure is the best of ``--runs`` passes (a read can only be slowed by other work, never
sped up, so the best pass is the firmest estimate of what the machine can read), the median
beside it. About 2 seconds.

It bounds decode speed: a decode step reads every weight once, so tokens/s <= bandwidth /
bytes per step. :func:`read_bandwidth` is what ``benchmarks.real_model`` records in its JSON.

Writes ``benchmarks/results/bandwidth_cpu.json``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess

from benchmarks import common

SOURCE = r"""
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

typedef uint64_t v8 __attribute__((vector_size(64)));

static uint64_t sum(const v8* p, int64_t n) {  // four independent chains: loads, not adds, bound
  v8 a{}, b{}, c{}, d{};
  for (int64_t i = 0; i + 4 <= n; i += 4) a += p[i], b += p[i + 1], c += p[i + 2], d += p[i + 3];
  const v8 s = a + b + c + d;
  uint64_t r = 0;
  for (int i = 0; i < 8; ++i) r += s[i];
  return r;
}

// Seconds of each of `passes` reads of `bytes` by `threads` threads into seconds[]; 0 on success.
extern "C" int read_passes(int64_t bytes, int threads, int passes, double* seconds) {
  const int64_t n = bytes / 64, per = (n / threads) & ~int64_t(3);
  v8* buf = static_cast<v8*>(std::aligned_alloc(64, n * 64));
  if (!buf) return 1;
  std::vector<uint64_t> sink(threads);
  auto run = [&](auto&& fn) {
    std::vector<std::thread> ts;
    for (int t = 1; t < threads; ++t) ts.emplace_back(fn, t);
    fn(0);
    for (auto& t : ts) t.join();
  };
  run([&](int t) { std::memset(buf + t * per, t + 1, per * 64); });  // first touch by its reader
  for (int k = 0; k < passes; ++k) {
    const auto t0 = std::chrono::steady_clock::now();
    run([&](int t) { sink[t] += sum(buf + t * per, per); });
    seconds[k] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  std::free(buf);
  return sink[0] == 42 ? 2 : 0;  // reads the sums, so the loop cannot be dropped
}
"""


@functools.cache
def _library() -> ctypes.CDLL:
    from pallas_attn import native

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler (set $CXX or install g++)")
    flags = ["-O3", "-march=native", "-std=gnu++17", "-fPIC", "-shared", "-pthread"]
    key = hashlib.sha256("\0".join([SOURCE, cxx, *flags]).encode()).hexdigest()[:16]
    out = native.cache_dir() / f"bandwidth-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        src = out.with_suffix(f".{os.getpid()}.cc")
        src.write_text(SOURCE)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        res = subprocess.run(
            [cxx, *flags, str(src), "-o", str(tmp)], capture_output=True, text=True
        )
        src.unlink()
        if res.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, out)
    lib = ctypes.CDLL(str(out))
    lib.read_passes.argtypes = [
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(ctypes.c_double),
    ]
    return lib


def read_passes(mb: int = 512, threads: int | None = None, runs: int = 10) -> list[float]:
    """Seconds of each of ``runs`` streaming reads of an ``mb`` MiB buffer by ``threads``
    threads (None: the cores). ValueError naming a bad argument."""
    if threads is None:
        threads = os.cpu_count() or 1
    for name, value in (("mb", mb), ("threads", threads), ("runs", runs)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    seconds = (ctypes.c_double * runs)()
    if _library().read_passes(mb << 20, threads, runs, seconds) != 0:
        raise MemoryError(f"could not allocate {mb} MiB")
    return list(seconds)


def read_bandwidth(mb: int = 512, threads: int | None = None, runs: int = 10) -> dict:
    """``best_gb_s`` (the fastest pass) and ``median_gb_s`` of :func:`read_passes`, in 1e9
    bytes/s, with the arguments used."""
    if threads is None:
        threads = os.cpu_count() or 1
    seconds = read_passes(mb, threads, runs)
    nbytes = mb << 20
    ordered = sorted(seconds)
    return dict(
        best_gb_s=nbytes / ordered[0] / 1e9,
        median_gb_s=nbytes / ordered[len(ordered) // 2] / 1e9,
        mb=mb,
        threads=threads,
        runs=runs,
    )


def main(argv=None) -> None:
    p = common.parser(__doc__, runs=20, quick="3 passes of 128 MiB")
    p.add_argument("--mb", type=common.positive, default=512, help="buffer size in MiB")
    p.add_argument("--threads", type=common.positive, default=None, help="default: the cores")
    args = p.parse_args(argv)
    mb, runs = (128, 3) if args.quick else (args.mb, args.runs)
    row = read_bandwidth(mb, args.threads, runs)
    common.finish(args, "bandwidth_cpu", [row], ["best_gb_s", "median_gb_s", "mb", "threads"])


if __name__ == "__main__":
    main()
