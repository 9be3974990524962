"""Greedy generation equals transformers' greedy ``generate`` on random Hugging Face Llama weights,
for both the paged and the contiguous cache."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from decoding import generate  # noqa: E402
from models.hf import load_hf_checkpoint  # noqa: E402

PROMPTS = [[11, 200, 7, 42, 5, 9], [3, 14, 15], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
NEW = 16


@pytest.fixture(scope="module")
def hf_and_ours(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,  # large enough that greedy output is not one repeated token
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf = transformers.LlamaForCausalLM(config).eval().float()
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_hf_checkpoint(str(path))


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("cache", ["paged", "contiguous"])
def test_greedy_matches_transformers(hf_and_ours, cache):
    hf, ours = hf_and_ours
    want = [hf_greedy(hf, p, NEW) for p in PROMPTS]
    assert len({tuple(w) for w in want}) == len(PROMPTS)  # a non-degenerate comparison
    got = generate(ours, PROMPTS, max_new_tokens=NEW, cache=cache, page_size=8)
    assert got.tokens == want
