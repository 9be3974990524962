"""The command line's ``--speculative`` / ``--num-draft-tokens``: usage errors and a run."""

from __future__ import annotations

import pytest

from decoding.__main__ import main
from models.hf import save_hf_checkpoint


@pytest.mark.parametrize(
    "argv, match",
    [
        (["hi", "--speculative", "big-draft"], "speculative"),
        (["hi", "--speculative", "early-exit:0"], "speculative"),
        (["hi", "--speculative", "early-exit:x"], "speculative"),
        (["hi", "--speculative", "prompt-lookup", "--num-draft-tokens", "0"], "num-draft-tokens"),
        (["hi", "--num-draft-tokens", "3"], "needs --speculative"),
        (["hi", "--model", "code-target", "--speculative", "eagle"], "no shipped EAGLE head"),
        (
            ["hi", "--model", "code-target", "--speculative", "eagle+lookup"],
            "--speculative eagle+lookup: no shipped EAGLE head",
        ),
    ],
)
def test_bad_speculative_arguments_are_usage_errors(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and match in err and "Traceback" not in err


def test_speculative_run_prints_acceptance(tiny_model, tmp_path, capsys):
    save_hf_checkpoint(tiny_model, str(tmp_path))
    argv = ["def f(x):", "--model", str(tmp_path), "--max-new-tokens", "6"]
    assert main([*argv, "--speculative", "prompt-lookup", "--num-draft-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def f(x):")
    assert "acceptance" in err and "tokens/target call" in err and "tok/s" in err
    # The tiny model has 2 layers: an early exit after 2 is an argument error.
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--speculative", "early-exit:2"])
    assert exc.value.code == 2
    assert "num_layers" in capsys.readouterr().err


@pytest.mark.parametrize("spec", ["medusa", "medusa-tree"])
def test_medusa_on_the_shipped_target_and_a_mismatched_model(spec, tiny_model, tmp_path, capsys):
    argv = ["def f(x):", "--max-new-tokens", "5", "--speculative", spec]
    assert main([*argv, "--model", "code-target"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def f(x):") and "tokens/target call" in err
    save_hf_checkpoint(tiny_model, str(tmp_path))  # heads for code-target do not fit it
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--model", str(tmp_path)])
    assert exc.value.code == 2
    assert "Medusa heads" in capsys.readouterr().err
