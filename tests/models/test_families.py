"""Qwen3, Gemma 3 and Llama 3.2 against ``transformers`` (torch CPU) on random small models, each
loaded from Hugging Face safetensors and from a GGUF file written here the way llama.cpp's
converter writes it: float32 logits (B = 2, ragged lengths, T longer than Gemma's window), greedy
``generate`` with both caches, bfloat16, bit-exact Hugging Face round trips."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_utils import jit_model, write_gguf_like_llama_cpp

from decoding import generate
from models.gguf import load_gguf
from models.hf import load_hf_checkpoint, save_hf_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB = 101
_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    intermediate_size=80,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # != hidden_size / heads (12)
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # large enough that greedy output is not one repeated token
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=0,
)
WINDOW = 5
FAMILIES = {
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_hidden_layers=2, rope_theta=10000.0, tie_word_embeddings=False),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            num_hidden_layers=6,
            # not llama.cpp's fixed pattern (every 6th layer global), which the GGUF test uses
            layer_types=["sliding_attention", "full_attention"]
            + ["sliding_attention"] * 3
            + ["full_attention"],
            sliding_window=WINDOW,
            # not head_dim, so that a softmax scale of 1 / sqrt(D) would be caught
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            tie_word_embeddings=True,
        ),
    ),
    "llama3.2": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_hidden_layers=2,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
}
T = 20  # longer than Gemma's window (5) and llama3's original_max_position (16)
LENGTHS = (T, T - 7)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, checkpoint directory)."""
    name = request.param
    config_cls, model_cls, extra = FAMILIES[name]
    config = getattr(transformers, config_cls)(**_SMALL, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(config).eval().float()
    with torch.no_grad():  # random (not default-initialised) norms
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.add_(0.3 * torch.randn_like(p))
            if name == "gemma3" and "embed" in pname:
                # Gemma's sqrt(dim)-scaled tied embedding would otherwise dominate the residual
                # stream of a random model, and greedy decoding repeat the last token
                p.mul_(0.1)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return name, hf, path


def _tokens():
    rng = np.random.default_rng(0)
    return rng.integers(1, VOCAB, size=(2, T)).astype(np.int32)


def _hf_logits(hf, tokens):
    """transformers' logits of each row on its own (its valid length only)."""
    with torch.no_grad():
        return [
            hf(torch.tensor(tokens[b : b + 1, :n])).logits[0].numpy() for b, n in enumerate(LENGTHS)
        ]


def _parity(model, hf) -> float:
    """max |ours - transformers| / max |logit| over the valid positions of a ragged batch."""
    tokens = _tokens()
    padded = tokens.copy()
    for b, n in enumerate(LENGTHS):
        padded[b, n:] = 0  # right padding: causal attention keeps it out of the valid positions
    got = np.asarray(jit_model(model)(jnp.asarray(padded)))
    want = _hf_logits(hf, tokens)
    err = max(
        np.abs(got[b, :n] - w).max() for b, (n, w) in enumerate(zip(LENGTHS, want, strict=True))
    )
    return float(err / max(np.abs(w).max() for w in want))


def test_hf_logits_match_transformers(family):
    name, hf, path = family
    model = load_hf_checkpoint(str(path), attn_impl="xla")
    if name == "gemma3":
        c = model.config
        assert [c.is_sliding(i) for i in range(6)] == [True, False, True, True, True, False]
        assert c.local_rope_theta == 1e4 and c.rope_theta == 1e6
    err = _parity(model, hf)
    print(f"{name} HF float32 parity: {err:.2e}")
    assert err < 1e-5, err


def _as_llama_cpp_assumes(hf):
    """The Gemma 3 model with ``hf``'s weights and what llama.cpp assumes of a gemma3 GGUF file
    (which does not hold it): every 6th layer global (transformers' default pattern too), local
    RoPE base 10000, softmax scale ``1 / sqrt(head_dim)``."""
    config_cls, model_cls, extra = FAMILIES["gemma3"]
    extra = {**extra, "query_pre_attn_scalar": _SMALL["head_dim"]}
    del extra["layer_types"]
    config = getattr(transformers, config_cls)(**_SMALL, **extra)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(config).eval().float()
    model.load_state_dict(hf.state_dict())
    return model


def test_gguf_logits_match_transformers(family, tmp_path):
    name, hf, path = family
    gguf_path = write_gguf_like_llama_cpp(hf, path, tmp_path / f"{name}.gguf")
    model = load_gguf(gguf_path, attn_impl="xla")
    assert model.config.tie_embeddings == hf.config.tie_word_embeddings
    if name == "gemma3":  # the file lacks the pattern, local base and scale: llama.cpp's
        c = model.config
        assert [c.is_sliding(i) for i in range(6)] == [True] * 5 + [False]
        assert (c.local_rope_theta, c.query_pre_attn_scalar) == (1e4, _SMALL["head_dim"])
        hf = _as_llama_cpp_assumes(hf)
    err = _parity(model, hf)
    print(f"{name} GGUF float32 parity: {err:.2e}")
    assert err < 1e-5, err


def _hf_greedy(hf, prompt, n):
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


NEW = 32
# The heavier checks run in CI for the families with new code paths; Llama 3.2's pieces (tied
# head, Llama-3 RoPE) are covered there by the logits tests and Llama generation by
# tests/decoding/test_hf_equivalence.py, so its variants (and Qwen3's bfloat16) are slow-marked.
_SLOW = pytest.mark.slow
_GENERATE = ["gemma3", "qwen3", pytest.param("llama3.2", marks=_SLOW)]
_BF16 = ["gemma3", pytest.param("qwen3", marks=_SLOW), pytest.param("llama3.2", marks=_SLOW)]


@pytest.mark.parametrize("family", _GENERATE, indirect=True)
def test_greedy_generate_matches_transformers_paged_and_contiguous(family):
    name, hf, path = family
    prompts = [p[:n].tolist() for p, n in zip(_tokens(), (9, 4), strict=True)]
    want = [_hf_greedy(hf, p, NEW) for p in prompts]
    assert len({tuple(w) for w in want}) == 2 and len(set(want[0])) > 3  # not degenerate
    model = load_hf_checkpoint(str(path))
    paged = generate(model, prompts, max_new_tokens=NEW, cache="paged", page_size=4)
    contiguous = generate(model, prompts, max_new_tokens=NEW, cache="contiguous")
    assert paged.tokens == want
    assert contiguous.tokens == want


@pytest.mark.parametrize("family", _BF16, indirect=True)
def test_bfloat16_runs_and_stays_close(family):
    name, hf, path = family
    model = load_hf_checkpoint(str(path), dtype=jnp.bfloat16, attn_impl="xla")
    assert model.embed.embedding[...].dtype == jnp.bfloat16
    tokens = jnp.asarray(_tokens())
    got = np.asarray(jit_model(model)(tokens))
    want = np.asarray(jit_model(load_hf_checkpoint(str(path), attn_impl="xla"))(tokens))
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


def test_hf_round_trip_is_bit_exact(family, tmp_path):
    name, hf, path = family
    model = load_hf_checkpoint(str(path))
    save_hf_checkpoint(model, str(tmp_path))
    again = load_hf_checkpoint(str(tmp_path))
    assert again.config == model.config
    for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)),
        jax.tree.leaves(nnx.state(again, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    # and transformers reads what was written as the model it came from
    reread = type(hf).from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    tokens = torch.tensor(_tokens()[:1])
    with torch.no_grad():
        np.testing.assert_array_equal(reread(tokens).logits.numpy(), hf(tokens).logits.numpy())


# --- Gemma's GGUF vocabulary: SentencePiece ('llama' model), no space prefix ------------------


@pytest.fixture(scope="module")
def gemma_vocab(tmp_path_factory):
    """A vocabulary laid out as llama.cpp's converter writes Gemma's: <pad>/<eos>/<bos>/<unk>,
    turn markers (CONTROL), 256 byte-fallback pieces, pieces with U+2581 for spaces ranked by
    score, ``add_space_prefix`` false; and the same vocabulary with the prefix, for transformers'
    GGUF tokenizer (which always prefixes) as the oracle."""
    from tokenizer_utils import learn_sentencepiece_bpe, write_vocab_gguf

    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello there: theory"]
    pieces = learn_sentencepiece_bpe(corpus * 3, n_merges=50)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    types = [3, 3, 3, 2, 3, 3, *[6] * 256, *[1] * len(pieces)]
    scores = [0.0] * (len(tokens) - len(pieces)) + [-float(r) for r in range(len(pieces))]
    keys = dict(
        model="llama",
        tokens=tokens,
        scores=scores,
        token_type=types,
        bos_token_id=2,
        eos_token_id=1,
        unknown_token_id=3,
        padding_token_id=0,
    )
    d = tmp_path_factory.mktemp("gemma_vocab")
    return (
        write_vocab_gguf(d / "gemma.gguf", add_space_prefix=False, **keys),
        write_vocab_gguf(d / "prefixed.gguf", add_space_prefix=True, **keys),
    )


def test_gemma_sentencepiece_vocab(gemma_vocab):
    from tokenizer_utils import hf_gguf_tokenizer

    from models.tokenizer import load_tokenizer

    gemma, prefixed = gemma_vocab
    tok, hf = load_tokenizer(gemma), hf_gguf_tokenizer(str(prefixed))
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.add_bos) == (2, 1, 0, True)
    # Text that starts with a space is tokenized alike with and without the prefix option.
    for text in [" the theory", " hello  world\n", " naïve 😀", " x<start_of_turn>user\nhi"]:
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False), text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    # Without it no U+2581 is prepended: "the" is spelled from its letters, not as "▁the".
    the = tok.encode("the")
    assert the != hf.encode("the", add_special_tokens=False)
    assert tok.decode(the) == "the" and tok.encode(" the") == hf.encode(" the")[-1:]
    ids = tok.encode("Ω")  # not a piece: its UTF-8 bytes through the <0xNN> pieces
    assert [i - 6 for i in ids] == list("Ω".encode())
    turn = tok.encode("<start_of_turn>user")
    assert turn[0] == 4 and tok.decode(turn) == "user"  # a control token, dropped by decode


# --- paged cache: rings of pages for the sliding layers -----------------------------------------


def _cached_step(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, cache):
        return nnx.merge(graphdef, state)(tokens, cache=cache)

    return lambda tokens, cache: step(state, tokens, cache)


@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_sliding_layers_keep_a_ring_of_pages(family):
    """Gemma 3 decoding far past its window (5) with rings for its sliding layers: the logits of
    the contiguous cache at every step, while the sliding layers hold R pages per row, not all."""
    from models.kv_cache import KVCache, ring_pages_for

    _, _, path = family
    model = load_hf_checkpoint(str(path), attn_impl="xla")
    c = model.config
    B, P, chunk, total = 2, 2, 3, 30
    tokens = jnp.asarray(np.random.default_rng(3).integers(1, VOCAB, (B, total)), jnp.int32)
    R = ring_pages_for(c.sliding_window, chunk, P)  # calls of up to 3 tokens (as a verifier's)
    max_pages = total // P
    table = np.arange(B * max_pages, dtype=np.int32).reshape(B, max_pages)
    ring = KVCache.paged(c, B * max_pages, P, table, ring_pages=R)
    full = KVCache.contiguous(c, B, total)
    sliding = [i for i in range(c.num_layers) if c.is_sliding(i)]
    assert R * P < total - chunk and len(sliding) == 4
    for i in range(c.num_layers):
        assert ring.k[i].shape[0] == (B * R if i in sliding else B * max_pages)
    pages = sum(k.shape[0] for k in ring.k)
    assert pages == 4 * B * R + 2 * B * max_pages < c.num_layers * B * max_pages
    step = _cached_step(model)
    worst, scale, t = 0.0, 0.0, 0
    while t < total:  # the prompt and a middle stretch in 3-token calls, the rest one by one
        n = chunk if t == 0 or 15 <= t < 21 else 1
        got, ring = step(tokens[:, t : t + n], ring)
        want, full = step(tokens[:, t : t + n], full)
        worst = max(worst, float(np.abs(np.asarray(got) - np.asarray(want)).max()))
        scale = max(scale, float(np.abs(np.asarray(want)).max()))
        t += n
    assert worst < 1e-5 * scale, worst
    with pytest.raises(ValueError, match="rings of"):  # a call longer than the ring can hold
        step(tokens[:, : R * P], ring.replace(lengths=jnp.zeros(B, jnp.int32)))


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "qwen3"], indirect=True)
def test_speculative_decoding_is_lossless(family):
    """Greedy speculative decoding (a self-speculating early exit, which runs the family's
    layers through decoding.drafts' own forward) gives the target's greedy tokens."""
    from decoding import speculative_generate
    from decoding.drafts import EarlyExit

    _, _, path = family
    model = load_hf_checkpoint(str(path))
    prompts = [p[:n].tolist() for p, n in zip(_tokens(), (9, 4), strict=True)]
    want = generate(model, prompts, max_new_tokens=16).tokens
    got = speculative_generate(
        model, EarlyExit(1), prompts, num_draft_tokens=3, max_new_tokens=16, page_size=4
    )
    assert got.tokens == want


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "qwen3"], indirect=True)
def test_engine_matches_generate(family):
    """The continuous-batching engine (chunked prefill, pages shared by its prefix cache)
    produces the greedy tokens of ``generate``."""
    from decoding import Engine

    _, _, path = family
    model = load_hf_checkpoint(str(path))
    prompts = [p[:n].tolist() for p, n in zip(_tokens(), (9, 4), strict=True)]
    want = generate(model, prompts, max_new_tokens=12).tokens
    engine = Engine(model, max_batch=2, num_pages=32, page_size=4, max_prefill_tokens=4)
    ids = [engine.submit(p, 12) for p in prompts]
    out = engine.run_until_done()
    assert [out[i] for i in ids] == want


# --- save_gguf for the new families, and what cannot be written ------------------------------


def test_save_gguf_round_trips(family, tmp_path):
    from models.gguf import save_gguf

    name, hf, path = family
    model = load_hf_checkpoint(str(path), attn_impl="xla")
    if name == "gemma3":  # a gemma3 file holds only llama.cpp's pattern, local base and scale
        with pytest.raises(ValueError, match="gemma3 GGUF file cannot hold this model"):
            save_gguf(model, tmp_path / "no.gguf")
        model = load_gguf(write_gguf_like_llama_cpp(hf, path, tmp_path / "in.gguf"))
    save_gguf(model, tmp_path / "out.gguf")
    again = load_gguf(tmp_path / "out.gguf", attn_impl="xla")
    eps = float(np.float32(model.config.norm_eps))  # GGUF holds a float32
    assert again.config == model.config.replace(attn_impl="xla", norm_eps=eps)
    for a, b in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)),
        jax.tree.leaves(nnx.state(again, nnx.Param)),
        strict=True,
    ):
        # exact but for Gemma's norms, stored as 1 + w (float32 rounding of the sum)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_configs_no_family_has_are_refused():
    from models import TransformerConfig
    from models.hf import config_from_hf, config_to_hf

    base = TransformerConfig.preset("tiny")
    for bad in (
        dict(norm_plus_one=True),  # Gemma's norms without the rest of Gemma
        dict(qk_norm=True, qkv_bias=True),
        dict(layer_types=("sliding_attention", "full_attention"), sliding_window=4),
    ):
        with pytest.raises(ValueError, match="no supported Hugging Face architecture"):
            config_to_hf(base.replace(**bad))
    gemma = config_to_hf(
        base.replace(
            qk_norm=True,
            norm_plus_one=True,
            sandwich_norm=True,
            embed_scale=True,
            mlp_act="gelu_tanh",
        )
    )
    assert gemma["architectures"] == ["Gemma3ForCausalLM"]
    for key, value, match in [
        ("hidden_activation", "silu", "hidden_activation"),
        ("layer_types", ["full_attention"], "layer_types must be a list of"),
        ("use_bidirectional_attention", True, "bidirectional"),
        ("query_pre_attn_scalar", 0, "query_pre_attn_scalar must be a positive"),
    ]:
        with pytest.raises(ValueError, match=match):
            config_from_hf({**gemma, key: value})
    with pytest.raises(ValueError, match="layer_types"):
        TransformerConfig.preset("tiny", layer_types=("local", "global"))


_SHARD_SCRIPT = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import Mesh
import models
from models import Transformer, TransformerConfig
from decoding import generate
families = {
    "gemma3": dict(qk_norm=True, norm_plus_one=True, sandwich_norm=True, embed_scale=True,
                   mlp_act="gelu_tanh", sliding_window=3, local_rope_theta=1e4, rope_theta=1e6,
                   layer_types=("sliding_attention", "full_attention"), query_pre_attn_scalar=24,
                   tie_embeddings=True),
    "qwen3": dict(qk_norm=True, head_dim=16),
}
for kw in families.values():
    c = TransformerConfig(vocab_size=104, dim=48, num_layers=2, num_heads=4, num_kv_heads=2,
                          mlp_dim=80, attn_impl="xla", **kw)
    m = Transformer(c, rngs=nnx.Rngs(0))
    tok = jnp.asarray(np.random.default_rng(0).integers(0, 104, (2, 12)), jnp.int32)
    want, prompts = m(tok), [[1, 2, 3, 4, 5], [7, 8]]
    g0 = generate(m, prompts, max_new_tokens=8).tokens
    models.shard(m, Mesh(np.array(jax.devices()).reshape(1, 2), ("data", "model")))
    assert float(jnp.abs(m(tok) - want).max()) < 1e-5 * float(jnp.abs(want).max())
    assert generate(m, prompts, max_new_tokens=8).tokens == g0
print("ok")
"""


@pytest.mark.slow
def test_tensor_parallel_qwen3_and_gemma3():
    """Sharded over 2 host devices (heads and MLP over "model"), Qwen3 and Gemma 3 give the
    unsharded logits and greedy tokens (a fresh process: the device count is fixed at start)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _SHARD_SCRIPT], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_gemma3_linear_rope_scaling_matches_transformers(tmp_path):
    """Gemma 3 4B and larger scale their global layers' RoPE linearly (factor 8)."""
    config_cls, model_cls, extra = FAMILIES["gemma3"]
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }
    config = getattr(transformers, config_cls)(**_SMALL, **{**extra, "rope_parameters": rope})
    config._attn_implementation = "eager"
    torch.manual_seed(1)
    hf = getattr(transformers, model_cls)(config).eval().float()
    hf.save_pretrained(tmp_path)
    model = load_hf_checkpoint(str(tmp_path), attn_impl="xla")
    assert (model.config.rope_scaling.rope_type, model.config.rope_scaling.factor) == ("linear", 8)
    assert _parity(model, hf) < 1e-5
