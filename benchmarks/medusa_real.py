"""Medusa on the real model: SmolLM2-135M-Instruct with its shipped self-distilled heads
(``models.pretrained("smollm2-135m-instruct-medusa")``), B = 1, greedy, open chat prompts that
are not the heads' training prompts, ``--new-tokens`` (160) new tokens, no EOS stop (every run
makes the same number of tokens).

Per configuration (plain ``generate``, the Medusa chain at each ``--ks`` k, the Medusa tree):
tokens/s (new tokens over prefill + decode, compilation excluded; the median over ``--runs``
interleaved runs per prompt), the ratio to plain greedy in the same run, tokens per target call
(the mean accepted length + 1), the acceptance rate and whether every output equals plain
greedy. Beside the rows: each head's top-k accuracy on the target's own greedy continuations of
the prompts (``decoding.medusa.rank_accuracy``: top-1 is the chance a head's draft is right when
the heads before it were) and the target's step cost at Tq = 1 .. K + 1 tokens and the heads'
drafting cost, relative to one Tq = 1 step: what bounds the speed-up.

``python -m benchmarks.medusa_real`` writes ``benchmarks/results/medusa_smollm2_cpu.json``.
:func:`measure_medusa` is the measurement as a function, for other scripts.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import common

NAME = "medusa_smollm2"
NEW_TOKENS = 160
# Open chat: everyday questions and requests, none of them task x subject pairs of
# models.medusa_train's training set (DISTILL_TASKS x DISTILL_SUBJECTS).
OPEN_CHAT = (
    "What should I pack for a weekend hiking trip in the mountains?",
    "Can you help me plan a simple vegetarian dinner for four people?",
    "Why is the sky blue? Please keep it short.",
    "I have a job interview tomorrow. How should I prepare?",
    "Tell me a short story about a robot who learns to paint.",
)


def _tree_spec(acc, num_nodes: int):
    from decoding import TreeSpec

    return TreeSpec.from_accuracies(acc, num_nodes)


def step_costs(target, heads, max_tq: int, *, context: int = 256, runs: int = 7) -> dict:
    """Seconds of one cached target forward at Tq = 1 .. ``max_tq`` (B = 1, ``context`` tokens
    cached: ``decoding.drafts.measure_step_costs``, what the choice of k reads), and the median
    of the heads' drafting (``num_heads`` logits from h)."""
    from decoding.drafts import measure_step_costs
    from decoding.medusa import Medusa
    from decoding.packing import packed_model, packed_weights

    graphdef, params = nnx.split(target)
    kernels = packed_weights(target, params)
    kind, hparams = Medusa(heads).split()

    @jax.jit
    def draft(params, kernels, hparams, h):
        model = packed_model(graphdef, params, kernels)
        root = jnp.zeros(h.shape[:1], jnp.int32)  # read only by heads with a root token
        return kind.head_logits(hparams, h, heads.num_heads, model, root)

    costs = measure_step_costs(target, max_tq, context=context, repeats=runs)
    out = {f"target_tq{tq}_s": c for tq, c in enumerate(costs, 1)}
    h = jnp.ones((1, target.config.dim), jnp.float32)
    m = common.measure(draft, params, kernels, hparams, h, runs=runs, warmup=1)
    out["heads_draft_s"] = statistics.median(m.times)
    base = out["target_tq1_s"]
    out["relative"] = {k.removesuffix("_s"): round(v / base, 3) for k, v in out.items()}
    return out


def measure_medusa(
    target,
    tokenizer,
    heads,
    messages=OPEN_CHAT,
    *,
    new_tokens: int = NEW_TOKENS,
    ks=(1, 2, 3),
    tree_nodes: int | None = 8,
    runs: int = 3,
    log=print,
) -> tuple[list[dict], dict]:
    """(rows, extra): one row per configuration (see the module doc) and the per-head accuracy
    table, the chosen tree and the step costs. ``messages``: user turns, chat-formatted with
    ``tokenizer``; ``tree_nodes``: the tree's size (``TreeSpec.from_accuracies`` on these
    prompts' accuracy table), None for no tree."""
    from decoding import Medusa, generate, speculative_generate
    from decoding.medusa import rank_accuracy

    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": m}]) for m in messages]
    acc = rank_accuracy(target, heads, prompts, max_new_tokens=new_tokens, ranks=4)
    log("per-head top-1..4 accuracy: " + "; ".join(" ".join(f"{a:.2f}" for a in r) for r in acc))
    configs = {"plain": None}
    for k in ks:
        configs[f"medusa chain k={k}"] = (Medusa(heads), k)
    spec = None
    if tree_nodes is not None:
        spec = _tree_spec(acc, tree_nodes)
        configs[f"medusa tree {spec.num_nodes} nodes"] = (Medusa(heads, tree=spec), spec.depth)

    def call(cfg, ids):
        if cfg is None:
            return generate(target, [ids], max_new_tokens=new_tokens)
        draft, k = cfg
        return speculative_generate(
            target, draft, [ids], num_draft_tokens=k, max_new_tokens=new_tokens
        )

    times = {name: [[] for _ in prompts] for name in configs}
    outs, stats = {}, {name: [] for name in configs}
    for name, cfg in configs.items():  # warm-up: compilation
        t = time.perf_counter()
        for ids in prompts:
            call(cfg, ids)
        log(f"{name}: warm-up {time.perf_counter() - t:.0f}s")
    for _ in range(runs):  # interleaved: load changes hit every configuration alike
        for name, cfg in configs.items():
            for p, ids in enumerate(prompts):
                res = call(cfg, ids)
                s = res.stats
                times[name][p].append(s["prefill_s"] + s["decode_s"])
                outs[(name, p)] = res.tokens[0]
                stats[name].append(s)
    rows = []
    total = new_tokens * len(prompts)
    plain_s = sum(statistics.median(t) for t in times["plain"])
    for name in configs:
        secs = sum(statistics.median(t) for t in times[name])
        same = all(outs[(name, p)] == outs[("plain", p)] for p in range(len(prompts)))
        row = dict(
            config=name,
            tokens_per_s=round(total / secs, 2),
            speedup=round(plain_s / secs, 3),
            identical_to_plain=same,
        )
        if name != "plain":
            st = stats[name]
            row.update(
                num_draft_tokens=st[0]["num_draft_tokens"],
                tokens_per_target_call=round(
                    float(np.mean([s["tokens_per_target_call"] for s in st])), 3
                ),
                acceptance_rate=round(float(np.mean([s["acceptance_rate"] for s in st])), 3),
            )
        rows.append(row)
        log(f"{row}")
    costs = step_costs(target, heads, max(max(ks, default=1), spec.depth if spec else 1) + 1)
    log(f"step costs relative to Tq = 1: {costs['relative']}")
    extra = dict(
        head_rank_accuracy=[[round(a, 4) for a in r] for r in acc],
        tree_paths=[list(p) for p in spec.paths] if spec else None,
        step_costs=costs,
        prompts=list(messages),
        new_tokens=new_tokens,
    )
    return rows, extra


def main(argv=None) -> None:
    p = common.parser(__doc__, runs=3, quick="2 prompts, 64 new tokens, k = 2 and 3, no tree")
    p.add_argument("--new-tokens", type=common.positive, default=NEW_TOKENS)
    p.add_argument("--prompts", type=common.positive, default=4)
    p.add_argument("--ks", type=common.positive, nargs="+", default=[1, 2, 3])
    p.add_argument("--tree-nodes", type=common.positive, default=8)
    p.add_argument("--no-tree", action="store_true")
    p.add_argument(
        "--heads",
        default="smollm2-135m-instruct-medusa",
        help="shipped heads' name or a directory saved by models.save_medusa",
    )
    args = p.parse_args(argv)
    if args.prompts > len(OPEN_CHAT):
        p.error(f"--prompts must be <= {len(OPEN_CHAT)}")
    import models
    from models.medusa import load_medusa

    target, tokenizer = models.pretrained("smollm2-135m-instruct")
    if os.path.isdir(args.heads):
        heads = load_medusa(args.heads, target.config)
    else:
        heads = models.pretrained(args.heads)[0]
    if max(args.ks) > heads.num_heads:
        p.error(f"--ks must be <= the heads' num_heads {heads.num_heads}")
    messages, new, ks = OPEN_CHAT[: args.prompts], args.new_tokens, args.ks
    tree = None if args.no_tree else min(args.tree_nodes, 64)
    if args.quick:
        messages, new, ks, tree = OPEN_CHAT[:2], 64, [2, 3], None
    load_before = common.load_average()
    start = time.perf_counter()
    rows, extra = measure_medusa(
        target,
        tokenizer,
        heads,
        messages,
        new_tokens=new,
        ks=ks,
        tree_nodes=tree,
        runs=args.runs,
        log=lambda s: print(s, flush=True),
    )
    columns = [
        "config",
        "tokens_per_s",
        "speedup",
        "tokens_per_target_call",
        "acceptance_rate",
        "identical_to_plain",
    ]
    common.finish(
        args,
        f"{NAME}_{jax.default_backend()}",
        rows,
        columns,
        load_average_before=load_before,
        heads=args.heads,
        wall_seconds=round(time.perf_counter() - start, 1),
        **extra,
    )


if __name__ == "__main__":
    main()
