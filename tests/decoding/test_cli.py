"""The command line: usage errors (exit 2, no traceback) and a run on a checkpoint directory."""

from __future__ import annotations

import subprocess
import sys

import pytest

from decoding.__main__ import main
from models.hf import save_hf_checkpoint


@pytest.mark.parametrize(
    "argv, match",
    [
        (["hi", "--max-new-tokens", "0"], "max-new-tokens"),
        (["hi", "--max-new-tokens", "x"], "max-new-tokens"),
        (["hi", "--temperature", "-1"], "temperature"),
        (["hi", "--temperature", "hot"], "temperature"),
        (["hi", "--top-p", "1.5"], "top_p"),
        (["hi", "--top-k", "-2"], "top_k"),
        (["hi", "--model", "no-such-model"], "no-such-model"),
        (["hi", "--cache", "ring"], "cache"),
        (["hi", "--page-size", "0"], "page-size"),
        (["hi", "--speculative"], "speculative"),
        ([], "prompt"),
        ([""], "prompt must not be empty"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and match in err and "Traceback" not in err


def test_no_traceback_from_the_shell():
    proc = subprocess.run(
        [sys.executable, "-m", "decoding", "x", "--top-p", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "usage:" in proc.stderr and "Traceback" not in proc.stderr


def test_generates_from_a_checkpoint_directory(tiny_model, tmp_path, capsys):
    save_hf_checkpoint(tiny_model, str(tmp_path))
    assert main(["def f(x):", "--model", str(tmp_path), "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def f(x):")
    assert "prefill" in err and "tok/s" in err
    # A context longer than the model's max_position is an argument error too.
    with pytest.raises(SystemExit) as exc:
        main(["x", "--model", str(tmp_path), "--max-new-tokens", "100000"])
    assert exc.value.code == 2


def test_default_model_is_the_shipped_code_target(capsys):
    assert main(["def fibonacci(n):", "--max-new-tokens", "4", "--temperature", "0.8"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def fibonacci(n):") and " tokens | prefill" in err
