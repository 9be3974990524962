"""Serving benchmark: ``python -m benchmarks.serve [--quick]`` from the repository root.

A load generator (asyncio + httpx, streaming ``/v1/completions``) sends requests with Poisson
arrivals at several rates (and all at once: saturation) to (a) ``decoding.serve`` on a
continuous-batching engine, in this process on a loopback port, and (b) a Hugging Face
transformers baseline serving the same requests first come, first served with
``model.generate``: one request at a time, and static batches of up to 8 (the requests that have
arrived when the model is free, left-padded, run until the longest is done). The baseline runs
after the server has stopped, alone on the machine; its queue is simulated in virtual time from
the measured duration of each ``generate`` call (it is one single-threaded loop, so this is what
a server around it would see, minus HTTP).

Requests: the seed's mix of total lengths (100 / 500 / 50 / 200 tokens, divided by ``--scale``
for a slow CPU), the prompt a random 20-80% of each (random token ids), ``ignore_eos`` so that
each produces exactly its ``max_tokens``; greedy; SmolLM2-135M-Instruct in ``--dtype`` (float32
by default) on both sides, both from the same GGUF file dequantized to dense weights (the
baseline is asked for that explicitly, ``GgufConfig(dequantize=True)``: transformers would
otherwise keep packed GGUF blocks wherever the ``kernels`` package provides a matmul for them),
the baseline with PyTorch's ``sdpa`` attention on all cores.
Per system and rate: requests/s and output tokens/s (completed over first arrival to last
completion), TTFT (the baseline does not stream: its first token arrives with the rest), TPOT,
P50/P99 latency. Both sides are warmed up on the same requests first (compilation excluded;
the engine also compiles every step shape first, ``Engine.warmup``, as the server does).
The server's rows also say where its time went, from the engine's counters over the rate's
pass: ``engine_busy_frac`` (time inside ``Engine.step``, over the span: below 1 the HTTP side or
the arrivals left it idle), ``mean_decode_rows`` (generated tokens per decode step) and
``prefill_tokens``. The engine runs without its prefix cache: the passes repeat the same
prompts, which it would otherwise serve from the cache after the first.

Saturation is its own pass after the rates: ``--saturation-requests`` (default 256, 8 times the
default batch) requests of the same mix sent all at once to both sides; the goal's ratio
(``saturation_ratio``) is taken there. The ``inf`` rate over the ``--requests`` is reported too,
but it is mostly ramp-up and tail: with 64 requests and a batch of 32 the engine's decode steps
average about 15 rows, as the last long requests decode in a nearly empty batch (the baseline's
last static batch is as full as the others), so that figure understates what the server
sustains; ``mean_decode_rows`` against ``--max-batch`` shows how far a pass is from full.
Static batching's own cost: a batch of 8 runs for its longest request's prompt and output, so it
computes ``static8_padding`` (in the JSON) times the tokens the requests need; on a CPU, where a
step's cost grows with its rows, that bounds what continuous batching can gain over it.
Writes ``benchmarks/results/serve_cpu.json`` and prints a table.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time

import numpy as np

from benchmarks import common
from benchmarks.engine import make_requests

MODEL = "smollm2-135m-instruct"
BASELINE_BATCH = 8


def _percentile(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def summarize(system: str, rate, results: list[dict]) -> dict:
    """One table row from per-request ``{arrival, first, end, tokens}`` (seconds)."""
    start = min(r["arrival"] for r in results)
    span = float(max(r["end"] for r in results) - start)
    ttft = [r["first"] - r["arrival"] for r in results]
    latency = [r["end"] - r["arrival"] for r in results]
    tpot = [(r["end"] - r["first"]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
    return dict(
        system=system,
        rate=rate,
        requests=len(results),
        requests_per_s=len(results) / span,
        output_tokens_per_s=sum(r["tokens"] for r in results) / span,
        ttft_p50_s=_percentile(ttft, 50),
        ttft_p99_s=_percentile(ttft, 99),
        tpot_p50_s=_percentile(tpot, 50),
        latency_p50_s=_percentile(latency, 50),
        latency_p99_s=_percentile(latency, 99),
    )


def arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Poisson arrival times (s) of n requests at ``rate`` per second (all at 0 for inf)."""
    if math.isinf(rate):
        return np.zeros(n)
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n))


# --------------------------------------------------------------------------------- the server


async def _one(http, prompt, max_new, delay, t0) -> dict:
    await asyncio.sleep(delay)
    arrival = time.perf_counter() - t0
    body = dict(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_new,
        temperature=0,
        stream=True,
        ignore_eos=True,
        stream_options={"include_usage": True},
    )
    first, tokens = None, 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and first is None:
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter() - t0
    return dict(arrival=arrival, first=first or end, end=end, tokens=tokens)


async def _load(url: str, requests, times) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=len(requests))
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        jobs = [_one(http, p, n, float(t), t0) for (p, n), t in zip(requests, times, strict=True)]
        return await asyncio.wait_for(asyncio.gather(*jobs), timeout=3600)


def _engine_time(stats: dict) -> float:
    """Seconds the engine spent inside ``step`` (its ``tokens_per_s`` excludes compilation)."""
    tps = stats["tokens_per_s"]
    return (stats["generated_tokens"] / tps if tps else 0.0) + stats["compile_s"]


def engine_breakdown(before: dict, after: dict, span: float) -> dict:
    """Where the server's time went over one pass, from ``Engine.stats()`` before and after."""
    steps = after["decode_steps"] - before["decode_steps"]
    generated = after["generated_tokens"] - before["generated_tokens"]
    return dict(
        engine_busy_frac=(_engine_time(after) - _engine_time(before)) / span,
        decode_steps=steps,
        mean_decode_rows=generated / steps if steps else 0.0,
        prefill_tokens=after["prefill_tokens"] - before["prefill_tokens"],
        compile_s=after["compile_s"] - before["compile_s"],
        preemptions=after["preemptions"] - before["preemptions"],
    )


def passes(requests, rates, saturation) -> list[tuple[float, list]]:
    """(rate, requests) of every pass: each rate over ``requests``, then ``saturation`` (a list
    of requests; none when empty) all at once."""
    out = [(rate, requests) for rate in rates]
    return out + ([(math.inf, saturation)] if saturation else [])


def run_server(model, tok, requests, rates, args, seed: int, saturation=()):
    """The server's rows, one per pass (:func:`passes`), and the seconds its engine's warm-up
    took."""
    from decoding import Engine
    from decoding.paging import pages_for
    from decoding.serve.local import running_server

    every = [*requests, *saturation]
    longest = max(len(p) + n for p, n in every)
    B, P = args.max_batch, args.page_size
    engine = Engine(
        model,
        max_batch=B,
        num_pages=B * pages_for(longest, P) + 16,  # no preemption: every row's longest request
        page_size=P,
        max_seq_len=longest,
        max_prefill_tokens=args.max_prefill_tokens,
        # Every pass sends the same random prompts: with the prefix cache on, the warm-up and
        # each earlier pass would leave later passes' prompts cached (the baseline recomputes
        # every prompt). Random prompts share no other prefix, so off is this workload's cost.
        prefix_caching=False,
    )
    warmup_s = engine.warmup()  # every step shape, as python -m decoding.serve does
    rows = []
    with running_server(engine, tok, model_name=MODEL, max_queue=4 * len(every)) as (url, _):
        asyncio.run(_load(url, requests, arrivals(len(requests), math.inf, seed)))  # warm-up
        for rate, reqs in passes(requests, rates, saturation):
            before = engine.stats()  # read between passes: the worker is idle
            results = asyncio.run(_load(url, reqs, arrivals(len(reqs), rate, seed)))
            row = summarize("decoding.serve", rate, results)
            span = max(r["end"] for r in results) - min(r["arrival"] for r in results)
            rows.append(row | engine_breakdown(before, engine.stats(), span))
            print(rows[-1], flush=True)
    return rows, warmup_s


# --------------------------------------------------------------------------------- the baseline


class Baseline:
    """transformers ``generate`` on batches of requests, timed (each batch shape once warm)."""

    def __init__(self, dtype: str):
        import torch
        import transformers

        from models.pretrained import model_path

        torch.set_num_threads(os.cpu_count() or 1)
        path = model_path(MODEL)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent),
            gguf_file=path.name,
            dtype=getattr(torch, dtype),
            attn_implementation="sdpa",
            quantization_config=transformers.GgufConfig(dequantize=True),  # dense, as ours
        ).eval()
        self.pad = 0
        self.cache: dict[tuple, float] = {}

    def duration(self, batch) -> float:
        """Seconds of one ``generate`` over ``batch`` [(prompt ids, max_new)], left-padded."""
        key = tuple((tuple(p), n) for p, n in batch)
        if key not in self.cache:
            torch = self.torch
            T = max(len(p) for p, _ in batch)
            ids = torch.tensor([[self.pad] * (T - len(p)) + list(p) for p, _ in batch])
            mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p, _ in batch])
            n = max(m for _, m in batch)
            with torch.inference_mode():
                t0 = time.perf_counter()
                self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=self.pad,
                )
                self.cache[key] = time.perf_counter() - t0
        return self.cache[key]

    def serve(self, requests, times, batch_size: int) -> list[dict]:
        """FCFS in virtual time: when free, take the arrived requests (up to ``batch_size``)."""
        order, clock, out, i = list(range(len(requests))), 0.0, [None] * len(requests), 0
        while i < len(order):
            clock = max(clock, times[order[i]])
            group = [j for j in order[i : i + batch_size] if times[j] <= clock]
            clock += self.duration([requests[j] for j in group])
            for j in group:
                r = dict(arrival=float(times[j]), first=clock, end=clock, tokens=requests[j][1])
                out[j] = r
            i += len(group)
        return out


def static_padding(requests, batch: int) -> float:
    """Tokens static batches of ``batch`` consecutive requests compute (each row runs for the
    batch's longest prompt and longest output), over the tokens the requests need."""
    need = sum(len(p) + n for p, n in requests)
    done = 0
    for i in range(0, len(requests), batch):
        group = requests[i : i + batch]
        done += len(group) * (max(len(p) for p, _ in group) + max(n for _, n in group))
    return done / need


def run_baseline(requests, rates, dtype: str, seed: int, saturation=()) -> list[dict]:
    base = Baseline(dtype)
    base.duration([requests[0]])  # warm-up
    rows = []
    for batch in (1, BASELINE_BATCH):
        for rate, reqs in passes(requests, rates, saturation):
            results = base.serve(reqs, arrivals(len(reqs), rate, seed), batch)
            rows.append(summarize(f"transformers batch {batch}", rate, results))
            print(rows[-1], flush=True)
    return rows


def saturation_ratios(rows: list[dict]) -> dict:
    """The server's requests/s over each baseline's in the saturation pass (the goal's ratio):
    the highest rate and, of its passes, the one with the most requests."""
    top = max((r["rate"], r.get("requests", 0)) for r in rows)
    at = {
        r["system"]: r["requests_per_s"] for r in rows if (r["rate"], r.get("requests", 0)) == top
    }
    ours = at.get("decoding.serve")
    return {k: ours / v for k, v in at.items() if ours and k != "decoding.serve"}


def main() -> None:
    p = common.parser(
        __doc__, runs=1, warmup=1, quick="8 requests, 2 rates, scale 8, saturation 16"
    )
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, math.inf])
    p.add_argument(
        "--saturation-requests",
        type=int,
        default=256,
        help="requests of the saturation pass, sent all at once (0: no such pass)",
    )
    p.add_argument("--scale", type=int, default=4, help="divide every length by this")
    p.add_argument(
        "--max-batch", type=int, default=32, help="the engine's batch (the server's default)"
    )
    p.add_argument("--max-prefill-tokens", type=int, default=512, help="the engine's")
    p.add_argument("--page-size", type=int, default=16, help="the engine's")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both sides")
    p.add_argument("--no-baseline", action="store_true")
    args = p.parse_args()
    for name in ("requests", "scale", "max_batch", "max_prefill_tokens", "page_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.saturation_requests < 0:
        p.error(f"--saturation-requests must be >= 0, got {args.saturation_requests}")
    if any(not r > 0 for r in args.rates):
        p.error(f"--rates must be > 0 (inf: all at once), got {args.rates}")
    if args.quick:
        args.requests, args.rates, args.scale = 8, [1.0, math.inf], 8
        args.saturation_requests = 16
    import jax.numpy as jnp

    import models

    model, tok = models.pretrained(MODEL, dtype=getattr(jnp, args.dtype))
    requests = make_requests(args.requests, args.scale, tok.vocab_size, seed=0)
    saturation = make_requests(args.saturation_requests, args.scale, tok.vocab_size, seed=2)
    # PyTorch's threads meet at a barrier after every op, so a loaded machine slows the baseline
    # far more than the engine (one native call per layer): its figures need a quiet machine.
    load = {"server_start": os.getloadavg()}
    rows, warmup_s = run_server(model, tok, requests, args.rates, args, 1, saturation)
    if not args.no_baseline:
        load["baseline_start"] = os.getloadavg()
        rows += run_baseline(requests, args.rates, args.dtype, 1, saturation)
    columns = [
        "system",
        "rate",
        "requests",
        "requests_per_s",
        "output_tokens_per_s",
        "ttft_p50_s",
        "tpot_p50_s",
        "latency_p50_s",
        "latency_p99_s",
        "engine_busy_frac",
        "mean_decode_rows",
    ]
    common.finish(
        args,
        "serve_cpu" + ("_bf16" if args.dtype == "bfloat16" else ""),
        rows,
        columns,
        model=MODEL,
        requests=args.requests,
        saturation_requests=args.saturation_requests,
        scale=args.scale,
        max_batch=args.max_batch,
        max_prefill_tokens=args.max_prefill_tokens,
        page_size=args.page_size,
        dtype=args.dtype,
        baseline_batch=BASELINE_BATCH,
        static8_padding=static_padding(requests, BASELINE_BATCH),
        static8_padding_saturation=static_padding(saturation, BASELINE_BATCH)
        if saturation
        else None,
        engine_warmup_s=warmup_s,
        saturation_ratio=saturation_ratios(rows),
        load_average_at=load,
    )


if __name__ == "__main__":
    main()
