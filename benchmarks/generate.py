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

import argparse
import os
import statistics
import tempfile
import time

import numpy as np
from tqdm import tqdm

from benchmarks import common

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


def time_hf(hf, prompts: np.ndarray, runs: int):
    import torch

    ids = torch.from_numpy(prompts).long()
    kwargs = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    times, out = [], None
    with torch.inference_mode():
        hf.generate(ids, **kwargs)  # warm-up
        for _ in range(runs):
            start = time.perf_counter()
            out = hf.generate(ids, **kwargs)
            times.append(time.perf_counter() - start)
    return statistics.median(times), out[:, prompts.shape[1] :].tolist()


def time_ours(model, prompts: np.ndarray, runs: int, cache: str):
    from decoding import generate

    warm = generate(model, prompts, max_new_tokens=NEW_TOKENS, cache=cache)
    times, stats, res = [], [], None
    for _ in range(runs):
        start = time.perf_counter()
        res = generate(model, prompts, max_new_tokens=NEW_TOKENS, cache=cache)
        times.append(time.perf_counter() - start)
        stats.append(res.stats)
    extra = dict(
        compile_s=warm.stats["compile_s"],
        prefill_ms=1e3 * statistics.median(s["prefill_s"] for s in stats),
        decode_tok_s=statistics.median(s["decode_tokens_per_s"] for s in stats),
    )
    return statistics.median(times), res.tokens, extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cache", choices=("paged", "contiguous"), default="paged")
    args = parser.parse_args()

    import torch

    rows = []
    cases = [(c, b) for c in args.configs for b in args.batches]
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=len(cases), desc="generate") as bar:
        for name in args.configs:
            hf, ours = build(name, tmp)
            for batch in args.batches:
                bar.set_postfix(config=name, batch=batch)
                rng = np.random.default_rng(batch)
                prompts = rng.integers(1, VOCAB, (batch, PROMPT_LEN), dtype=np.int32)
                hf_s, hf_tokens = time_hf(hf, prompts, args.runs)
                our_s, our_tokens, extra = time_ours(ours, prompts, args.runs, args.cache)
                new = batch * NEW_TOKENS
                rows.append(
                    dict(
                        config=name,
                        batch=batch,
                        ours_tok_s=new / our_s,
                        hf_tok_s=new / hf_s,
                        speedup=hf_s / our_s,
                        ours_s=our_s,
                        hf_s=hf_s,
                        **extra,
                        match=float(
                            np.mean([a == b for a, b in zip(our_tokens, hf_tokens, strict=True)])
                        ),
                    )
                )
                bar.update()
    columns = ["config", "batch", "ours_tok_s", "hf_tok_s", "speedup", "prefill_ms",
               "decode_tok_s", "compile_s", "match"]  # fmt: skip
    common.print_table(rows, columns)
    path = common.write_results(
        "generate_cpu",
        rows,
        settings=dict(
            prompt_len=PROMPT_LEN,
            new_tokens=NEW_TOKENS,
            vocab=VOCAB,
            dtype="float32",
            greedy=True,
            cache=args.cache,
            runs=args.runs,
            torch=torch.__version__,
            torch_threads=torch.get_num_threads(),
        ),
        note=(
            "CPU shared with other processes during the run (several agents on 2 cores); "
            "figures are noisy. Ours: one jitted prefill + one jitted lax.while_loop decode "
            "(2 dispatches and 2 host syncs per generate call, none per token)."
        ),
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
