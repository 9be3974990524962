"""Generation benchmark: ``python -m benchmarks.generate`` from the repository root.

Tokens/s of ``decoding.generate`` against ``transformers``' ``generate`` (torch, CPU) on the same
random Hugging Face Llama weights, in one run: greedy, 128 new tokens after a 32-token prompt, no
EOS, configs "tiny" (hidden 256, 4 layers, 8 heads, 2 KV heads) and "small" (hidden 768,
12 layers, 12 heads, 4 KV heads), vocabulary 32000, batch 1 and 8, float32.

Each side is warmed up once (our compilation is reported apart as ``compile_s``) and timed as
the median of ``--runs`` calls, wall clock from prompt to tokens on the host. tokens/s counts new
tokens of all rows. ``match`` is the fraction of rows whose greedy tokens agree exactly.

Roofline: a decode step must read every weight once (the embedding table excepted: it is
gathered, unless tied to the LM head) plus each row's cached keys and values. The same run
measures the machine's matrix-vector read bandwidth (:func:`matvec_bandwidth`: the faster of a
jitted ``x @ W`` and the packed-panel kernel over a float32 matrix far larger than the caches,
just before each row), so ``roofline`` = (bytes read per step / bandwidth) / measured seconds
per decode step: 1.0 is the memory limit. ``--dtypes``
adds rows with bfloat16 weights (float32 stays the reference; transformers runs float32).
Writes ``benchmarks/results/generate_cpu.json``, prints a table and the issue's goal ratios.
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
    "tiny": dict(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
    "small": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
    ),
}
VOCAB = 32000
PROMPT_LEN = 32
NEW_TOKENS = 128


def build(name: str, directory: str):
    """A random HF Llama (torch, eval), saved as a checkpoint under ``directory``: (hf, path)."""
    import torch
    import transformers

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
    return hf, path


def matvec_bandwidth(rows: int = 8192, cols: int = 8192, runs: int = 3) -> float:
    """Bytes/s that a jitted float32 matrix-vector product ``x [1, rows] @ W [rows, cols]`` reads
    (W: 256 MiB default): the faster of XLA's product and the packed-panel kernel
    (:mod:`models.rows_matmul`, W packed beforehand) when it is built, since decode steps use
    the latter and a slower probe would make the roofline too lenient."""
    import jax
    import jax.numpy as jnp

    from models import rows_matmul

    w = jax.random.normal(jax.random.key(0), (rows, cols), jnp.float32)
    x = jnp.ones((1, rows), jnp.float32)
    seconds = common.time_fn(jax.jit(lambda x, w: x @ w), x, w, runs=runs, warmup=2)
    if rows_matmul.available():
        panels = jax.block_until_ready(rows_matmul.pack(w))
        del w
        packed = jax.jit(lambda x, p: rows_matmul.matmul(x, p, cols))
        seconds = min(seconds, common.time_fn(packed, x, panels, runs=runs, warmup=2))
    return rows * cols * 4 / seconds


def step_bytes(config, batch: int, kv_len: float) -> float:
    """Bytes one decode step must read: the weights (embedding gathered, so not counted unless
    tied to the head) and ``batch`` rows of ``kv_len`` cached keys and values in every layer."""
    itemsize = config.jnp_dtype.itemsize
    weights = config.num_params() - (0 if config.tie_embeddings else config.vocab_size * config.dim)
    kv = 2 * config.num_layers * config.num_kv_heads * config.resolved_head_dim * kv_len
    return itemsize * (weights + batch * kv)


def step_ops(model, batch: int, capacity: int = 256, page_size: int = 16) -> dict:
    """Load-independent evidence: op counts of one compiled decode forward (T = 1, paged cache)
    of ``batch`` rows: ``dots`` (matrix products), ``fusions`` (XLA kernels) and ``ops`` (all
    instructions), from the optimised HLO text."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models import KVCache

    graphdef, params = nnx.split(model)
    pages = capacity // page_size
    table = np.arange(batch * pages, dtype=np.int32).reshape(batch, pages)
    cache = KVCache.paged(model.config, batch * pages, page_size, table)

    def step(params, tokens, cache):
        return nnx.merge(graphdef, params)(tokens, cache=cache)

    tokens = jnp.zeros((batch, 1), jnp.int32)
    text = jax.jit(step).lower(params, tokens, cache).compile().as_text()
    lines = [
        ln for ln in text.splitlines() if " = " in ln and not ln.lstrip().startswith("ROOT %p")
    ]
    return dict(
        dots=sum(" dot(" in ln for ln in lines),
        fusions=sum(" fusion(" in ln for ln in lines),
        ops=len(lines),
    )


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
        Plot(
            "tokens_per_s",
            x=("config", "batch"),
            y=("ours_tok_s", "hf_tok_s"),
            kind="bar",
            overlay=True,
            logy=True,
            where=(("dtype", "float32"),),
        ),
        Plot("roofline", x=("config", "batch"), y=("roofline",), series=("dtype",), kind="bar"),
    ),
}


def _row(name: str, batch: int, hf_s: float, hf_tokens, ours, prompts, args) -> dict:
    """Times our side on ``prompts`` and sets it against transformers' time and the roofline
    (bandwidth measured just before, so a changing load skews both alike)."""
    bandwidth = matvec_bandwidth()
    our_s, our_tokens, extra = time_ours(ours, prompts, args.runs, args.cache)
    new = batch * NEW_TOKENS
    match = np.mean([a == b for a, b in zip(our_tokens, hf_tokens, strict=True)])
    step_s = batch / extra["decode_tok_s"]
    ideal_s = step_bytes(ours.config, batch, PROMPT_LEN + NEW_TOKENS / 2) / bandwidth
    return dict(
        config=name,
        batch=batch,
        dtype=ours.config.dtype,
        **step_ops(ours, batch),
        ours_tok_s=new / our_s,
        hf_tok_s=new / hf_s,
        speedup=hf_s / our_s,
        ours_s=our_s,
        hf_s=hf_s,
        **extra,
        step_ms=1e3 * step_s,
        roofline_ms=1e3 * ideal_s,
        roofline=ideal_s / step_s,
        matvec_gb_s=bandwidth / 1e9,
        match=float(match),
    )


# (config, batch, dtype, column, threshold): the goals of issue 12 (float32 rows).
GOALS = (
    ("tiny", 1, "float32", "speedup", 4.0),
    ("small", 1, "float32", "roofline", 0.8),
    ("tiny", 8, "float32", "speedup", 3.0),
    ("small", 8, "float32", "speedup", 3.0),
)


def goals(rows: list[dict]) -> list[dict]:
    """Each goal of :data:`GOALS` whose row was measured, with its value and whether it is met."""
    out = []
    for name, batch, dtype, column, threshold in GOALS:
        for r in rows:
            if (r["config"], r["batch"], r["dtype"]) == (name, batch, dtype):
                value = r[column]
                out.append(
                    dict(
                        config=name,
                        batch=batch,
                        dtype=dtype,
                        metric=column,
                        goal=threshold,
                        value=value,
                        met=bool(value >= threshold),
                    )
                )
    return out


def main(argv=None) -> None:
    parser = common.parser(__doc__, runs=3, quick="config tiny, batch 1 (unless given)")
    parser.add_argument("--configs", nargs="+", default=None, choices=list(CONFIGS))
    parser.add_argument("--batches", nargs="+", type=int, default=None)
    parser.add_argument("--cache", choices=("paged", "contiguous"), default="paged")
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=None)
    args = parser.parse_args(argv)
    configs = args.configs or (["tiny"] if args.quick else list(CONFIGS))
    batches = args.batches or ([1] if args.quick else [1, 8])
    dtypes = args.dtypes or (["float32"] if args.quick else ["float32", "bfloat16"])

    import jax.numpy as jnp
    import torch

    from models.hf import load_hf_checkpoint

    rows = []
    total = len(configs) * len(batches) * len(dtypes)
    with tempfile.TemporaryDirectory() as tmp, tqdm(total=total) as bar:
        for name in configs:
            hf, path = build(name, tmp)
            models = {d: load_hf_checkpoint(path, dtype=jnp.dtype(d)) for d in dtypes}
            for batch in batches:
                rng = np.random.default_rng(batch)
                prompts = rng.integers(1, VOCAB, (batch, PROMPT_LEN), dtype=np.int32)
                hf_s, hf_tokens = time_hf(hf, prompts, args.runs, args.warmup)
                for d in dtypes:
                    bar.set_postfix(config=name, batch=batch, dtype=d)
                    rows.append(_row(name, batch, hf_s, hf_tokens, models[d], prompts, args))
                    bar.update()
    columns = [
        "config",
        "batch",
        "dtype",
        "ours_tok_s",
        "hf_tok_s",
        "speedup",
        "prefill_ms",
        "decode_tok_s",
        "step_ms",
        "roofline_ms",
        "roofline",
        "matvec_gb_s",
        "dots",
        "fusions",
        "compile_s",
        "match",
    ]
    settings = dict(
        prompt_len=PROMPT_LEN,
        new_tokens=NEW_TOKENS,
        vocab=VOCAB,
        greedy=True,
        cache=args.cache,
        torch_threads=torch.get_num_threads(),
    )
    met = goals(rows)
    note = (
        "Ours: one jitted prefill + one jitted lax.while_loop decode "
        "(2 dispatches and 2 host syncs per generate call, none per token). roofline = "
        "(bytes read per decode step / matvec bandwidth) / measured step time."
    )
    common.finish(args, "generate_cpu", rows, columns, settings=settings, goals=met, note=note)
    print(f"load average {common.load_average()}")
    for g in met:
        print(
            f"goal {g['config']} B={g['batch']} {g['metric']} >= {g['goal']}: "
            f"{g['value']:.2f} {'MET' if g['met'] else 'NOT MET'}"
        )


if __name__ == "__main__":
    main()
