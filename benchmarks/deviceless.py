"""Compile JAX programs for a CUDA GPU on a machine without one (JAX's deviceless AOT path).

Needs a venv with ``jax-cuda12-plugin``, ``jax-cuda12-pjrt`` and ``nvidia-cuda-nvcc-cu12`` (ptxas)
at the jax version in use, run with ``JAX_PLATFORMS=cpu`` (``make gpu-compile`` builds one). A
target is a ``GpuTargetConfigProto`` text written from the device's public specifications
(:data:`TARGETS`); ``jax.experimental.topologies.get_topology_desc`` turns it into a device that
``jax.ShapeDtypeStruct`` arguments can be placed on, and ``jit(f).trace(...).lower(
lowering_platforms=("cuda",)).compile()`` then runs XLA's whole GPU pipeline: Pallas -> Triton ->
PTX -> ptxas -> cubin.

:func:`inspect` compiles one program with a dump directory and reads back per Pallas kernel: grid,
threads and shared memory from ``*.thunk_sequence.txt``, registers, spills and stack from
``ptxas -v`` on the dumped ``*.ptx``. A Pallas kernel that spills makes the case a ``spill``; a
spill in one of XLA's own generated kernels (fusions we do not write, e.g. an elementwise loop
of a whole-model program) is recorded in ``xla_spills`` and does not fail the case: our tiles
cannot change it. (``xla_gpu_fail_ptx_compilation_on_register_spilling`` would fail the compile
for either, so it is not set.)

:func:`run_cases` runs cases (JSON-able dicts naming a builder in :mod:`benchmarks.gpu_cases`) in
worker subprocesses, because some Triton errors abort the process (an LLVM fatal error): a
worker streams one result line per case; when it dies, the case it was compiling is recorded as
a crash and a fresh worker continues with the rest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# Public specifications of each target. H100 and H200 (SXM) share the Hopper die (sm_90, 132 SMs,
# 227 KiB opt-in shared memory per block); the H200 has 141 GB of HBM3e at 4.8 TB/s.
TARGETS = {
    "h100": dict(
        name="NVIDIA H100 80GB HBM3",
        cc=(9, 0),
        sms=132,
        smem_core=233472,
        smem_optin=232448,
        fpus=128,
        bandwidth=3_352_320_000_000,
        l2=52_428_800,
        clock=1.98,
        memory=85_520_809_984,
    ),
    "h200": dict(
        name="NVIDIA H200",
        cc=(9, 0),
        sms=132,
        smem_core=233472,
        smem_optin=232448,
        fpus=128,
        bandwidth=4_800_000_000_000,
        l2=52_428_800,
        clock=1.98,
        memory=150_754_820_096,
    ),
    "a100": dict(
        name="NVIDIA A100-SXM4-80GB",
        cc=(8, 0),
        sms=108,
        smem_core=167936,
        smem_optin=166912,
        fpus=64,
        bandwidth=2_039_000_000_000,
        l2=41_943_040,
        clock=1.41,
        memory=85_899_345_920,
    ),
}

PALLAS_KERNELS = ("flash_fwd", "flash_bwd_dkdv", "flash_bwd_dq", "kvcache_decode", "kvcache_append")
# Mosaic GPU kernels (pallas_attn.kernels.mosaic) compile outside XLA's pipeline, in the CUDA
# plugin's custom call, with the plugin's own ptxas (their PTX ISA can be newer than the wheel's
# ptxas takes); MOSAIC_GPU_DUMP_TO makes it dump per kernel its PTX, its ``ptxas -v`` report
# (kernel ``<name>_mosaic_gpu_kernel``) and its MLIR pass log, whose ``gpu.launch`` holds the
# grid, the threads and the dynamic shared memory.
MOSAIC_KERNELS = (
    "mosaic_flash_fwd",
    "mosaic_flash_bwd_dkdv",
    "mosaic_flash_bwd_dq",
    "mosaic_decode",
)
MOSAIC_SUFFIX = "_mosaic_gpu_kernel"
_MOSAIC_LAUNCH = re.compile(
    r"gpu\.launch .*?in \(%\w+ = %c(\d+)\w*, %\w+ = %c(\d+)\w*, %\w+ = %c(\d+)\w*\) "
    r"threads\(.*?in \(%\w+ = %c(\d+)\w*, %\w+ = %c(\d+)\w*, %\w+ = %c(\d+)\w*\) "
    r"dynamic_shared_memory_size %c(\d+)_i32"
)
_THUNK = re.compile(
    r"(\w+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]\s+"
    r"shared_memory: (\d+) bytes"
)


def target_config(device: str) -> str:
    """The ``GpuTargetConfigProto`` text of a :data:`TARGETS` entry."""
    t = TARGETS[device]
    major, minor = t["cc"]
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {t["smem_core"]}
  threads_per_core_limit: 2048
  core_count: {t["sms"]}
  fpus_per_core: {t["fpus"]}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {t["bandwidth"]}
  l2_cache_size: {t["l2"]}
  clock_rate_ghz: {t["clock"]}
  device_memory_size: {t["memory"]}
  shared_memory_per_block_optin: {t["smem_optin"]}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
device_description_str: "{t["name"]}"
"""


def sharding(device: str):
    """A ``SingleDeviceSharding`` on the deviceless topology of ``device`` (no GPU needed)."""
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    topo = topologies.get_topology_desc(
        platform="cuda", target_config=target_config(device), topology="1x1x1"
    )
    return SingleDeviceSharding(topo.devices[0])


def ptxas() -> str:
    """The ptxas of the ``nvidia-cuda-nvcc-cu12`` wheel (else one on PATH)."""
    try:
        import nvidia.cuda_nvcc

        path = Path(next(iter(nvidia.cuda_nvcc.__path__))) / "bin" / "ptxas"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("ptxas")
    if found is None:
        raise RuntimeError("ptxas not found: pip install nvidia-cuda-nvcc-cu12")
    return found


def ptx_info(ptx: Path) -> dict:
    """``{kernel: {registers, spill_stores, spill_loads, stack}}`` from ``ptxas -v`` on one file."""
    target = re.search(r"^\.target\s+(\w+)", ptx.read_text(), re.M)
    if target is None:  # an empty module (XLA dumps one per LLVM module, some hold no kernel)
        return {}
    arch = target.group(1)
    res = subprocess.run(
        [ptxas(), "-v", f"-arch={arch}", str(ptx), "-o", os.devnull],
        capture_output=True,
        text=True,
        check=False,
    )
    return parse_ptxas(res.stderr)


def parse_ptxas(text: str) -> dict:
    """``{kernel: {registers, spill_stores, spill_loads, stack}}`` from ``ptxas -v`` output."""
    info, name = {}, None
    for line in text.splitlines():
        if m := re.search(r"Function properties for (\w+)", line):
            name = m.group(1)
            info[name] = {}
        elif m := re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        ):
            info[name].update(
                stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3))
            )
        elif m := re.search(r"Used (\d+) registers", line):
            info[name]["registers"] = int(m.group(1))
    return info


def kernels_from_dump(dump: Path) -> tuple[list[dict], list[dict]]:
    """Per Pallas kernel: name, grid, threads, smem (bytes; when the compile finished) and ptxas
    info; and XLA's own kernels that spill (name and ptxas info), kept apart."""
    launches = {}
    for f in dump.glob("*.thunk_sequence.txt"):
        for m in _THUNK.finditer(f.read_text()):
            g = [int(x) for x in m.groups()[1:]]
            launches[m.group(1)] = dict(grid=g[:3], threads=g[3:6], smem=g[6])
    kernels, xla_spills = {}, {}
    for ptx in sorted(dump.glob("*.ptx")):
        if ptx.with_suffix(".ptxas").exists():  # a Mosaic kernel: its ptxas is the plugin's own
            continue
        for name, info in ptx_info(ptx).items():
            if name in PALLAS_KERNELS:
                kernels[name] = dict(name=name, **launches.get(name, {}), **info)
            elif info.get("spill_stores") or info.get("spill_loads"):
                xla_spills[name] = dict(name=name, **info)
    for report in sorted(dump.glob("*.ptxas")):
        for name, info in parse_ptxas(report.read_text()).items():
            if (name := name.removesuffix(MOSAIC_SUFFIX)) in MOSAIC_KERNELS:
                launch = mosaic_launch(report.with_suffix(".mlir-passes.log"))
                kernels[name] = dict(name=name, **launch, **info)
    return list(kernels.values()), list(xla_spills.values())


def mosaic_launch(log: Path) -> dict:
    """Grid, threads and dynamic shared memory (bytes) of a Mosaic kernel, from the first
    ``gpu.launch`` of its MLIR pass log ({} when there is none)."""
    if not log.exists():
        return {}
    with log.open() as f:
        for line in f:
            if "gpu.launch " in line and (m := _MOSAIC_LAUNCH.search(line)):
                g = [int(x) for x in m.groups()]
                return dict(grid=g[:3], threads=g[3:6], smem=g[6])
    return {}


def status_of(error: str | None, kernels: list[dict]) -> str:
    if error is None:
        spilled = any(k.get("spill_stores", 0) or k.get("spill_loads", 0) for k in kernels)
        return "spill" if spilled else "ok"
    if "register spilling" in error:
        return "spill"
    if "Shared memory size limit exceeded" in error:
        return "smem_overflow"
    return "error"


def inspect(fn, args, dump: Path) -> dict:
    """Compiles ``fn(*args)`` for the CUDA target the args are placed on; returns the record.

    ``args`` are pytrees of ``ShapeDtypeStruct`` with a :func:`sharding`. The record holds
    ``status`` (ok / spill / smem_overflow / error), ``error``, ``compile_s``, ``kernels`` and
    ``xla_spills``.
    """
    import jax

    options = {
        "xla_dump_to": str(dump),
    }
    start = time.perf_counter()
    error = None
    os.environ["MOSAIC_GPU_DUMP_TO"] = str(dump)  # read by the CUDA plugin at each kernel compile
    try:
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        lowered.compile(compiler_options=options)
    except Exception as e:  # noqa: BLE001 - the record says why it failed
        error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    finally:
        del os.environ["MOSAIC_GPU_DUMP_TO"]
    compile_s = time.perf_counter() - start
    kernels, xla_spills = kernels_from_dump(dump)
    status = status_of(error, kernels)
    return dict(
        status=status, error=error, compile_s=compile_s, kernels=kernels, xla_spills=xla_spills
    )


def _worker(device: str) -> None:
    """Reads case dicts (JSON lines) from stdin, writes one result line per case to stdout."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    from benchmarks import gpu_cases

    where = sharding(device)
    out = sys.stdout
    sys.stdout = sys.stderr  # anything a builder prints must not corrupt the protocol
    for line in sys.stdin:
        case = json.loads(line)
        out.write(json.dumps({"start": case["id"]}) + "\n")
        out.flush()
        with tempfile.TemporaryDirectory() as dump:
            try:
                fn, args = gpu_cases.build(case, where)
            except Exception as e:  # noqa: BLE001 - a broken case must not stop the others
                error = f"building the case: {type(e).__name__}: {e}"[:300]
                record = dict(status="error", error=error, compile_s=None, kernels=[])
            else:
                record = inspect(fn, args, Path(dump))
        out.write(json.dumps({"done": case["id"], **record}) + "\n")
        out.flush()


def _run_batch(device: str, cases: list[dict]) -> dict[str, dict]:
    """Runs ``cases`` in one worker after another until all have a record (crashes included)."""
    results: dict[str, dict] = {}
    todo = list(cases)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    while todo:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.deviceless", "--worker", device],
            input="".join(json.dumps(c) + "\n" for c in todo),
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        started = None
        for line in proc.stdout.splitlines():
            msg = json.loads(line)
            if "start" in msg:
                started = msg["start"]
            else:
                results[msg.pop("done")] = msg
                started = None
        if proc.returncode != 0 or started is not None:
            if started is None:  # died before its first case: nothing will get further
                for c in todo:
                    results.setdefault(c["id"], _crash(proc.returncode, proc.stderr))
            else:
                results[started] = _crash(proc.returncode, proc.stderr)
        todo = [c for c in todo if c["id"] not in results]
    return results


def _crash(returncode: int, stderr: str) -> dict:
    """The record of a case that killed its worker, with the fatal error's line when found."""
    lines = stderr.strip().splitlines()
    fatal = [ln for ln in lines if re.search(r"Fatal Error|LLVM ERROR|Check failed|Error:", ln)]
    error = f"worker exited {returncode}: " + " | ".join(fatal[-1:] or lines[-3:])[-300:]
    return dict(status="crash", error=error, compile_s=None, kernels=[])


def run_cases(device: str, cases: list[dict], jobs: int = 2, batch: int = 16) -> list[dict]:
    """Compiles every case for ``device`` in ``jobs`` parallel workers; returns the records in
    case order, each the case dict with its result merged in."""
    batches = [cases[i : i + batch] for i in range(0, len(cases), batch)]
    results: dict[str, dict] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for part in pool.map(lambda b: _run_batch(device, b), batches):
            results.update(part)
            print(f"{device}: {len(results)}/{len(cases)} cases compiled", file=sys.stderr)
    return [{**c, **results[c["id"]]} for c in cases]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        sys.exit("usage: python -m benchmarks.deviceless --worker DEVICE (stdin: case lines)")
