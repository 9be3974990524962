"""The command line: usage errors (exit 2, no traceback) and a run on a checkpoint directory."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from flax import nnx

import models
from decoding import Engine
from decoding.__main__ import main
from decoding.chat import encode_prompt
from models import ByteTokenizer, Transformer, TransformerConfig
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
        (["hi", "--mesh", "2"], "--mesh: expected DATA,MODEL"),
        (["hi", "--mesh", "1,7"], "must hold all 1 devices"),
        (["--interactive", "--mesh", "1,1"], "drop --mesh"),
        (["hi", "--seed", "-1"], "argument --seed: expected an int in [0, 2**32)"),
        (["hi", "--seed", "99999999999"], "argument --seed: expected an int in [0, 2**32)"),
        (["hi", "--seed", "1.5"], "argument --seed: expected an int in [0, 2**32)"),
        (["hi", "--speculative"], "speculative"),
        ([], "prompt"),
        ([""], "prompt must not be empty"),
        (["hi", "--model", "code-target", "--chat"], "has no chat template"),
        (["hi", "--system", "be brief"], "--system needs --chat"),
        (["--interactive", "--speculative", "prompt-lookup"], "--interactive"),
        (["hi", "--model", "missing.gguf"], "missing.gguf"),
        (["hi", "--dtype", "int8"], "dtype"),
        (["hi", "--quantize", "q9"], "quantize"),
        (["hi", "--quantize", "q8_0", "--mesh", "1,1"], "--quantize does not combine with --mesh"),
        (["hi", "--kv-dtype", "int8"], "kv-dtype"),
        (["hi", "--dtype", "bfloat16", "--kv-dtype", "float16"], "--kv-dtype float16"),
        (["\udcff abc"], "prompt is not valid UTF-8"),  # how argv holds undecodable bytes
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


def test_code_model_continues_a_plain_prompt(capsys):
    argv = ["def fibonacci(n):", "--model", "code-target", "--max-new-tokens", "4"]
    assert main([*argv, "--temperature", "0.8"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def fibonacci(n):") and " tokens | prefill" in err


@pytest.mark.parametrize(
    "flag, value, hook, check",
    [
        ("--quantize", "q4_1", "quantize", lambda m: m.lm_head.fmt == "q4_1"),
        ("--kv-dtype", "bfloat16", "configure", lambda m: m.config.kv_dtype == "bfloat16"),
    ],
)
def test_model_flags_decode_the_changed_model(flag, value, hook, check, monkeypatch, capsys):
    """``--quantize q4_1`` runs ``models.quantize(model, "q4_1")``, ``--kv-dtype bfloat16``
    ``models.configure(model, kv_dtype="bfloat16")``; the text is the engine's for that model."""
    made = []
    real = getattr(models, hook)
    monkeypatch.setattr(models, hook, lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    prompt = "def fibonacci(n):"
    argv = [prompt, "--model", "code-target", "--max-new-tokens", "12", flag, value]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert len(made) == 1 and check(made[0])
    tok = models.pretrained("code-target")[1]
    ids = tok.encode(prompt)
    eng = Engine(made[0], max_batch=1, num_pages=8, page_size=16, max_seq_len=64)
    rid = eng.submit(ids, 12)
    assert out.rstrip("\n") == tok.decode(ids + list(eng.run_until_done()[rid]))


def test_chat_with_the_default_model_streams_an_answer(smollm2_gguf, capsys):
    assert main(["--chat", "What is the capital of France?", "--max-new-tokens", "24"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "The capital of France is Paris."  # greedy; stopped at <|im_end|>
    assert "8 tokens" in err and "paged engine" in err


def test_interactive_chat_prefills_only_the_new_turn(smollm2_gguf, monkeypatch, capsys):
    turns = iter(["What is the capital of France?", "And of Italy?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(turns))
    assert main(["--interactive", "--max-new-tokens", "24", "--context", "512"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out and "Rome" in out
    stats = [line for line in err.splitlines() if "prompt tokens" in line]
    (first_new, first_total), (second_new, second_total) = [
        map(int, line.split("prefill ")[1].split(" prompt")[0].split(" of ")) for line in stats
    ]
    assert first_new == first_total - 1  # the last prompt token is fed by the first decode step
    # Turn two reuses turn one's full pages: it prefills its own tokens and the partial page.
    assert second_total > first_total and second_new < second_total - first_total + 16


def test_bfloat16_chat(smollm2_gguf, capsys):
    # Not the plain question: in bfloat16 its first token is a near tie ("The" against "L",
    # 0.005 nats apart), which any rounding change (the fused decode layer's) flips. This one
    # leads by 1.4 nats, fused or not.
    q = "What is the capital of France? Answer in one word."
    argv = ["--chat", q, "--max-new-tokens", "8"]
    assert main([*argv, "--dtype", "bfloat16"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_ctrl_c_stops_quietly(tmp_path):
    """SIGINT while text streams: exit 130, what was generated stays on the screen, no traceback."""
    argv = [sys.executable, "-m", "decoding", "def f(x):", "--model", "code-target"]
    proc = subprocess.Popen(
        [*argv, "--max-new-tokens", "1500", "--temperature", "1.0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A terminal's Ctrl-C: SIGINT at its default, whatever this (test worker) process has
        # made of it (a child inherits an ignored SIGINT, and Python then never raises it).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout.read(len("def f(x):") + 8)  # the prompt and the first streamed text
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err
    return err


def _gpt2_checkpoint(path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, n_positions=16, vocab_size=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda path: None, "no config.json"),
        (_gpt2_checkpoint, "unsupported architecture 'GPT2LMHeadModel'"),
        (lambda path: (path / "config.json").write_text("{oops"), "not valid JSON"),
    ],
    ids=["empty", "gpt2", "malformed-json"],
)
def test_unloadable_checkpoint_is_a_usage_error(make, match, tmp_path, capsys):
    make(tmp_path)
    err = _usage_error(["hi", "--model", str(tmp_path)], capsys)
    assert f"--model {tmp_path}" in err and match in err


def test_byte_tokenizer_that_does_not_fit_is_a_usage_error(tmp_path, capsys):
    """V = 96 (and no tokenizer files): the byte ids and BOS/EOS 256/257 are out of range."""
    config = TransformerConfig.preset("tiny", vocab_size=96, bos_id=None, eos_id=None)
    save_hf_checkpoint(Transformer(config, rngs=nnx.Rngs(0)), str(tmp_path))
    err = _usage_error(["hi", "--model", str(tmp_path)], capsys)
    assert "byte tokenizer" in err and "does not fit" in err and "vocab_size 96" in err
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 96


@pytest.mark.parametrize(
    "vocab_size, ids, want_ids, want_eos",
    [
        (264, dict(bos_id=5, eos_id=7), [5, 104, 105], 7),  # the checkpoint's ids first
        (264, dict(bos_id=None, eos_id=None), [256, 104, 105], 257),  # else the tokenizer's
        (256, dict(bos_id=None, eos_id=None), [104, 105], None),  # ... where they fit
    ],
)
def test_special_ids_come_from_the_checkpoint(vocab_size, ids, want_ids, want_eos):
    config = TransformerConfig.preset("tiny", vocab_size=vocab_size, **ids)
    assert encode_prompt("hi", ByteTokenizer(), config) == (want_ids, want_eos)
