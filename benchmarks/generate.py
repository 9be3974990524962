"""Generation benchmark: ``python -m benchmarks.generate`` from the repository root.

Tokens/s of ``decoding.generate`` against ``transformers``' ``generate`` (torch, CPU) on the same
random Hugging Face Llama weights, in one run: greedy, 128 new tokens after a 32-token prompt, no
EOS, configs "tiny" (hidden 256, 4 layers, 8 heads, 2 KV heads) and "small" (hidden 768,
12 layers, 12 heads, 4 KV heads), vocabulary 32000, batch 1 and 8, float32.

Each side is warmed up once (our compilation is reported apart as ``compile_s``) and timed as
the median of ``--runs`` calls, wall clock from prompt to tokens on the host. tokens/s counts new
tokens of all rows. ``match`` is the fraction of rows whose greedy tokens agree exactly.
Writes ``benchmarks/results/generate_cpu.json`` and prints a table.
"""

from __future__ import annotations

import os
import statistics
import tempfile

import numpy as np
from tqdm import tqdm

from benchmarks import common
from benchmarks.plot import Plot

CONFIGS = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2),
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                  num_attention_heads=12, num_key_value_heads=4),
}  # fmt: skip
VOCAB = 32000
PROMPT_LEN = 32
NEW_TOKENS = 128


def build(name: str, directory: str):
    """A random HF Llama (torch, eval) and the same weights as a ``models.Transformer``."""
    import torch
    import transformers

    from models.hf import load_hf_checkpoint

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        **CONFIGS[name],
    )
    hf = transformers.LlamaForCausalLM(config).eval().float()
    path = os.path.join(directory, name)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, load_hf_checkpoint(path)


def time_hf(hf, prompts: np.ndarray, runs: int, warmup: int = 1):
    import torch

    ids = torch.from_numpy(prompts).long()
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    with torch.inference_mode():
        m = common.measure(lambda: hf.generate(ids, **kwargs), runs=runs, warmup=warmup)
    return m.median, m.result[:, prompts.shape[1] :].tolist()


def time_ours(model, prompts: np.ndarray, runs: int, cache: str):
    """Our median seconds and tokens; the warm-up call is made here, its compile time reported."""
    from decoding import generate

    def call():
        return generate(model, prompts, max_new_tokens=NEW_TOKENS, cache=cache)

    stats = []

    def timed():
        res = call()
        stats.append(res.stats)
        return res.tokens

    warm = call()
    m = common.measure(timed, runs=runs, warmup=0)
    return (
        m.median,
        m.result,
        dict(
            compile_s=warm.stats["compile_s"],
            prefill_ms=1e3 * statistics.median(s["prefill_s"] for s in stats),
            decode_tok_s=statistics.median(s["decode_tokens_per_s"] for s in stats),
        ),
    )


PLOTS = {
    "generate_cpu": (
        Plot("tokens_per_s", x=("config", "batch"), y=("ours_tok_s", "hf_tok_s"), kind="bar",
             overlay=True, logy=True),
    ),
}  # fmt: skip


def _row(name: str, batch: int, hf, ours, args) -> dict:
    """Times both sides on the same random prompts of ``batch`` rows."""
    rng = np.random.default_rng(batch)
    prompts = rng.integers(1, VOCAB, (batch, PROMPT_LEN), dtype=np.int32)
    hf_s, hf_tokens = time_hf(hf, prompts, args.runs, args.warmup)
    our_s, our_tokens, extra = time_ours(ours, prompts, args.runs, args.cache)
    new = batch * NEW_TOKENS
    match = np.mean([a == b for a, b in zip(our_tokens, hf_tokens, strict=True)])
    return dict(
        config=name,
        batch=batch,
        ours_tok_s=new / our_s,
        hf_tok_s=new / hf_s,
        speedup=hf_s / our_s,
        ours_s=our_s,
        hf_s=hf_s,
        **extra,
        match=float(match),
    )


def main(argv=None) -> None:
    parser = common.parser(__doc__, runs=3, quick="config tiny, batch 1 (unless given)")
    parser.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS))
    parser.add_argument("--batches", nargs="+", type=int, default=None)
    parser.add_argument("--cache", choices=("paged", "contiguous"), default="paged")
    args = parser.parse_args(argv)
    configs = args.configs or (["tiny"] if args.quick else list(CONFIGS))
    batches = args.batches or ([1] if args.quick else [1, 8])

    import torch

    rows = []
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=len(configs) * len(batches)) as bar:
        for name in configs:
            hf, ours = build(name, tmp)
            for batch in batches:
                bar.set_postfix(config=name, batch=batch)
                rows.append(_row(name, batch, hf, ours, args))
                bar.update()
    columns = ["config", "batch", "ours_tok_s", "hf_tok_s", "speedup", "prefill_ms",
               "decode_tok_s", "compile_s", "match"]  # fmt: skip
    settings = dict(
        prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, vocab=VOCAB, dtype="float32",
        greedy=True, cache=args.cache, torch_threads=torch.get_num_threads(),
    )  # fmt: skip
    note = (
        "Ours: one jitted prefill + one jitted lax.while_loop decode "
        "(2 dispatches and 2 host syncs per generate call, none per token)."
    )
    common.finish(args, "generate_cpu", rows, columns, settings=settings, note=note)


if __name__ == "__main__":
    main()
