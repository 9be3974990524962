"""Speculative decoding benchmark: ``python -m benchmarks.speculative [--quick]``.

On the shipped byte-level models (target ``code-target``, float32) and code prompts cut from
held-out standard-library files, batch 1, no EOS: for each sampling mode (greedy, temperature
0.8), draft kind (``code-draft``, ``prompt-lookup``, ``early-exit:L``, ``medusa``: the shipped
``code-target-medusa`` heads as a chain, k <= 4; ``medusa+lookup``: that chain taking prompt
lookup's continuation where the last ``decoding.medusa.LOOKUP_NGRAM`` tokens occurred before;
``medusa-tree``: the same heads with
``TreeSpec.default(4)``, k = 4; ``medusa-tree:N``: the N-node tree built from the heads'
calibrated rank accuracy, at its own depth) and k = 1..8:

* acceptance a (accepted / proposed draft tokens) and tokens per target call, next to the
  theory (1 - a^(k+1)) / (1 - a) for i.i.d. acceptance at rate a (Leviathan et al., eq. 1);
* wall-time speed-up over plain ``decoding.generate``, the two called alternately (median of
  ``--runs`` pairs per prompt after a warm-up pair that compiles; summed over prompts), so a
  drift in the machine's speed hits both;
* ``verify_cost``: the target's cached forward of the k + 1 verified tokens over a plain decode
  step (T = 1), timed in the same run (:func:`forward_costs`), and ``bound`` = tokens per call
  / verify_cost: the decode-loop speed-up of a free draft if a step cost only its target
  forward (a guide, not a ceiling: real steps add sampling and bookkeeping on both sides);
* ``match``: greedy tokens equal plain ``generate``'s (1.0 expected);
* ``transformers``' assisted generation on the same weights (``assistant_model=`` with a constant
  ``num_assistant_tokens = k``, ``prompt_lookup_num_tokens=k``, ``assistant_early_exit=L``):
  its speed-up over its own plain ``generate`` and its tokens/s.

Writes ``benchmarks/results/speculative_cpu.json`` (load average recorded) and prints a table.
``--quick``: one prompt, greedy, k in {2, 4}, 48 new tokens (results in ``*_quick.json``).
``--acceptance-of CHECKPOINT ...``: only the acceptance of draft checkpoints (k = 3, 4 prompts).
``--real [--quick] [--ks K ..]``: SmolLM2-135M-Instruct (:func:`real_model`): prompt lookup at
the chosen k (and at each ``--ks``) against plain ``generate``, B = 1, answers of up to 160 new
tokens (96 quick) ending at the chat's end token, greedy and T = 0.7, on input-grounded and
open-chat prompts; ``benchmarks/results/speculative_real.json``. ``--real-kinds K ..`` drafts
with ``prompt-lookup``, ``medusa`` (the shipped SmolLM2 heads), ``eagle`` (the shipped
SmolLM2 EAGLE head) or ``eagle+lookup`` (it with prompt lookup's continuation where the last
``LOOKUP_NGRAM`` tokens occurred before) instead, ``--real-workloads W ..`` keeps some
workloads; any kind but prompt lookup alone writes ``speculative_real_heads.json``.
``--eagle-heads HEAD ..``: only those EAGLE heads' offline acceptance on the open-chat prompts
(:func:`eagle_acceptance`; ``eagle_acceptance.json``).
"""

from __future__ import annotations

import functools
import itertools
import os
import pathlib
import statistics
import sysconfig
import time

import numpy as np
from tqdm import tqdm

from benchmarks import common

KINDS = (
    "code-draft",
    "prompt-lookup",
    "early-exit:2",
    "early-exit:4",
    "early-exit:6",
    "medusa",
    "medusa+lookup",
    "medusa-tree",
)
MEDUSA_HEADS = 4  # the shipped code-target-medusa: k <= 4
NEW_TOKENS = 128


def skipped(kind: str, k: int) -> bool:
    """Medusa chains need k <= its heads; a tree runs once, at k = its depth."""
    if kind.startswith("medusa-tree"):
        return k != medusa_tree(kind).depth
    return kind in ("medusa", "medusa+lookup") and k > MEDUSA_HEADS


def medusa_tree(kind: str):
    """``medusa-tree``: ``TreeSpec.default(4)`` (18 nodes); ``medusa-tree:N``: the N nodes most
    likely to be accepted (``TreeSpec.from_accuracies``) by the shipped heads' rank accuracy
    calibrated on other prompts (:func:`calibration`)."""
    import decoding

    if kind == "medusa-tree":
        return decoding.TreeSpec.default(MEDUSA_HEADS)
    return decoding.TreeSpec.from_accuracies(calibration(), int(kind.partition(":")[2]))


@functools.cache
def calibration() -> tuple:
    """The shipped heads' rank accuracy on the target's greedy continuations of 4 held-out
    prompts that the benchmark does not time (the 5th to 8th of :func:`code_prompts`)."""
    import models
    from decoding.medusa import rank_accuracy

    target, tok = models.pretrained("code-target")
    ids = [[tok.bos_id] + tok.encode(t) for t in code_prompts(8)[4:]]
    return tuple(map(tuple, rank_accuracy(target, medusa_heads(), ids)))


PROMPT_BYTES = 96


def code_prompts(count: int) -> list[str]:
    """``count`` prompts: the PROMPT_BYTES bytes that start at a ``def`` line in held-out files."""
    from models import data

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for path in data.stdlib_files(str(root)):
        if not data.is_heldout(path.relative_to(root).as_posix()):
            continue
        text = path.read_text(errors="replace")
        at = text.find("\n    def ")
        if at >= 0 and text[at + 1 : at + 1 + PROMPT_BYTES].isascii():
            prompts.append(text[at + 1 : at + 1 + PROMPT_BYTES])
        if len(prompts) == count:
            return prompts
    return prompts


@functools.cache
def medusa_heads():
    """The shipped ``code-target-medusa`` heads (loaded once)."""
    import models

    return models.pretrained("code-target-medusa")[0]


def make_draft(kind: str, draft_model):
    import decoding

    if kind == "medusa":
        return decoding.Medusa(medusa_heads())
    if kind == "medusa+lookup":
        from decoding.medusa import LOOKUP_NGRAM

        return decoding.Medusa(medusa_heads(), lookup_ngram=LOOKUP_NGRAM)
    if kind.startswith("medusa-tree"):
        return decoding.Medusa(medusa_heads(), tree=medusa_tree(kind))
    if kind == "code-draft":
        return draft_model
    if kind == "prompt-lookup":
        return decoding.PromptLookup()
    return decoding.EarlyExit(num_layers=int(kind.partition(":")[2]))


def timed(fn, timing: tuple[int, int]):
    """(median seconds of ``runs`` calls after ``warmup`` calls, the last result);
    ``timing = (runs, warmup)``."""
    runs, warmup = timing
    for _ in range(warmup):
        fn()
    times, res = [], None
    for _ in range(runs):
        start = time.perf_counter()
        res = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), res


def timed_pair(fa, fb, timing: tuple[int, int]):
    """``fa`` and ``fb`` called alternately: (median seconds of fa, of fb, fb's last result).
    Pairing in time keeps a ratio of the two honest when the machine's speed drifts."""
    runs, warmup = timing
    for _ in range(warmup):
        fa(), fb()
    ta, tb, res = [], [], None
    for _ in range(runs):
        start = time.perf_counter()
        fa()
        mid = time.perf_counter()
        res = fb()
        ta.append(mid - start)
        tb.append(time.perf_counter() - mid)
    return statistics.median(ta), statistics.median(tb), res


def theory(a: float, k: int) -> float:
    """Expected tokens per target call at i.i.d. acceptance rate a: (1 - a^(k+1)) / (1 - a)."""
    return k + 1.0 if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def ours(target, draft_model, ids, kind, k, sampling, new, timing, plain):
    """One row for our speculative decoding over all prompts ``ids``: each prompt's calls
    alternate with plain ``generate`` calls (:func:`timed_pair`), and the speed-up is the ratio
    of those paired medians, summed over prompts."""
    from decoding import generate, speculative_generate

    total, plain_s, acc, prop, tpc, match = 0.0, 0.0, [], [], [], []
    for row, ref in zip(ids, plain["tokens"], strict=True):
        p, s, res = timed_pair(
            lambda row=row: generate(target, [row], max_new_tokens=new, sampling=sampling),
            lambda row=row: speculative_generate(
                target,
                make_draft(kind, draft_model),
                [row],
                num_draft_tokens=k,
                max_new_tokens=new,
                sampling=sampling,
            ),
            timing,
        )
        total, plain_s = total + s, plain_s + p
        st = res.stats
        acc.append(st["acceptance_rate"] * st["num_draft_tokens"] * st["target_calls"])
        prop.append(st["num_draft_tokens"] * st["target_calls"])
        tpc.append(st["tokens_per_target_call"])
        match.append(res.tokens == ref)
    a = sum(acc) / max(sum(prop), 1)
    return dict(
        acceptance=a,
        tokens_per_call=statistics.mean(tpc),
        theory=theory(a, k),
        tok_s=len(ids) * new / total,
        plain_tok_s=len(ids) * new / plain_s,
        speedup=plain_s / total,
        match=float(np.mean(match)) if sampling.greedy else None,
    )


def hf_assisted(hf, hf_draft, ids, kind, k, greedy, new, timing, hf_plain_s):
    """transformers' assisted generation for the same kind -> dict (or an error string)."""
    import torch

    if kind.startswith("medusa"):
        return dict(hf_error="transformers has no Medusa heads")
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=not greedy, pad_token_id=258)
    if not greedy:
        kwargs.update(temperature=0.8, top_k=0)
    if kind == "code-draft":
        hf_draft.generation_config.num_assistant_tokens = k
        hf_draft.generation_config.num_assistant_tokens_schedule = "constant"
        kwargs["assistant_model"] = hf_draft
    elif kind == "prompt-lookup":
        kwargs["prompt_lookup_num_tokens"] = k
    else:
        kwargs["assistant_early_exit"] = int(kind.partition(":")[2])
        hf.generation_config.num_assistant_tokens = k
    total = 0.0
    try:
        with torch.inference_mode():
            for row in ids:
                x = torch.tensor([row])
                s, _ = timed(
                    lambda x=x: hf.generate(x, attention_mask=torch.ones_like(x), **kwargs), timing
                )
                total += s
    except Exception as e:  # an unsupported combination is reported, not fatal
        return dict(hf_error=f"{type(e).__name__}: {str(e)[:120]}")
    return dict(hf_tok_s=len(ids) * new / total, hf_speedup=hf_plain_s / total)


def forward_costs(target, widths, *, length: int = 160, steps: int = 48, runs: int = 7) -> dict:
    """{T: seconds of one cached forward of T tokens through ``target``} (B = 1, a paged cache
    holding ``length`` tokens; a jitted loop of ``steps`` calls; ``runs`` rounds that time every
    T in turn, so drifting load hits all alike; medians).

    T = 1 is a plain decode step, T = k + 1 a verification step: with t(T) these costs and
    tokens per call a, a free draft would make a decode loop of bare forwards
    ``a * t(1) / t(k + 1)`` times faster (the ``bound`` column).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from decoding.packing import packed_model, packed_weights
    from models import KVCache

    graphdef, params = nnx.split(target)
    kernels = packed_weights(target)  # what generate's decode loop multiplies with
    P, pages = 16, 2 * length // 16
    table = np.arange(pages, dtype=np.int32)[None]
    cache = KVCache.paged(target.config, pages, P, table)
    cache = cache.replace(lengths=jnp.full((1,), length, jnp.int32))

    def loop(params, kernels, cache, T):
        model = packed_model(graphdef, params, kernels)

        def body(_, carry):
            cache, tok = carry
            logits, new = model(jnp.broadcast_to(tok, (1, T)), cache=cache)
            return new.replace(lengths=cache.lengths), jnp.argmax(logits[:, -1], -1)[:, None]

        return jax.lax.fori_loop(0, steps, body, (cache, jnp.zeros((1, 1), jnp.int32)))

    compiled = {
        T: jax.jit(loop, static_argnums=3).lower(params, kernels, cache, T).compile()
        for T in widths
    }
    times = {T: [] for T in widths}
    for _ in range(runs):
        for T, fn in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(params, kernels, cache))
            times[T].append(time.perf_counter() - start)
    return {T: statistics.median(ts) / steps for T, ts in times.items()}


def baselines(target, hf, ids, sampling, new, timing):
    """Plain ``generate``'s tokens (what greedy rows must match) and plain transformers
    ``generate``'s seconds over all prompts."""
    import torch

    from decoding import generate

    tokens = [generate(target, [row], max_new_tokens=new, sampling=sampling).tokens for row in ids]
    kwargs = dict(
        max_new_tokens=new, min_new_tokens=new, do_sample=not sampling.greedy, pad_token_id=258
    )
    if not sampling.greedy:
        kwargs.update(temperature=sampling.temperature, top_k=0)
    hf_s = 0.0
    with torch.inference_mode():
        for row in ids:
            x = torch.tensor([row])
            hf_s += timed(
                lambda x=x: hf.generate(x, attention_mask=torch.ones_like(x), **kwargs), timing
            )[0]
    return dict(tokens=tokens, hf_seconds=hf_s)


def verify_width(kind: str, k: int) -> int:
    """Tokens of one verification call: k + 1, or the tree's nodes + 1."""
    if kind.startswith("medusa-tree"):
        return medusa_tree(kind).num_nodes + 1
    return k + 1


def sweep(models_, ids, modes, kinds, ks, new: int, timing, costs) -> list[dict]:
    """One row per (mode, kind, k); ``models_`` = (target, draft, hf, hf_draft or None);
    ``costs``: :func:`forward_costs` of the target at every verification width."""
    from decoding import SamplingConfig

    target, draft_model, hf, hf_draft = models_
    rows = []
    with tqdm(total=len(modes) * len(kinds) * len(ks), desc="speculative") as bar:
        for mode in modes:
            sampling = SamplingConfig() if mode == "greedy" else SamplingConfig(temperature=0.8)
            plain = baselines(target, hf, ids, sampling, new, timing)
            for kind in kinds:
                for k in ks:
                    if skipped(kind, k):
                        bar.update()
                        continue
                    bar.set_postfix(mode=mode, kind=kind, k=k)
                    row = dict(mode=mode, kind=kind, k=k)
                    row.update(
                        ours(target, draft_model, ids, kind, k, sampling, new, timing, plain)
                    )
                    t = costs[verify_width(kind, k)]
                    row.update(
                        verify_cost=t / costs[1], bound=row["tokens_per_call"] * costs[1] / t
                    )
                    if hf_draft is not None:
                        args = (hf, hf_draft, ids, kind, k, sampling.greedy, new, timing)
                        row.update(hf_assisted(*args, plain["hf_seconds"]))
                    row.update(hf_plain_tok_s=len(ids) * new / plain["hf_seconds"])
                    rows.append(row)
                    bar.update()
    return rows


def acceptance_of(checkpoints: list[str], n_prompts: int) -> None:
    """Acceptance of draft checkpoints with code-target: all prompts in one batch, k = 3,
    64 tokens, greedy and T = 0.8 (writes ``speculative_acceptance.json``)."""
    import models
    from decoding import SamplingConfig, speculative_generate

    target, tok = models.pretrained("code-target")
    ids = [[tok.bos_id] + tok.encode(t) for t in code_prompts(n_prompts)]
    rows = []
    for path in checkpoints:
        draft = models.load_hf_checkpoint(path)
        for mode, temperature in (("greedy", 0.0), ("t0.8", 0.8)):
            s = SamplingConfig(temperature=temperature)
            st = speculative_generate(
                target, draft, ids, num_draft_tokens=3, max_new_tokens=64, sampling=s
            ).stats
            rows.append(
                dict(
                    draft=path,
                    mode=mode,
                    acceptance=st["acceptance_rate"],
                    tokens_per_call=st["tokens_per_target_call"],
                )
            )
    common.print_table(rows, ["draft", "mode", "acceptance", "tokens_per_call"])
    common.write_results("speculative_acceptance", rows, loadavg=os.getloadavg(), prompts=len(ids))


def eagle_acceptance(heads: list[str], k: int = 5, results_dir=None) -> None:
    """Offline acceptance of EAGLE heads (directories, or the shipped name) for SmolLM2 on the
    open-chat prompts: the target's greedy answers (160 new tokens), and after every answer
    position a chain of k drafted as decoding drafts them (``models.eagle_train
    .chain_acceptance``); per head, how often at least 1 .. k were kept, the mean kept, and
    the head's training data and held-out figures from its ``training.json``
    (``eagle_acceptance.json``). Independent of the machine's load."""
    import json

    import models
    from decoding import generate
    from models.eagle import load_eagle
    from models.eagle_train import chain_acceptance, sequence_features
    from models.pretrained import shipped_path

    target, tok = models.pretrained("smollm2-135m-instruct")
    seqs, plens = [], []
    for ids in real_prompt_ids(tok, "open-chat"):
        out = generate(target, [ids], max_new_tokens=160, eos_id=tok.eos_id).tokens[0]
        seqs.append(list(ids) + out)
        plens.append(len(ids))
    feats = sequence_features(target, seqs, log=lambda s: None)
    rows = []
    for name in tqdm(heads, desc="heads"):
        path = str(shipped_path(name)) if not os.path.isdir(name) else name
        head = load_eagle(path, target.config)
        kept = np.concatenate(
            [
                chain_acceptance(head, target, s, f, n, k)
                for s, f, n in zip(seqs, feats, plens, strict=True)
            ]
        )
        meta = {}
        if os.path.isfile(os.path.join(path, "training.json")):
            with open(os.path.join(path, "training.json")) as f:
                meta = json.load(f)
        held = meta.get("heldout") or {}
        rows.append(
            dict(
                head=name,
                train_sequences=meta.get("train_sequences"),
                steps=meta.get("train_config", {}).get("steps"),
                depth=meta.get("depth"),
                heldout_first=held.get("first_token"),
                heldout_mean=held.get("mean_accepted"),
                first=float(np.mean(kept >= 1)),
                at_least=[float(np.mean(kept >= i)) for i in range(1, k + 1)],
                mean_kept=float(kept.mean()),
                positions=int(kept.size),
            )
        )
    cols = ["head", "train_sequences", "heldout_first", "heldout_mean", "first", "mean_kept"]
    common.print_table(rows, cols)
    common.write_results(
        "eagle_acceptance", rows, results_dir=results_dir, k=k, prompts=len(seqs), new_tokens=160
    )


def _calls(props: dict, s, start: int, k: int) -> int:
    """Target calls to generate ``s[start:]`` greedily when step j (``s[j]`` the last known
    token) verifies the k tokens ``props[j]``: the ones ``s`` agrees with, plus the target's."""
    j, calls = start, 0
    while j < len(s) - 1:
        a = 0
        while a < k and j + 1 + a < len(s) and props[j][a] == s[j + 1 + a]:
            a += 1
        j, calls = j + a + 1, calls + 1
    return calls


def sources(k: int = 3, ngrams=(1, 2, 3, 4)) -> list[dict]:
    """Greedy tokens per target call of the Medusa heads, prompt lookup and the two together
    (``Medusa(heads, lookup_ngram=n)``), simulated on the target's greedy continuations of the
    4 calibration prompts and the 4 benchmark prompts (one source per step, as the loop does).
    Writes ``speculative_sources.json``; ``decoding.medusa.LOOKUP_NGRAM`` comes from it."""
    import jax.numpy as jnp

    import models
    from decoding import generate
    from decoding.drafts import lookup

    target, tok = models.pretrained("code-target")
    heads, texts = medusa_heads(), code_prompts(8)
    rows = []
    for name, part in (("calibration", texts[4:]), ("benchmark", texts[:4])):
        ids = [[tok.bos_id] + tok.encode(t) for t in part]
        made, calls, new = {}, {}, generate(target, ids, max_new_tokens=NEW_TOKENS).tokens
        for prompt, cont in zip(ids, new, strict=True):
            s = np.asarray(list(prompt) + list(cont))
            seq, steps = jnp.asarray(s[None], jnp.int32), range(len(prompt), len(s) - 1)
            _, h = target(seq, return_hidden=True)
            guess = np.asarray(jnp.argmax(heads(h)[0], -1))  # [T, H]: h_t's head d -> s[t+2+d]
            props = {
                "heads": {j: guess[j - 1, :k] for j in steps},
                "lookup": {
                    j: np.asarray(lookup(seq, jnp.asarray([j + 1]), k, 1, 3)[0]) for j in steps
                },
            }
            for n in ngrams:
                mixed = {}
                for j in steps:
                    f, x = lookup(seq, jnp.asarray([j + 1]), k, n, n, return_found=True)
                    mixed[j] = np.asarray(x[0]) if bool(f[0]) else guess[j - 1, :k]
                props[f"heads+lookup:{n}"] = mixed
            for src, prop in props.items():
                made[src] = made.get(src, 0) + len(cont)
                calls[src] = calls.get(src, 0) + _calls(prop, s, len(prompt), k)
        rows += [
            dict(prompts=name, source=src, k=k, tokens_per_call=made[src] / calls[src])
            for src in made
        ]
    common.print_table(rows, ["prompts", "source", "k", "tokens_per_call"])
    common.write_results("speculative_sources", rows, new_tokens=NEW_TOKENS)
    return rows


# ----------------------------------------------------------------------------- the real model

# Chat prompts for SmolLM2. Input-grounded: tasks whose answer copies the prompt (fix typos and
# return the text, rewrite it, convert data between formats, annotate code), each one that this
# 135M model does answer by copying long spans of its input (checked on its greedy answers; it
# does not carry out a "rename this variable" edit, answering with a different function, so that
# task is not among them). Open chat: answers that copy nothing. Every answer ends at the chat's
# end token (``eos_id``), so what is timed is the answer, not a made-up next turn.
_CODE = """def count_words(text):
    counts = {}
    for word in text.split():
        word = word.lower().strip(".,!?")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(text, n):
    counts = count_words(text)
    ranked = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)
    return ranked[:n]
"""
_TEXT = (
    "The meeting is moved from Tuesday to Thursday at 3 pm. Alice will present the budget, Bob "
    "the hiring plan and Carol the new office layout. Please send your slides to Dan by "
    "Wednesday noon, and book the large room on the second floor. After the meeting, the team "
    "will have lunch at the Italian place across the street. Eve is in charge of the lunch "
    "order, so tell her by Tuesday evening if you have any food allergies. The quarterly "
    "report is due on Friday, and Frank will collect the numbers from every department."
)
_TYPOS = {"present": "presnt", "budget": "budgit", "allergies": "alergies", "quarterly": "quartely"}
_JSON = (
    '{"name": "server", "port": 8080, "debug": false, "hosts": ["alpha", "beta", "gamma", '
    '"delta"], "limits": {"cpu": 2, "memory": "4GB", "disk": "20GB"}, "owner": {"name": '
    '"Alice", "email": "alice@example.com"}, "tags": ["web", "internal", "prod"]}'
)


def _with_typos(text: str) -> str:
    text = text.replace("meeting", "meetng", 1)
    for right, wrong in _TYPOS.items():
        text = text.replace(right, wrong)
    return text


REAL_PROMPTS = {
    "input-grounded": [
        f"Fix the spelling mistakes in this text and return it: {_with_typos(_TEXT)}",
        f"Convert this JSON to YAML:\n{_JSON}",
        f"Add comments to this code and return it:\n\n```python\n{_CODE}```",
        f"Rewrite this text in the past tense: {_TEXT}",
    ],
    "open-chat": [
        "What are three tips for staying focused while studying?",
        "Write a short poem about the sea at night.",
        "Explain why the sky is blue to a ten-year-old.",
        "Give me a simple recipe for a vegetable soup.",
    ],
}


def copied_fraction(prompt, answer, span: int = 4) -> float:
    """The share of ``answer``'s tokens that lie in a run of >= ``span`` tokens which also
    occurs in ``prompt``: how much of the answer is a copy of its input (0 for none)."""
    grams = {tuple(prompt[i : i + span]) for i in range(len(prompt) - span + 1)}
    covered = np.zeros(len(answer), bool)
    for i in range(len(answer) - span + 1):
        if tuple(answer[i : i + span]) in grams:
            covered[i : i + span] = True
    return float(covered.mean()) if len(answer) else 0.0


def real_prompt_ids(tokenizer, workload: str, count: int | None = None) -> list[list[int]]:
    """The chat-templated token ids of a workload's prompts."""
    texts = REAL_PROMPTS[workload][:count]
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        for t in texts
    ]


def real_model(args) -> None:
    """SmolLM2-135M-Instruct, B = 1, up to 160 new tokens (96 quick), each answer ending at the
    chat's end token, greedy and T = 0.7: prompt lookup at the chosen k (``num_draft_tokens=
    None``; with ``--ks``, also at each of those k) against plain ``generate``, per workload:
    median of paired runs per prompt, summed over prompts; greedy rows checked identical.
    ``copied``: the share of the plain answers' tokens that copy a 4-token run of the prompt
    (:func:`copied_fraction`); ``settings.step_ms``: the target's cached forward at Tq = 1 ..
    MAX_K + 1 as the choice of k measured it (``decoding.drafts.measured_costs``)."""
    import models
    from decoding import Eagle, Medusa, PromptLookup, SamplingConfig, generate, speculative_generate
    from decoding.drafts import measured_costs
    from decoding.medusa import LOOKUP_NGRAM

    target, tok = models.pretrained("smollm2-135m-instruct")
    kinds = args.real_kinds or ["prompt-lookup"]
    drafts = {}
    for kind in kinds:
        if kind == "prompt-lookup":
            drafts[kind] = PromptLookup()
        elif kind == "medusa":
            drafts[kind] = Medusa(models.pretrained("smollm2-135m-instruct-medusa")[0])
        else:
            head = models.pretrained("smollm2-135m-instruct-eagle")[0]
            drafts[kind] = Eagle(head, lookup_ngram=LOOKUP_NGRAM if "lookup" in kind else None)
    new = 96 if args.quick else 160
    n_prompts = 1 if args.quick else 4
    timing = (1 if args.quick else 3, 1)  # (runs, warm-up)
    modes = {"greedy": SamplingConfig(), "T=0.7": SamplingConfig(temperature=0.7)}
    ks = [None] + list(args.ks or [])
    rows = []
    for workload, kind, (mode, sampling), k in itertools.product(
        args.real_workloads or list(REAL_PROMPTS), kinds, modes.items(), ks
    ):
        plain_s = spec_s = 0.0
        match, acc, chosen, tpc, copied, lengths = [], [], set(), [], [], []
        prompts = real_prompt_ids(tok, workload, n_prompts)
        desc = f"{workload} {kind} {mode} k={k or 'chosen'}"
        for ids in tqdm(prompts, desc=desc):
            kw = dict(max_new_tokens=new, sampling=sampling, seed=0, eos_id=tok.eos_id)
            plain = functools.partial(generate, target, [ids], **kw)
            spec = functools.partial(
                speculative_generate,
                target,
                drafts[kind],
                [ids],
                num_draft_tokens=k,
                **kw,
            )
            a_s, b_s, b = timed_pair(plain, spec, timing)
            plain_s, spec_s = plain_s + a_s, spec_s + b_s
            ref = plain().tokens
            match.append(ref == b.tokens)
            copied.append(copied_fraction(ids, ref[0]))
            lengths.append(len(ref[0]))
            acc.append(b.stats["acceptance_rate"])
            tpc.append(b.stats["tokens_per_target_call"])
            chosen.add(b.stats["num_draft_tokens"])
        row = dict(
            workload=workload,
            mode=mode,
            kind=kind,
            k=sorted(chosen),
            k_chosen=k is None,
            speedup=plain_s / spec_s,
            plain_s=plain_s,
            spec_s=spec_s,
            acceptance=float(np.mean(acc)),
            tokens_per_call=float(np.mean(tpc)),
            new_tokens=float(np.mean(lengths)),
            copied=float(np.mean(copied)),
            match=float(np.mean(match)) if mode == "greedy" else None,
        )
        rows.append(row)
        print(row)
    settings = dict(
        model="smollm2-135m-instruct",
        batch=1,
        max_new_tokens=new,
        eos="the chat's end token",
        prompts=n_prompts,
        runs=timing[0],
        quick=args.quick,
        step_ms=[1e3 * c for c in measured_costs(target).target],
        loadavg=os.getloadavg(),
    )
    name = "speculative_real" if kinds == ["prompt-lookup"] else "speculative_real_heads"
    common.finish(args, name, rows, list(rows[0]), settings=settings)


def main() -> None:
    parser = common.parser(__doc__, runs=3, quick="one prompt, greedy, k in {2, 4}, 48 tokens")
    parser.add_argument("--kinds", nargs="+", default=None, help=f"default: {' '.join(KINDS)}")
    parser.add_argument("--ks", nargs="+", type=int, default=None, help="default: 1 .. 8")
    parser.add_argument("--prompts", type=int, default=None, help="default: 4")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 128")
    parser.add_argument("--draft-checkpoint", default=None, help="a draft other than code-draft")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--name", default="speculative_cpu", help="results name")
    parser.add_argument(
        "--acceptance-of", nargs="+", metavar="CHECKPOINT", help="only these drafts' acceptance"
    )
    parser.add_argument("--sources", action="store_true", help="only :func:`sources`")
    parser.add_argument(
        "--eagle-heads",
        nargs="+",
        metavar="HEAD",
        help="only these EAGLE heads' offline acceptance on open chat (eagle_acceptance)",
    )
    parser.add_argument(
        "--real", action="store_true", help="only SmolLM2 (:func:`real_model`; speculative_real)"
    )
    parser.add_argument(
        "--real-kinds",
        nargs="+",
        choices=("prompt-lookup", "medusa", "eagle", "eagle+lookup"),
        default=None,
        help="with --real: the drafts (default prompt-lookup; others write speculative_real_heads)",
    )
    parser.add_argument("--real-workloads", nargs="+", choices=tuple(REAL_PROMPTS), default=None)
    args = parser.parse_args()
    if args.real:
        return real_model(args)
    if args.sources:
        return sources()
    if args.eagle_heads:
        return eagle_acceptance(args.eagle_heads, results_dir=args.results_dir)
    if args.acceptance_of:
        return acceptance_of(args.acceptance_of, args.prompts or 4)
    quick = args.quick
    kinds = args.kinds or (
        ["code-draft", "prompt-lookup", "early-exit:4", "medusa", "medusa-tree"] if quick else KINDS
    )
    ks = args.ks or ([2, 4] if quick else list(range(1, 9)))
    new = args.new_tokens or (48 if quick else NEW_TOKENS)
    modes = ["greedy"] if quick else ["greedy", "t0.8"]

    import torch
    import transformers

    import models
    from models.pretrained import shipped_path

    target, tok = models.pretrained("code-target")
    draft_dir = args.draft_checkpoint or str(shipped_path("code-draft"))
    draft_model = models.load_hf_checkpoint(draft_dir)
    texts = code_prompts(args.prompts or (1 if quick else 4))
    ids = [[tok.bos_id] + tok.encode(t) for t in texts]
    load = transformers.AutoModelForCausalLM.from_pretrained
    hf = load(str(shipped_path("code-target"))).float().eval()
    hf_draft = None if args.no_hf else load(draft_dir).float().eval()
    load_start = os.getloadavg()
    tree_depths = [medusa_tree(kind).depth for kind in kinds if kind.startswith("medusa-tree")]
    ks = sorted(set(ks) | set(tree_depths))  # a tree runs at its own depth
    widths = sorted({1} | {verify_width(kind, k) for kind in kinds for k in ks})
    costs = forward_costs(target, widths)
    rows = sweep(
        (target, draft_model, hf, hf_draft),
        ids,
        modes,
        kinds,
        ks,
        new,
        (args.runs, args.warmup),
        costs,
    )
    columns = [
        "mode",
        "kind",
        "k",
        "acceptance",
        "tokens_per_call",
        "theory",
        "tok_s",
        "plain_tok_s",
        "speedup",
        "verify_cost",
        "bound",
        "match",
        "hf_tok_s",
        "hf_speedup",
    ]
    settings = dict(
        prompts=texts,
        new_tokens=new,
        batch=1,
        dtype="float32",
        draft=draft_dir,
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        loadavg_start=load_start,
        forward_ms={T: 1e3 * c for T, c in costs.items()},
    )
    note = (
        "Shared 2-core CPU: wall times are noisy; acceptance and tokens per call are not. "
        "Speed-ups are against plain generate called alternately with each row's calls. "
        "verify_cost: the "
        "target's forward of the verified tokens over a plain decode step (settings.forward_ms, "
        "same run); bound = tokens_per_call / verify_cost, the decode-loop speed-up of a free "
        "draft if a step cost only its target forward (a guide, not a ceiling)."
    )
    common.finish(args, args.name, rows, columns, settings=settings, note=note)


if __name__ == "__main__":
    main()
