"""``python -m decoding.serve`` as a process: SIGTERM finishes (or, past the grace period, aborts)
what is in flight and ends the process with no KV page held. After its clean shutdown uvicorn
re-raises the signal it caught, so the process ends by SIGTERM (what supervisors expect)."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time

import httpx
import pytest

START_S = 120.0
STOP_S = 60.0


def _start(*extra: str) -> tuple[subprocess.Popen, str]:
    """The server on 127.0.0.1, port chosen by the OS (read from uvicorn's log line)."""
    cmd = [sys.executable, "-m", "decoding.serve", "--model", "code-target", "--port", "0"]
    cmd += ["--max-batch", "4", "--max-seq-len", "512", "--num-pages", "64", *extra]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.STDOUT, stdout=subprocess.PIPE, text=True, env=os.environ | {}
    )
    # Read the pipe's bytes as they come (os.read): readline() would buffer several lines at
    # once, and the selector never wakes for lines already in that buffer.
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline, log, partial = time.monotonic() + START_S, [], ""
    while time.monotonic() < deadline and proc.poll() is None:
        if not sel.select(timeout=1.0):
            continue
        *lines, partial = (
            partial + os.read(proc.stdout.fileno(), 1 << 16).decode(errors="replace")
        ).split("\n")
        log += [line + "\n" for line in lines]
        if m := re.search(r"running on http://127\.0\.0\.1:(\d+)", "".join(lines)):
            # the engine's steps compiled before it listens, unless told not to
            if any("warmed up in" in x for x in log) == ("--no-warmup" not in extra):
                return proc, f"http://127.0.0.1:{m.group(1)}"
            break
    proc.kill()
    raise RuntimeError("the server did not start, or not warmed up as asked:\n" + "".join(log))


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == -signal.SIGTERM, out
    return out


@pytest.mark.parametrize("grace", ["30", "0.2"])
def test_sigterm_finishes_or_aborts_in_flight_and_holds_no_page(grace):
    proc, url = _start("--graceful-timeout", grace)
    try:
        body = dict(model="code-target", prompt="def f(x):", max_tokens=400, temperature=0)
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: {")
                proc.send_signal(signal.SIGTERM)
                rest = []
                try:
                    rest.extend(line for line in lines if line)
                except httpx.HTTPError:  # cut when the grace period ends
                    pass
        # 400 tokens take seconds: with 30 s of grace the stream completes, with 0.2 s it is cut.
        assert (rest[-1:] == ["data: [DONE]"]) == (grace == "30"), rest[-3:]
        out, _ = proc.communicate(timeout=STOP_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGTERM, out
    assert re.search(r"engine stopped: 0 pages held, 0 running, 0 waiting", out), out


@pytest.mark.slow
def test_sigterm_when_idle():
    proc, url = _start("--no-warmup")
    try:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        out = _stop(proc)
    assert "engine stopped: 0 pages held" in out
