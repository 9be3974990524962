"""``python -m benchmarks all [--quick] [--dry-run]`` and ``python -m benchmarks plot``.

``all`` runs every script of :mod:`benchmarks.registry` listed for the current JAX backend, each in
its own process, under a progress bar, and prints each script's table as it finishes and a
summary (status and seconds per script) at the end; the exit status is 1 if any script failed.
``plot`` renders every results JSON that has a recipe into PNGs beside it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import registry

ROOT = registry.BENCHMARKS_DIR.parent
RESULTS_DIR = registry.BENCHMARKS_DIR / "results"


def command(script: registry.Script, quick: bool, results_dir: Path | None) -> list[str]:
    """The command line ``all`` runs for ``script``."""
    cmd = [sys.executable, "-m", f"benchmarks.{script.name}", *(script.quick if quick else ())]
    if results_dir is not None:
        cmd += ["--results-dir", str(results_dir)]
    return cmd


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_all(args: argparse.Namespace) -> int:
    backend = args.backend
    if backend is None:
        import jax

        backend = jax.default_backend()
    todo = registry.scripts(backend, args.only)
    for name in registry.unlisted():
        print(f"note: benchmarks/{name}.py is not in benchmarks/registry.py, so it is not run")
    if args.dry_run:
        for s in todo:
            print(" ".join(command(s, args.quick, args.results_dir)))
        return 0
    from tqdm import tqdm

    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in paths if x))
    summary, start_all = [], time.perf_counter()
    with tqdm(todo, desc=f"benchmarks ({backend})", unit="script") as bar:
        for s in bar:
            bar.set_postfix(script=s.name)
            start = time.perf_counter()
            try:
                proc = subprocess.run(
                    command(s, args.quick, args.results_dir),
                    cwd=ROOT,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                )
                status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
                shown = proc.stdout if proc.returncode == 0 else proc.stdout + proc.stderr
            except subprocess.TimeoutExpired:
                status, shown = f"timeout {args.timeout}s", ""
            seconds = time.perf_counter() - start
            summary.append(dict(script=s.name, status=status, seconds=round(seconds, 1)))
            bar.write(f"--- {s.name}: {status} in {seconds:.0f} s\n{_tail(shown, 40)}")
    from benchmarks import common

    common.print_table(summary, ["script", "status", "seconds"])
    print(f"total {time.perf_counter() - start_all:.0f} s")
    return int(any(row["status"] != "ok" for row in summary))


def run_plot(args: argparse.Namespace) -> int:
    from benchmarks import plot

    written = plot.render_all(args.results_dir, registry.plot_recipes(), args.out_dir)
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"no results JSON with a plot recipe in {args.results_dir}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("all", help="run every listed benchmark script for this backend")
    a.add_argument("--quick", action="store_true", help="each script's quick arguments")
    a.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a.add_argument("--only", nargs="+", metavar="NAME", help="run only these listed scripts")
    a.add_argument("--backend", choices=("cpu", "gpu"), help="default: JAX's default backend")
    a.add_argument("--timeout", type=float, default=None, help="seconds per script")
    a.add_argument("--results-dir", type=Path, default=None, help="passed to every script")
    q = sub.add_parser("plot", help="render results JSON into PNGs")
    q.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    q.add_argument("--out-dir", type=Path, default=None, help="default: the results directory")
    args = p.parse_args(argv)
    if args.command == "all":
        try:
            return run_all(args)
        except ValueError as e:
            p.error(str(e))
    return run_plot(args)


if __name__ == "__main__":
    sys.exit(main())
