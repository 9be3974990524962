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
each produces exactly its ``max_tokens``; greedy; SmolLM2-135M-Instruct in float32 on both sides.
Per system and rate: requests/s and output tokens/s (completed over first arrival to last
completion), TTFT (the baseline does not stream: its first token arrives with the rest), TPOT,
P50/P99 latency. Both sides are warmed up on the same requests first (compilation excluded).
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


def run_server(model, tok, requests, rates, max_batch: int, seed: int) -> list[dict]:
    from decoding import Engine
    from decoding.paging import pages_for
    from decoding.serve.local import running_server

    longest = max(len(p) + n for p, n in requests)
    pages = max_batch * pages_for(longest, 16) + 16
    engine = Engine(model, max_batch=max_batch, num_pages=pages, page_size=16, max_seq_len=longest)
    rows = []
    with running_server(engine, tok, model_name=MODEL, max_queue=4 * len(requests)) as (url, _):
        asyncio.run(_load(url, requests, arrivals(len(requests), math.inf, seed)))  # warm-up
        for rate in rates:
            results = asyncio.run(_load(url, requests, arrivals(len(requests), rate, seed)))
            rows.append(summarize("decoding.serve", rate, results))
            print(rows[-1], flush=True)
    return rows


# --------------------------------------------------------------------------------- the baseline


class Baseline:
    """transformers ``generate`` on batches of requests, timed (each batch shape once warm)."""

    def __init__(self):
        import torch
        import transformers

        from models.pretrained import model_path

        torch.set_num_threads(os.cpu_count() or 1)
        path = model_path(MODEL)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
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


def run_baseline(requests, rates, seed: int) -> list[dict]:
    base = Baseline()
    base.duration([requests[0]])  # warm-up
    rows = []
    for batch in (1, BASELINE_BATCH):
        for rate in rates:
            results = base.serve(requests, arrivals(len(requests), rate, seed), batch)
            rows.append(summarize(f"transformers batch {batch}", rate, results))
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = common.parser(__doc__, runs=1, warmup=1, quick="8 requests, 2 rates, scale 8")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, math.inf])
    p.add_argument("--scale", type=int, default=4, help="divide every length by this")
    p.add_argument("--max-batch", type=int, default=16, help="the engine's batch")
    p.add_argument("--no-baseline", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.requests, args.rates, args.scale = 8, [1.0, math.inf], 8
    import models

    model, tok = models.pretrained(MODEL)
    requests = make_requests(args.requests, args.scale, tok.vocab_size, seed=0)
    rows = run_server(model, tok, requests, args.rates, args.max_batch, seed=1)
    if not args.no_baseline:
        rows += run_baseline(requests, args.rates, seed=1)
    columns = [
        "system",
        "rate",
        "requests_per_s",
        "output_tokens_per_s",
        "ttft_p50_s",
        "tpot_p50_s",
        "latency_p50_s",
        "latency_p99_s",
    ]
    common.finish(
        args,
        "serve_cpu",
        rows,
        columns,
        model=MODEL,
        requests=args.requests,
        scale=args.scale,
        max_batch=args.max_batch,
        baseline_batch=BASELINE_BATCH,
    )


if __name__ == "__main__":
    main()
