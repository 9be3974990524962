"""Compile every Pallas kernel for H100, H200 and A100 without a GPU: ``make gpu-compile``.

``python -m benchmarks.gpu_compile [--full] [--devices h200,a100] [--only REGEX] [--jobs N]``
in a venv with the CUDA plugin and ptxas (see :mod:`benchmarks.deviceless`). Compiles the cases of
:mod:`benchmarks.gpu_cases` (the CI set; for H100, whose code generation is the H200's, a few per
family; the whole cross for every device with ``--full``) through XLA's
Triton -> PTX -> ptxas pipeline with register spilling made an error, and writes per device
``benchmarks/results/gpu_compile_<device>.json``: per case its status (ok / spill /
smem_overflow / error / crash) and per Pallas kernel grid, threads, shared memory, registers,
spills. Prints a summary per device and kernel; exits 1 when any case is not ok.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

from benchmarks import common, deviceless, gpu_cases

FP8_MIN_CC = (8, 9)  # Triton converts float8_e4m3fn only on sm_89+ (an LLVM fatal error below)
MOSAIC_MIN_CC = (9, 0)  # the Mosaic GPU kernels use TMA and wgmma (Hopper)


def supported(case: dict, device: str) -> bool:
    cc = deviceless.TARGETS[device]["cc"]
    return (not case.get("fp8") or cc >= FP8_MIN_CC) and (
        not case.get("mosaic") or cc >= MOSAIC_MIN_CC
    )


def unsupported(case: dict) -> dict:
    error = "float8_e4m3fn caches need compute capability >= 8.9 (Triton: LLVM fatal error)"
    if case.get("mosaic"):
        error = "the Mosaic GPU kernels need compute capability >= 9.0 (TMA, wgmma)"
    return {**case, "status": "unsupported", "error": error, "compile_s": None, "kernels": []}


def case_set(device: str, full: bool) -> list[dict]:
    """``--full``: the whole cross; else the CI set, and for H100 (whose code generation H200's
    covers) a few cases per family."""
    if full:
        return gpu_cases.full_cases()
    return gpu_cases.smoke_cases() if device == "h100" else gpu_cases.ci_cases()


def summarize(rows: list[dict], device: str) -> list[dict]:
    """Per Pallas kernel: cases it appears in, max registers / shared memory, spilled cases."""
    table: dict[str, dict] = {}
    for row in rows:
        for k in row["kernels"]:
            s = table.setdefault(
                k["name"], dict(device=device, kernel=k["name"], cases=0, max_regs=0, spilled=0)
            )
            s["cases"] += 1
            s["max_regs"] = max(s["max_regs"], k.get("registers", 0))
            s["max_smem_KiB"] = max(s.get("max_smem_KiB", 0), k.get("smem", 0) / 1024)
            s["spilled"] += bool(k.get("spill_stores") or k.get("spill_loads"))
    failed = [r for r in rows if r["status"] not in ("ok", "unsupported")]
    table["(cases)"] = dict(device=device, kernel="(cases)", cases=len(rows), spilled=len(failed))
    return list(table.values())


def _ptxas_version() -> str:
    out = subprocess.run([deviceless.ptxas(), "--version"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def write(device: str, rows: list[dict], summary: list[dict], wall_s: float, full: bool) -> str:
    import jax

    path = common.RESULTS_DIR / f"gpu_compile_{device}.json"
    common.RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    payload = dict(
        name=f"gpu_compile_{device}",
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=deviceless.TARGETS[device],
        jax=jax.__version__,
        ptxas=_ptxas_version(),
        case_set="full" if full else ("smoke" if device == "h100" else "ci"),
        wall_s=round(wall_s, 1),
        load_average_1min=os.getloadavg()[0],
        ok=sum(r["status"] == "ok" for r in rows),
        xla_kernel_spills=sum(len(r.get("xla_spills", ())) for r in rows),
        unsupported=sum(r["status"] == "unsupported" for r in rows),
        total=len(rows),
        summary=summary,
        rows=rows,
    )
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return str(path)


def report(devices: list[str]) -> str:
    """A Markdown table of the written results: per device and kernel, cases, registers, spills."""
    lines = [
        "| device | kernel | cases | max registers | max shared memory KiB | cases spilled |",
        "|---|---|---|---|---|---|",
    ]
    for device in devices:
        data = json.loads((common.RESULTS_DIR / f"gpu_compile_{device}.json").read_text())
        for s in data["summary"]:
            if s["kernel"] != "(cases)":
                cells = (device, s["kernel"], s["cases"], s["max_regs"], s["max_smem_KiB"])
                lines.append("| {} | {} | {} | {} | {:.0f} | ".format(*cells) + f"{s['spilled']} |")
        lines.append(
            f"| {device} | all ({data['case_set']} set) | {data['total']} | | | "
            f"{data['total'] - data['ok'] - data['unsupported']} failed, "
            f"{data['unsupported']} unsupported |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", default="h200,a100,h100", help="comma-separated TARGETS keys")
    p.add_argument("--full", action="store_true", help="the whole D x dtype x mask cross")
    p.add_argument("--only", default=None, help="regex on case ids")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--no-write", action="store_true", help="print only, keep the JSON files")
    p.add_argument("--report", action="store_true", help="print the JSON files' summary (Markdown)")
    args = p.parse_args(argv)
    if args.report:
        print(report(args.devices.split(",")))
        return 0
    bad = 0
    for device in args.devices.split(","):
        if device not in deviceless.TARGETS:
            p.error(f"--devices: unknown {device!r}; choose from {sorted(deviceless.TARGETS)}")
        cases = case_set(device, args.full)
        if args.only:
            cases = [c for c in cases if re.search(args.only, c["id"])]
        start = time.perf_counter()
        todo = [c for c in cases if supported(c, device)]
        done = {r["id"]: r for r in deviceless.run_cases(device, todo, jobs=args.jobs)}
        rows = [done.get(c["id"]) or unsupported(c) for c in cases]
        wall = time.perf_counter() - start
        summary = summarize(rows, device)
        for r in rows:
            if r["status"] not in ("ok", "unsupported"):
                bad += 1
                print(f"{device} {r['id']}: {r['status']} {r['error'] or ''}", file=sys.stderr)
            for k in r.get("xla_spills", ()):  # XLA's own kernels: reported, not ours to tile
                print(
                    f"{device} {r['id']}: XLA kernel {k['name']} spills "
                    f"{k.get('spill_stores', 0)} B stores / {k.get('spill_loads', 0)} B loads"
                )
        common.print_table(
            summary, ["device", "kernel", "cases", "max_regs", "max_smem_KiB", "spilled"]
        )
        if not args.no_write:
            print(f"wrote {write(device, rows, summary, wall, args.full)} ({wall:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
