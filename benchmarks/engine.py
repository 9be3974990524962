"""Continuous batching benchmark: ``python -m benchmarks.engine [--quick]`` from the repository root.

64 requests whose total lengths (prompt + new tokens) cycle through the seed's 100 / 500 / 50 / 200
tokens in a shuffled order, the prompt taking a random 20-80% of each, max length 4096; the "tiny"
config (random weights, ``max_position`` 4096), greedy, no EOS (each request stops at its own
``max_new_tokens``), float32, the XLA attention path on CPU. ``--scale s`` divides every length
(and the max length) by ``s`` for a slow CPU; ``--quick`` is 16 requests at scale 4.

* engine: ``decoding.Engine`` (batch 8, pages of 16) with every request submitted at once; its
  pool has as many token slots as a contiguous cache preallocating the max length for 8 rows.
  Run twice: with the block table as wide as the max length (the default ``max_seq_len``), and
  as wide as the longest request (``max_seq_len`` = that length): the blockwise XLA attention
  path reads the whole table width per row and step, the native CPU kernel (``pallas_attn.cpu``)
  each row's own keys only.
* static: ``decoding.generate`` (contiguous cache) on consecutive groups of 8 requests; a group
  runs until its longest request is done, rows that finished early keep their slot.

Both are warmed up once on the same requests (compilation excluded) and timed on a second pass.
tokens/s counts each request's own new tokens only. KV memory utilization over the engine's steps:
live tokens over the token slots the running requests hold as pages (paged), against live tokens
over ``max length`` slots per running request (contiguous preallocation, the seed's ~5%). Writes
``benchmarks/results/engine_cpu.json`` and ``engine_cpu.png`` and prints a table.

``--speculation [--quick] [--batches B ...]``: SmolLM2-135M-Instruct in the engine with and
without prompt lookup (:func:`speculation`): throughput and mean latency at batch 1, 8 and 32;
``benchmarks/results/engine_speculative.json``.
"""

from __future__ import annotations

import os
import time

import numpy as np

from benchmarks import common

LENGTHS = (100, 500, 50, 200)  # the seed's example request lengths
MAX_LEN = 4096
BATCH = 8
PAGE = 16


def make_requests(n: int, scale: int, vocab: int, seed: int = 0):
    """n (prompt tokens, max_new_tokens) pairs with skewed lengths, lengths divided by scale."""
    rng = np.random.default_rng(seed)
    totals = rng.permutation(np.resize(np.array(LENGTHS) // scale, n))
    out = []
    for total in totals:
        prompt = int(np.clip(round(total * rng.uniform(0.2, 0.8)), 1, total - 1))
        out.append((rng.integers(0, vocab, prompt).tolist(), int(total - prompt)))
    return out


def run_engine(model, requests, max_len: int, max_seq_len: int):
    """One pass -> (seconds inside ``step``, per-step series, engine stats)."""
    from decoding import Engine

    eng = Engine(
        model,
        max_batch=BATCH,
        num_pages=BATCH * max_len // PAGE,
        page_size=PAGE,
        max_seq_len=max_seq_len,
    )
    for prompt, new in requests:
        eng.submit(prompt, new)
    series = {"paged": [], "contiguous": [], "running": []}
    busy_s = 0.0
    while eng.busy:
        t0 = time.perf_counter()
        eng.step()
        busy_s += time.perf_counter() - t0
        s = eng.stats()
        if not s["running"]:
            continue
        live = s["utilization"] * s["pages_used"] * PAGE
        series["paged"].append(s["utilization"])
        series["contiguous"].append(live / (s["running"] * max_len))
        series["running"].append(s["running"])
    return busy_s, series, eng.stats()


def engine_rows(model, requests, max_len: int, useful: int):
    """Warm-up and timed engine passes at two block-table widths -> (rows, series of the first)."""
    longest = max(len(p) + n for p, n in requests)
    rows, series = [], None
    for table in (max_len, longest):
        run_engine(model, requests, max_len, table)  # warm-up: compilation
        eng_s, s, stats = run_engine(model, requests, max_len, table)
        series = series or s
        rows.append(
            dict(
                method=f"engine (table {table})",
                tokens_per_s=useful / eng_s,
                wall_s=eng_s,
                kv_util_mean=float(np.mean(s["paged"])),
                contiguous_prealloc_util_mean=float(np.mean(s["contiguous"])),
                decode_steps=stats["decode_steps"],
                preemptions=stats["preemptions"],
                prefix_cache_hits=stats["prefix_cache_hits"],
            )
        )
    return rows, series


def run_static(model, requests):
    """One pass of static batches -> (wall seconds, mean KV utilization of their caches)."""
    from decoding import generate
    from decoding.generate import NEW_TOKENS_BUCKET, prompt_bucket

    t0, utils = time.perf_counter(), []
    for i in range(0, len(requests), BATCH):
        group = requests[i : i + BATCH]
        prompts = [p for p, _ in group]
        steps = max(n for _, n in group)
        generate(model, prompts, max_new_tokens=steps, cache="contiguous")
        # generate's cache: rows padded to a power of two, each Tp + N slots (bucketed).
        tp = prompt_bucket(max(len(p) for p in prompts))
        nn = -(-steps // NEW_TOKENS_BUCKET) * NEW_TOKENS_BUCKET
        slots = (1 << (len(group) - 1).bit_length()) * (tp + nn)
        for t in range(steps):
            utils.append(sum(len(p) + min(t, n) for p, n in group) / slots)
    return time.perf_counter() - t0, float(np.mean(utils))


def plot(series, rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot(100 * np.array(series["paged"]), label="paged engine (pages of 16)")
    ax.plot(100 * np.array(series["contiguous"]), label="contiguous, max length per request")
    ax.set(xlabel="engine step", ylabel="KV utilization (%)", ylim=(0, 105))
    ax.set_title("KV memory utilization over time")
    ax.legend(loc="center right")
    bx.bar([r["method"] for r in rows], [r["tokens_per_s"] for r in rows], color=["C0", "C2", "C1"])
    bx.set(ylabel="new tokens / s", title="throughput, same requests")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- speculation

SPEC_BATCHES = (1, 8, 32)
SPEC_MAX_SEQ = 384


def spec_pass(model, requests, batch: int, draft, eos_id=None):
    """One pass of the engine (``draft`` or none), warmed up (``Engine.warmup``), with every
    request submitted at once, each stopping at ``eos_id`` or its ``max_new_tokens`` ->
    (tokens per request, seconds inside ``step`` less compilation, mean latency, stats)."""
    from decoding import Engine

    eng = Engine(
        model,
        max_batch=batch,
        num_pages=batch * SPEC_MAX_SEQ // PAGE,
        page_size=PAGE,
        max_seq_len=SPEC_MAX_SEQ,
        draft=draft,
    )
    eng.warmup()  # every step shape (a ragged verification's draft rows vary), as a server
    ids = [eng.submit(p, n, eos_id=eos_id) for p, n in requests]
    t0, done, compile_before = time.perf_counter(), {}, eng.stats()["compile_s"]
    while eng.busy:
        eng.step()
        for rid in eng.pop_finished().items():
            done[rid[0]] = (rid[1], time.perf_counter())
    stats = eng.stats()
    compile_s = stats["compile_s"] - compile_before
    wall = time.perf_counter() - t0 - compile_s
    latency = float(np.mean([done[r][1] - t0 for r in ids])) - compile_s
    return [done[r][0] for r in ids], wall, latency, stats


SPEC_DRAFTS = ("prompt-lookup", "medusa", "medusa+lookup", "eagle", "eagle+lookup")


def speculation(args) -> None:
    """SmolLM2-135M-Instruct in the engine, greedy, without a draft and with each of prompt
    lookup, the shipped Medusa heads (``smollm2-135m-instruct-medusa``) and the two combined
    (``Medusa(heads, lookup_ngram=3)``), the shipped EAGLE head
    (``smollm2-135m-instruct-eagle``) alone and with lookup (``Eagle(head, lookup_ngram=3)``)
    (``--drafts``: a subset), k chosen from measured costs, at batch 1, 8 and 32
    (1 and 8 quick): the same chat request mix
    (``benchmarks.speculative.REAL_PROMPTS``, both workloads alternating; each answer ends at
    the chat's end token or after ``new`` tokens), each engine compiled by ``Engine.warmup``
    before its timed pass (the undrafted one after a warm-up pass too), ``args.runs`` rounds of
    the undrafted pass and each draft's, alternated, medians of seconds and latencies (each
    round's ratio kept as ``throughput_x_each``); tokens/s counts the tokens generated; every
    pass checked identical to the undrafted one."""
    import jax.numpy as jnp

    import models
    from benchmarks.speculative import REAL_PROMPTS, real_prompt_ids
    from decoding import Eagle, Medusa, PromptLookup
    from decoding.medusa import LOOKUP_NGRAM

    model, tok = models.pretrained("smollm2-135m-instruct", dtype=getattr(jnp, args.dtype))
    heads, _ = models.pretrained("smollm2-135m-instruct-medusa")
    head, _ = models.pretrained("smollm2-135m-instruct-eagle")  # bfloat16, its default
    drafts = {
        "prompt-lookup": PromptLookup(),
        "medusa": Medusa(heads),
        "medusa+lookup": Medusa(heads, lookup_ngram=LOOKUP_NGRAM),
        "eagle": Eagle(head),
        "eagle+lookup": Eagle(head, lookup_ngram=LOOKUP_NGRAM),
    }
    drafts = {name: drafts[name] for name in args.drafts or drafts}
    new = 64 if args.quick else 128
    mix = [ids for w in REAL_PROMPTS for ids in real_prompt_ids(tok, w)]
    mix = [mix[i // 2 + (i % 2) * (len(mix) // 2)] for i in range(len(mix))]  # alternate
    rows = []
    batches = args.batches or (SPEC_BATCHES[:2] if args.quick else SPEC_BATCHES)
    for batch in batches:
        n_req = max(4, 2 * batch)
        requests = [(mix[i % len(mix)], new) for i in range(n_req)]
        spec_pass(model, requests, batch, None, tok.eos_id)  # warm-up: compilation
        passes = {name: [] for name in ("plain", *drafts)}
        for _ in range(args.runs):  # alternated, so that a slow spell of the host hits them all
            passes["plain"].append(spec_pass(model, requests, batch, None, tok.eos_id))
            for name, draft in drafts.items():  # spec_pass warms its engine up: one pass
                passes[name].append(spec_pass(model, requests, batch, draft, tok.eos_id))
        plain_tok = passes["plain"][0][0]
        plain_s = float(np.median([p[1] for p in passes["plain"]]))
        plain_lat = float(np.median([p[2] for p in passes["plain"]]))
        useful = sum(len(t) for t in plain_tok)
        for name in drafts:
            spec_s = float(np.median([p[1] for p in passes[name]]))
            spec_lat = float(np.median([p[2] for p in passes[name]]))
            st = passes[name][-1][3]
            row = dict(
                batch=batch,
                draft=name,
                requests=n_req,
                plain_tok_s=useful / plain_s,
                spec_tok_s=useful / spec_s,
                throughput_x=plain_s / spec_s,
                throughput_x_each=[
                    round(p[1] / q[1], 3)
                    for p, q in zip(passes["plain"], passes[name], strict=True)
                ],
                plain_latency_s=plain_lat,
                spec_latency_s=spec_lat,
                latency_x=plain_lat / spec_lat,
                k=st["num_draft_tokens"],
                heads_k=st["heads_draft_tokens"],  # Medusa + lookup: k where no n-gram matched
                acceptance=st["draft_accepted"] / max(st["draft_proposed"], 1),
                new_tokens=useful,
                identical=all(p[0] == plain_tok for p in passes["plain"] + passes[name]),
            )
            print(row)
            rows.append(row)
    settings = dict(
        model="smollm2-135m-instruct",
        dtype=args.dtype,
        max_new_tokens=new,
        eos="the chat's end token",
        greedy=True,
        page_size=PAGE,
        max_seq_len=SPEC_MAX_SEQ,
        quick=args.quick,
        batches=list(batches),
        loadavg=os.getloadavg(),
    )
    name = "engine_speculative" + ("_bf16" if args.dtype == "bfloat16" else "")
    common.finish(args, name, rows, list(rows[0]), settings=settings)


def main() -> None:
    parser = common.parser(__doc__, runs=1, quick="16 requests at scale 4")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--scale", type=int, default=1, help="divide every length by this")
    parser.add_argument(
        "--speculation", action="store_true", help="only SmolLM2 with and without a draft"
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="SmolLM2's weights"
    )
    parser.add_argument(
        "--batches",
        type=common.positive,
        nargs="+",
        help="--speculation's batches (default 1 8 32, quick 1 8). Each compiled step holds "
        "memory mappings of its JIT code; all three batches with every draft in one process "
        "passed Linux's default vm.max_map_count (65530) and LLVM failed ('Cannot allocate "
        "memory'): split a full run over processes",
    )
    parser.add_argument(
        "--drafts",
        nargs="+",
        choices=SPEC_DRAFTS,
        help="--speculation's drafts (default all)",
    )
    args = parser.parse_args()
    if args.speculation:
        return speculation(args)
    if args.quick:
        args.requests, args.scale = 16, 4

    from flax import nnx

    from models import Transformer, TransformerConfig

    max_len = MAX_LEN // args.scale
    config = TransformerConfig.preset("tiny", max_position=max_len)
    model = Transformer(config, rngs=nnx.Rngs(0))
    requests = make_requests(args.requests, args.scale, config.vocab_size)
    useful = sum(n for _, n in requests)

    rows, series = engine_rows(model, requests, max_len, useful)
    run_static(model, requests)  # warm-up
    static_s, static_util = run_static(model, requests)
    rows.append(
        dict(
            method="static generate",
            tokens_per_s=useful / static_s,
            wall_s=static_s,
            kv_util_mean=static_util,
        )
    )
    speedups = {r["method"]: r["tokens_per_s"] * static_s / useful for r in rows[:2]}
    print(f"engine speed-up over static batching: {speedups}")
    settings = dict(
        requests=args.requests,
        scale=args.scale,
        lengths=[n // args.scale for n in LENGTHS],
        max_len=max_len,
        batch=BATCH,
        page_size=PAGE,
        new_tokens=useful,
        prompt_tokens=sum(len(p) for p, _ in requests),
        quick=args.quick,
        config="tiny",
        greedy=True,
        loadavg=os.getloadavg(),
    )
    path = common.finish(
        args,
        "engine_cpu",
        rows,
        list(rows[0]),
        settings=settings,
        speedup_over_static=speedups,
        series=series,
        note=(
            "kv_util_mean: mean over engine steps with a running request (engine) or over decode "
            "steps (static: live tokens over generate's bucketed contiguous cache). "
            "contiguous_prealloc_util_mean: the same live tokens over max_len slots per running "
            "request. CPU shared with other processes: timings are noisy."
        ),
    )
    plot(series, rows, path.with_suffix(".png"))
    print(f"wrote {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
