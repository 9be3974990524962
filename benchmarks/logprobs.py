"""What log-probabilities cost the engine's decode step: ``python -m benchmarks.logprobs [--quick]``.

Three ``decoding.Engine``s (batch 8, pages of 16) over the same model (they share its compiled
steps), each decoding 8 requests of 32-token prompts, greedy: in one no request asks for
logprobs (the step's ``lax.cond`` skips the work), in one every request asks for
``logprobs=20`` (one log-sum-exp and one ``lax.top_k`` of 20 over V per row, the copy of the
results to the host and the records built there), in one half of them ask. The engines step in
turn (none, all, half, none, ...), so the machine's drift and the other load hit them alike;
each round of three steps gives a ratio to "none", and the table reports, per setting, the
median step time, the median of the rounds' ratios, and the ratio of the fastest steps (the
least disturbed by other work). The first two steps of each engine (prefill, the first decode)
are not counted. ``--runs`` rounds of requests, each ``STEPS`` decode steps. The model:
SmolLM2-135M-Instruct (V = 49152), or with ``--quick`` the "tiny" config with random weights and
SmolLM2's vocabulary size. Writes ``benchmarks/results/logprobs.json``
(``logprobs_quick.json`` with ``--quick``).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from benchmarks import common

BATCH = 8
PROMPT = 32
SETTINGS = {"none": lambda i: None, "all": lambda i: 20, "half": lambda i: 20 if i % 2 else None}


def _model(quick: bool):
    import models

    if quick:
        from flax import nnx

        config = models.TransformerConfig.preset("tiny", vocab_size=49152, max_position=256)
        return models.Transformer(config, rngs=nnx.Rngs(0)), "tiny (V = 49152)"
    return models.pretrained("smollm2-135m-instruct")[0], "smollm2-135m-instruct"


def fill(eng, ask, steps: int, rng) -> None:
    """Submits ``BATCH`` requests of ``steps`` new tokens; ``ask(i)``: request i's logprobs."""
    V = eng.config.vocab_size
    for i in range(BATCH):
        eng.submit(rng.integers(0, V, PROMPT).tolist(), steps, logprobs=ask(i))


def timed_step(eng) -> float:
    t0 = time.perf_counter()
    eng.step()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    args = common.parser(__doc__, runs=3, quick="the tiny config").parse_args(argv)
    from decoding import Engine

    model, name = _model(args.quick)
    steps = 12 if args.quick else 24
    engines = {
        key: Engine(
            model,
            max_batch=BATCH,
            num_pages=BATCH * 4,
            page_size=16,
            max_seq_len=PROMPT + steps + 8,
            prefix_caching=False,
        )
        for key in SETTINGS
    }
    rng = np.random.default_rng(0)
    times = {k: [] for k in SETTINGS}
    for run in range(args.warmup + args.runs):
        for key, eng in engines.items():
            fill(eng, SETTINGS[key], steps, rng)
            for _ in range(2):  # prefill and the first decode
                eng.step()
        while any(eng.busy for eng in engines.values()):
            step = {key: timed_step(eng) for key, eng in engines.items() if eng.busy}
            if run >= args.warmup and len(step) == len(SETTINGS):
                for key, t in step.items():
                    times[key].append(t)
        for eng in engines.values():
            eng.pop_finished()
            eng.pop_logprobs()
    rows = []
    for key in SETTINGS:
        ratios = [t / n for t, n in zip(times[key], times["none"], strict=True)]
        rows.append(
            dict(
                model=name,
                batch=BATCH,
                asking=key,
                steps=len(times[key]),
                step_ms=1e3 * statistics.median(times[key]),
                ratio=statistics.median(ratios),
                fastest_ratio=min(times[key]) / min(times["none"]),
            )
        )
    columns = ["model", "batch", "asking", "steps", "step_ms", "ratio", "fastest_ratio"]
    common.finish(args, "logprobs", rows, columns)


if __name__ == "__main__":
    main()
