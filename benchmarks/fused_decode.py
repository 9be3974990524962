"""Fused decode layer benchmark: ``python -m benchmarks.fused_decode`` from the repository root.

B = 1 (``--batch``) greedy decoding of 128 tokens after a chat prompt on SmolLM2-135M-Instruct
through ``decoding.generate``, with the layers as one native call each (``models.fused_decode``)
and as XLA ops around the native products (``model.fused_decode = False``), in one process: the
two alternate call by call, so load on a shared machine hits both alike and their ratio is the
figure to read. Rows: float32 and bfloat16 weights, Q8_0 and Q4_0 quantized from the float32
ones, and the file's own Q4_1 blocks (``--quick``: float32 only). Decode tokens/s as
``GenerateResult.stats["decode_tokens_per_s"]`` (prefill and first token excluded), medians of
``--runs`` calls after ``--warmup``; ``same_tokens``: whether both paths produced the same 128
tokens. About 1 minute per row on a quiet 2-core machine.

Writes ``benchmarks/results/fused_decode_cpu.json``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from benchmarks import common

NEW_TOKENS = 128
QUESTION = "Explain in a few sentences why the sky is blue."
WEIGHTS = ("float32", "bfloat16", "q8_0", "q4_0", "q4_1")


def load(weights: str, cache: dict):
    import models
    from models.pretrained import DEFAULT_MODEL, installed_path

    source = installed_path(DEFAULT_MODEL)
    if weights in ("float32", "bfloat16"):
        return models.load_gguf(source, dtype=jnp.dtype(weights))
    if weights == "q4_1":
        return models.load_gguf(source, quantized=True)  # the file's own blocks
    if "float32" not in cache:
        cache["float32"] = models.load_gguf(source, dtype=jnp.float32)
    return models.quantize(cache["float32"], weights)


def compare(model, prompt: list[int], batch: int, args) -> dict:
    """Median decode tokens/s of both paths, alternating call by call."""
    from decoding import generate

    speed = {True: [], False: []}
    tokens = {}
    for run in range(args.warmup + args.runs):
        for fused in (False, True):
            model.fused_decode = fused
            res = generate(model, [prompt] * batch, max_new_tokens=NEW_TOKENS)
            tokens[fused] = res.tokens
            if run >= args.warmup:
                speed[fused].append(res.stats["decode_tokens_per_s"])
    model.fused_decode = True
    fused, unfused = float(np.median(speed[True])), float(np.median(speed[False]))
    return dict(
        fused_tok_s=fused,
        unfused_tok_s=unfused,
        ratio=fused / unfused,
        same_tokens=tokens[True] == tokens[False],
    )


def main(argv=None) -> None:
    p = common.parser(__doc__, runs=3, quick="float32 only")
    p.add_argument("--batch", type=common.positive, default=1, help="rows per call (<= 8)")
    args = p.parse_args(argv)
    if args.batch > 8:
        p.error(f"--batch must be at most 8, got {args.batch}")
    import models
    from models import fused_decode
    from models.pretrained import DEFAULT_MODEL

    if not fused_decode.enabled():
        p.error("the fused decode layer is unavailable (no native kernels, or disabled)")
    _, tok = models.pretrained(DEFAULT_MODEL)
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}])
    rows, cache = [], {}
    for weights in WEIGHTS[:1] if args.quick else WEIGHTS:
        row = compare(load(weights, cache), prompt, args.batch, args)
        rows.append(dict(weights=weights, batch=args.batch, **row))
        print(rows[-1], flush=True)
    columns = ["weights", "batch", "unfused_tok_s", "fused_tok_s", "ratio", "same_tokens"]
    common.finish(args, "fused_decode_cpu", rows, columns, new_tokens=NEW_TOKENS)


if __name__ == "__main__":
    main()
