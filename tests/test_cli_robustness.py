"""The command lines that are not ``python -m decoding`` (tests/decoding/test_cli.py has that
one): bad flags are usage errors (exit 2, the flag named, no traceback) found before a model
loads or work starts, and Ctrl-C stops every command quietly (exit 130, no traceback, nothing
half-saved). Ctrl-C is a real SIGINT sent to a subprocess once it printed that it is working."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time

import pytest

import models
from decoding import launch
from decoding.serve import __main__ as serve_main
from models import data, medusa_train, train
from models.interrupts import deferred_interrupts

# Seconds a subprocess may take to print its first working line, and to stop after SIGINT.
START_S, STOP_S = 120.0, 60.0


@pytest.fixture
def no_logging_setup(monkeypatch):
    """The server's ``logging.basicConfig`` and uvicorn's logging config would attach handlers
    to the stream capsys replaces, which outlive the test."""
    monkeypatch.setattr(serve_main.logging, "basicConfig", lambda **kwargs: None)
    config = serve_main.uvicorn.Config
    monkeypatch.setattr(
        serve_main.uvicorn, "Config", lambda *a, **kw: config(*a, **kw, log_config=None)
    )


def _no_model(*args, **kwargs):
    raise AssertionError("a model was loaded: the flag was checked after work started")


def _usage_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    return err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _interrupt(argv: list[str], ready: str, stream: str = "stdout") -> tuple[int, str, str]:
    """Starts ``python ARGV``, waits (at most START_S) for a line of ``stream`` containing
    ``ready``, sends SIGINT -> (exit status, stdout, stderr)."""
    proc = subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A terminal's Ctrl-C: SIGINT at its default, whatever this (test worker) process has
        # made of it (a child inherits an ignored SIGINT, and Python then never raises it).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    watched = proc.stdout if stream == "stdout" else proc.stderr
    seen = []
    try:
        sel = selectors.DefaultSelector()
        sel.register(watched, selectors.EVENT_READ)
        deadline = time.monotonic() + START_S
        while not any(ready in line for line in seen):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(seen)
            if sel.select(timeout=1.0):
                seen.append(watched.readline())
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=STOP_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if stream == "stdout":
        out = "".join(seen) + out
    else:
        err = "".join(seen) + err
    return proc.returncode, out, err


# --------------------------------------------------------------------------- decoding.serve


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--port", "70000"], "argument --port: expected an int in [0, 65535], got '70000'"),
        (["--port", "-5"], "argument --port"),
        (["--port", "http"], "argument --port"),
        (["--host", "nosuchhost.invalid"], "--host nosuchhost.invalid: cannot be resolved"),
        (["--graceful-timeout", "nan"], "argument --graceful-timeout"),
        (["--graceful-timeout", "-1"], "argument --graceful-timeout"),
        (["--max-seq-len", "1"], "--max-seq-len must be >= 2"),
        (["--page-size", "4096"], "--page-size 4096 is larger than --max-seq-len 2048"),
        (["--max-batch", "5", "--num-pages", "4"], "--max-batch 5 is larger than --num-pages 4"),
        (["--max-batch", "0"], "argument --max-batch"),
        (["--num-draft-tokens", "2"], "--num-draft-tokens needs --draft"),
        (["--model", "no-such-model"], "--model"),
        (["--quantize", "q9"], "argument --quantize"),
        (["--quantize", "q8_0", "--mesh", "1,1"], "--quantize does not combine with --mesh"),
    ],
)
def test_serve_flags_fail_before_the_model_loads(flags, named, monkeypatch, capsys):
    monkeypatch.setattr(models, "pretrained", _no_model)
    err = _usage_error(serve_main.main, ["--model", "code-target", *flags], capsys)
    assert named in err


def test_serve_port_in_use_fails_before_the_model_loads(monkeypatch, capsys):
    monkeypatch.setattr(models, "pretrained", _no_model)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _usage_error(serve_main.main, ["--model", "code-target", "--port", str(port)], capsys)
    assert f"--port {port}: address already in use" in err


def test_serve_kv_pool_larger_than_memory_fails_before_it_is_allocated(
    monkeypatch, capsys, no_logging_setup
):
    monkeypatch.setattr(serve_main, "Engine", _no_model)
    argv = ["--model", "code-target", "--port", "0", "--num-pages", str(10**9)]
    assert "the KV pool needs" in _usage_error(serve_main.main, argv, capsys)


def test_serve_that_cannot_bind_after_all_exits_3_and_does_not_hang(
    monkeypatch, capsys, no_logging_setup
):
    """The port is taken between the check and uvicorn's bind: uvicorn's startup failure is an
    exit status (3), with the engine thread stopped, not a hang or a traceback."""
    monkeypatch.setattr(serve_main, "check_bindable", lambda host, port: None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["--model", "code-target", "--port", str(port), "--max-batch", "1"]
        argv += ["--max-seq-len", "64", "--num-pages", "4"]
        start = time.monotonic()
        with pytest.raises(SystemExit) as exc:
            serve_main.main(argv)
    assert exc.value.code == serve_main.STARTUP_FAILURE
    assert time.monotonic() - start < STOP_S
    assert "Traceback" not in capsys.readouterr().err


def test_serve_bad_port_from_the_shell_exits_2_at_once():
    """``--port 70000`` used to serve on 70000 - 65536 = 4464 (getaddrinfo wraps it) until
    killed: it looked like a hang."""
    proc = subprocess.run(
        [sys.executable, "-m", "decoding.serve", "--model", "code-target", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=STOP_S,
    )
    assert proc.returncode == 2 and "--port" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_ctrl_c_shuts_down_gracefully_and_exits_130():
    argv = ["-m", "decoding.serve", "--model", "code-target", "--port", "0", "--max-batch", "2"]
    argv += ["--max-seq-len", "128", "--num-pages", "8"]
    code, _, err = _interrupt(argv, "Uvicorn running on", stream="stderr")
    assert code == 130 and "Traceback" not in err, err
    assert "engine stopped: 0 pages held, 0 running, 0 waiting" in err


# --------------------------------------------------------------------------- models.train


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--medusa-heads", "2"], "--medusa-heads needs --init"),
        (["--seq-len", "1000"], "--seq-len 1000 is longer than tiny's 512"),
        (["--out", ""], "argument --out: expected a directory, got ''"),
        (
            ["--medusa-heads", "1", "--init", "code-draft", "--seq-len", "100000"],
            "--seq-len 100000 is longer than the target's",
        ),
    ],
)
def test_train_flags_fail_before_the_corpus_is_read(flags, named, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data.Corpus, "from_stdlib", _no_model)
    argv = ["--preset", "tiny", "--steps", "1", "--out", str(tmp_path / "out"), *flags]
    assert named in _usage_error(train.main, argv, capsys)
    assert not (tmp_path / "out").exists()


def test_train_eval_windows_past_the_held_out_stream_fail_before_training(tmp_path, capsys):
    argv = ["--preset", "tiny", "--steps", "1", "--out", str(tmp_path / "out")]
    argv += ["--max-corpus-bytes", "20000", "--eval-batches", "100000"]
    assert "--eval-batches 100000" in _usage_error(train.main, argv, capsys)
    assert not (tmp_path / "out").exists()


def test_train_ctrl_c_stops_at_a_step_and_saves_nothing(tmp_path):
    out = tmp_path / "ckpt"
    argv = ["-m", "models.train", "--preset", "tiny", "--steps", "100000", "--batch", "2"]
    argv += ["--seq-len", "32", "--eval-every", "1", "--eval-batches", "1", "--attn-impl", "xla"]
    argv += ["--max-corpus-bytes", "40000", "--out", str(out)]
    code, _, err = _interrupt(argv, "step 1:")
    assert code == 130 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted at step ") and last.endswith(f"nothing saved to {out}")
    assert int(last.split()[3]) >= 1  # "interrupted at step N of 100000"
    assert not (out / "config.json").exists()


def test_sigint_inside_a_write_is_held_until_it_ends():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    finished = False
    try:
        with pytest.raises(KeyboardInterrupt):
            with deferred_interrupts():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # a signal is handled between bytecodes: this one is held
                finished = True
    finally:
        signal.signal(signal.SIGINT, previous)
    assert finished


# --------------------------------------------------------------------------- models.evaluate


def test_evaluate_ctrl_c_exits_130():
    code, _, err = _interrupt(["-m", "models.evaluate", "code-draft"], "held-out bits per byte")
    assert code == 130 and "Traceback" not in err, err


# --------------------------------------------------------------------------- models.medusa_train


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--temperatures", "0", "nan"], "--temperatures must be finite"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "0"], "--lr"),
        (["--seed", "-1"], "--seed"),
        (["--heldout", "1"], "--heldout"),
        (["--steps", "0"], "argument --steps"),
        (["--draft-vocab", "0"], "argument --draft-vocab"),
        (["--out", "{file}"], "argument --out"),
        (["--target", "no-such-model"], "argument --target"),
    ],
)
def test_medusa_train_flags_fail_before_the_target_loads(
    flags, named, tmp_path, monkeypatch, capsys
):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setattr(medusa_train, "pretrained", _no_model)
    argv = ["--out", str(tmp_path / "out"), *(f.format(file=tmp_path / "file") for f in flags)]
    assert named in _usage_error(medusa_train.main, argv, capsys)


def test_medusa_train_target_without_a_chat_template_is_a_usage_error(tmp_path, capsys):
    argv = ["--target", "code-target", "--out", str(tmp_path / "out")]
    assert "has no chat template" in _usage_error(medusa_train.main, argv, capsys)


@pytest.mark.slow
def test_medusa_train_ctrl_c_exits_130_and_saves_nothing(smollm2_gguf, tmp_path):
    out = tmp_path / "heads"
    argv = ["-m", "models.medusa_train", "--prompts", "4", "--gen-batch", "4", "--out", str(out)]
    code, _, err = _interrupt(argv, "prompts x temperatures")
    assert code == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].endswith(f"nothing saved to {out}")
    assert not out.exists()


def test_medusa_heads_ctrl_c_stops_at_a_step_and_saves_nothing(tmp_path):
    """``models.train --medusa-heads``: the same loop-and-save shape as the self-distillation
    command (``models.medusa_train``), on a shipped code model."""
    out = tmp_path / "heads"
    argv = ["-m", "models.train", "--medusa-heads", "1", "--init", "code-draft"]
    argv += ["--steps", "100000", "--batch", "2", "--seq-len", "32", "--eval-every", "1"]
    argv += ["--eval-batches", "1", "--max-corpus-bytes", "40000", "--attn-impl", "xla"]
    code, _, err = _interrupt([*argv, "--out", str(out)], "step 1:")
    assert code == 130 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].endswith(f"nothing saved to {out}")
    assert not out.exists() or not any(out.iterdir())


# --------------------------------------------------------------------------- decoding.launch


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--coordinator", "nosuchhost.invalid:1234"], "cannot be resolved"),
        (["--init-timeout", str(2**31)], "argument --init-timeout"),
        (["--heartbeat-timeout", "0"], "argument --heartbeat-timeout"),
        (["--", "-c", "print(1)"], "'-c' is not a script"),
        (["--", "no_such_script.py"], "is not a script"),
    ],
)
def test_launch_flags_are_usage_errors(argv, named, capsys):
    full = ["--coordinator", "127.0.0.1:1234", "--num-processes", "1", "--process-id", "0"]
    full = full + argv if "--" in argv else full + argv + ["--", sys.argv[0]]
    assert named in _usage_error(launch.parse, full, capsys)


def _launch(num_processes: int, *command: str) -> list[str]:
    address = f"127.0.0.1:{_free_port()}"
    return [
        "-m",
        "decoding.launch",
        "--coordinator",
        address,
        "--num-processes",
        str(num_processes),
        "--process-id",
        "0",
        "--local-devices",
        "1",
        "--",
        *command,
    ]


def test_launch_ctrl_c_while_a_command_runs_exits_130(tmp_path):
    """A command that does not handle Ctrl-C itself: the launcher stops it, no traceback."""
    script = tmp_path / "busy.py"
    script.write_text(
        "import time\nprint('working', flush=True)\nwhile True:\n    time.sleep(0.1)\n"
    )
    code, _, err = _interrupt(_launch(1, str(script)), "working")
    assert code == 130 and "Traceback" not in err, err


def test_launch_ctrl_c_while_waiting_for_the_other_processes_exits_130():
    """Process 0 of 2 waits for process 1, which never comes: Ctrl-C ends the wait at once,
    not after --init-timeout."""
    code, _, err = _interrupt(_launch(2, "-m", "json.tool"), "joining", stream="stderr")
    assert code == 130 and "Traceback" not in err, err  # within STOP_S, not --init-timeout's 300
    assert "python -m decoding.launch: interrupted" in err
