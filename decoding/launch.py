"""Runs a command as one process of a ``jax.distributed`` program: once per host.

    python -m decoding.launch --coordinator HOST:PORT --num-processes N --process-id I \\
        -- python -m models.train --preset tiny --steps 100 --mesh 2,2 --out ckpt

The part after ``--`` is ``python -m MODULE ARGS...``, ``-m MODULE ARGS...`` or
``SCRIPT.py ARGS...``; it runs in this process (``runpy``) after
``jax.distributed.initialize``, so every ``jax.devices()`` it sees is the global list and a
mesh over them spans every process. Every process runs the same command; process 0 is the
coordinator (``HOST`` must be its address, reachable from the others).

``--local-devices K`` (CPU only) gives the process K host devices
(``--xla_force_host_platform_device_count``) and uses gloo for the CPU collectives, which is how
the tests run two "hosts" on one machine. ``--heartbeat-timeout S``: a process that stops
answering for S seconds (it died, or its host did) makes the others exit with an error instead
of waiting in a collective for ever. ``--init-timeout S`` bounds the wait for all processes to
join. Without flags, JAX's own environment detection (SLURM, Open MPI, ...) is used.

Exit status: the command's; 2 for a usage error (no command, a bad flag). The command runs in
this process, so a Ctrl-C (SIGINT) reaches it directly: a command that handles it (every one of
this project's) stops as it documents; one that does not stops with no traceback; either way the
launcher exits 130. A Ctrl-C while waiting for the other processes to join (a line on stderr
says which address it joins) or in the final shutdown barrier exits 130 at once; after a Ctrl-C
the barrier waits for the other processes at most ``INTERRUPTED_SHUTDOWN_S``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import socket
import sys
import threading

# The shell's status for a process stopped by SIGINT (128 + 2).
EXIT_INTERRUPTED = 130
# How long an interrupted process waits for the others in jax.distributed.shutdown (they may
# not have been interrupted) before it exits anyway.
INTERRUPTED_SHUTDOWN_S = 10.0


def _address(text: str) -> str:
    """``HOST:PORT`` with a port in [1, 65535] and a host that resolves (else joining would
    wait for ``--init-timeout`` and then abort); an IPv6 host in brackets, ``[::1]:1234``."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    try:
        socket.getaddrinfo(host.removeprefix("[").removesuffix("]"), int(port))
    except (socket.gaierror, UnicodeError) as e:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the host cannot be resolved ({getattr(e, 'strerror', None) or e})"
        ) from None
    return text


# JAX's distributed runtime takes its timeouts as C ints (seconds).
MAX_SECONDS = 2**31 - 1


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def _seconds(text: str) -> int:
    value = _positive(text)
    if value > MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_SECONDS} seconds, got {text!r}")
    return value


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """``(flags, command)``: the launcher's flags and the argv after ``--`` (with a leading
    ``python`` removed). Exits 2 with a usage error for bad flags or no command."""
    p = argparse.ArgumentParser(
        prog="python -m decoding.launch", description=__doc__.splitlines()[0]
    )
    p.add_argument("--coordinator", type=_address, default=None, help="HOST:PORT of process 0")
    p.add_argument("--num-processes", type=_positive, default=None, metavar="N")
    p.add_argument("--process-id", type=int, default=None, metavar="I", help="0 <= I < N")
    p.add_argument(
        "--local-devices",
        type=_positive,
        default=None,
        metavar="K",
        help="CPU: K host devices for this process, gloo collectives",
    )
    p.add_argument("--heartbeat-timeout", type=_seconds, default=30, metavar="S")
    p.add_argument("--init-timeout", type=_seconds, default=300, metavar="S")
    if "--" not in argv:
        p.error("the command to run comes after --, e.g. -- python -m decoding --help")
    cut = argv.index("--")
    args, command = p.parse_args(argv[:cut]), argv[cut + 1 :]
    given = [args.coordinator, args.num_processes, args.process_id]
    if any(x is not None for x in given) and None in given:
        p.error("--coordinator, --num-processes and --process-id go together")
    if args.process_id is not None and not 0 <= args.process_id < args.num_processes:
        p.error(f"--process-id must be in [0, {args.num_processes}), got {args.process_id}")
    if command and os.path.basename(command[0]).startswith("python"):
        command = command[1:]
    if not command or command[0] == "-m" and len(command) < 2:
        p.error("no command after -- (python -m MODULE ARGS, -m MODULE ARGS or SCRIPT ARGS)")
    if command[0] != "-m" and not os.path.isfile(command[0]):
        p.error(f"{command[0]!r} is not a script (the command is -m MODULE ARGS or SCRIPT ARGS)")
    return args, command


def initialize(args: argparse.Namespace) -> None:
    """``jax.distributed.initialize`` with the launcher's flags (before any other jax use)."""
    if args.local_devices is not None:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={args.local_devices}".strip()
        )
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if args.local_devices is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.coordinator is not None:  # joining can take up to --init-timeout: say what it waits for
        print(
            f"python -m decoding.launch: process {args.process_id} of {args.num_processes} "
            f"joining {args.coordinator}",
            file=sys.stderr,
            flush=True,
        )
    _interruptible(
        lambda: jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            initialization_timeout=args.init_timeout,
            heartbeat_timeout_seconds=args.heartbeat_timeout,
        ),
        "waiting for the other processes to join",
    )


def _interruptible(fn, doing: str, timeout: float | None = None) -> None:
    """Runs ``fn()`` in a thread while this (main) thread waits: a call blocked in C++ for
    minutes (joining, or the shutdown barrier) never lets Python's SIGINT handler run, so
    Ctrl-C would wait it out. On Ctrl-C, or past ``timeout`` seconds, the process exits at once
    (130): the thread cannot be stopped, and a normal exit would wait for it. ``fn``'s own
    exception is re-raised here."""
    failure = []

    def target():
        try:
            fn()
        except BaseException as e:  # handed to the main thread
            failure.append(e)

    thread = threading.Thread(target=target, name="launch-" + doing.split()[0], daemon=True)
    thread.start()
    try:
        thread.join(timeout)
    except KeyboardInterrupt:
        _exit_now(f"interrupted while {doing}")
    if thread.is_alive():
        _exit_now(f"gave up {doing} after {timeout:.0f} s")
    if failure:
        raise failure[0]


def _exit_now(message: str) -> None:
    print(f"\npython -m decoding.launch: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_INTERRUPTED)


def _find_module(name: str):
    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):  # a parent package that is missing, or a bad name
        return None


def run(command: list[str]) -> int:
    """Runs ``command`` (``-m MODULE ARGS`` or ``SCRIPT ARGS``) as ``__main__`` -> exit status."""
    module = command[1] if command[0] == "-m" else None
    if module and _find_module(module) is None:  # looked up only now: it imports its package
        print(f"python -m decoding.launch: error: no module named {module!r}", file=sys.stderr)
        return 2
    sys.argv = command[1:] if module else list(command)
    if module:
        sys.argv[0] = module
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(command[0])))
            runpy.run_path(command[0], run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            return e.code or 0
        print(e.code, file=sys.stderr)  # sys.exit("message"), as the interpreter would
        return 1
    except KeyboardInterrupt:  # a command that does not handle Ctrl-C itself
        print("\ninterrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return 0


def main(argv: list[str] | None = None) -> int:
    args, command = parse(sys.argv[1:] if argv is None else argv)
    try:
        initialize(args)
    except KeyboardInterrupt:  # before the wait itself (importing jax, say)
        _exit_now("interrupted before the command started")
    code = run(command)
    import jax

    # The shutdown barrier waits for every process: after a Ctrl-C (others may run on), not
    # for long; otherwise as long as it takes, but a Ctrl-C still ends it.
    timeout = INTERRUPTED_SHUTDOWN_S if code == EXIT_INTERRUPTED else None
    _interruptible(jax.distributed.shutdown, "shutting down", timeout)
    return code


if __name__ == "__main__":
    sys.exit(main())
