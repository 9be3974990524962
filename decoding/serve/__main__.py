"""``python -m decoding.serve``: serve a model over the OpenAI API with uvicorn.

    python -m decoding.serve --model smollm2-135m-instruct --host 127.0.0.1 --port 8000 \\
        [--max-batch 32 --num-pages N --page-size 16 --max-queue 256 --max-seq-len 2048]
        [--draft prompt-lookup|medusa|medusa+lookup|eagle|eagle+lookup | --draft-model NAME]
        [--num-draft-tokens K]
        [--logprobs-mode raw|processed]

``--draft prompt-lookup`` runs speculation inside the engine (``Engine(draft=PromptLookup())``):
every step drafts k tokens per row from its own prompt and output and verifies them in the same
step; outputs are unchanged (greedy identical, sampled exactly distributed); k is chosen from
the model's measured step costs unless ``--num-draft-tokens`` fixes it. ``--draft medusa`` drafts
with the shipped Medusa heads trained on ``--model`` (``Engine(draft=Medusa(heads))``), and
``medusa+lookup`` takes prompt lookup's continuation where the last 3 tokens occurred before;
``--draft eagle`` / ``eagle+lookup`` likewise with the shipped EAGLE head
(``Engine(draft=Eagle(head[, lookup_ngram=3]))``, the fastest draft on open chat).
``--draft-model NAME`` (a name, directory or .gguf, as ``--model``; e.g. ``--model code-target
--draft-model code-draft``) drafts with a smaller model of the same vocabulary
(``Engine(draft=model)``), its KV pages kept beside the target's.

Before it listens the server compiles every step its engine can run (``Engine.warmup``: a few
dozen shapes, tens of seconds on SmolLM2), so that no request waits behind a compilation;
``--no-warmup`` skips that.

``--logprobs-mode`` says what ``logprobs`` report (``Engine(logprobs_mode=...)``): ``raw``
(default) the model's distribution, as OpenAI's API and vLLM's default do; ``processed`` the
tempered, filtered distribution each token was drawn from.

A request that leaves out temperature, top_p, top_k or min_p gets the checkpoint's value
(``generation_config.json`` of a directory, ``general.sampling.*`` of a GGUF file), else
OpenAI's (``decoding.serve.defaults``).

SIGTERM or Ctrl-C stops accepting connections, lets in-flight requests finish for up to
``--graceful-timeout`` seconds, then aborts the rest; the exit log line says how many KV pages
were still held (0 when nothing leaked). After SIGTERM the process ends by SIGTERM (what
supervisors expect); after Ctrl-C (SIGINT, at any time, loading included) it exits 130 with no
traceback.

Exit status: 2 for a usage error, checked before any model loads (a bad flag value, a
``--host`` that does not resolve, a (host, port) that cannot be bound now, e.g. "--port 8000:
address already in use"); 3 when uvicorn fails to start anyway (another process took the port
meanwhile); 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

import jax
import uvicorn

import models
from decoding.cli import (
    KV_DTYPE_HELP,
    KV_DTYPES,
    check_bindable,
    kv_pool_problem,
    load_model,
    nonnegative_number,
    persistent_compilation_cache,
    port,
    positive_int,
)
from decoding.distributed import DistributedEngine
from decoding.drafts import MAX_K, PromptLookup
from decoding.eagle import Eagle
from decoding.engine import Engine
from decoding.medusa import LOOKUP_NGRAM, Medusa
from decoding.paging import pages_for
from decoding.sampling import LOGPROBS_MODES
from decoding.serve.app import create_app
from decoding.serve.defaults import generation_defaults
from models.pretrained import (
    DEFAULT_MODEL,
    SHIPPED_EAGLE,
    SHIPPED_MEDUSA,
    eagle_head_for,
    medusa_heads_for,
    model_arg,
    model_path,
)
from models.sharding import mesh_shape


def _medusa(model: str, lookup_ngram=None) -> Medusa:
    heads = models.pretrained(medusa_heads_for(model))[0]
    return Medusa(heads, lookup_ngram=lookup_ngram)


def _eagle(model: str, lookup_ngram=None) -> Eagle:
    return Eagle(models.pretrained(eagle_head_for(model))[0], lookup_ngram=lookup_ngram)


# The draft kinds the engine runs (``Engine(draft=...)``), by command-line name: each builds the
# draft for the --model name (Medusa, EAGLE: the shipped heads trained on it, as a chain).
DRAFTS = {
    "prompt-lookup": lambda model: PromptLookup(),
    "medusa": _medusa,
    "medusa+lookup": lambda model: _medusa(model, LOOKUP_NGRAM),
    "eagle": _eagle,
    "eagle+lookup": lambda model: _eagle(model, LOOKUP_NGRAM),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m decoding.serve", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", type=model_arg, default=DEFAULT_MODEL, help="name, directory or .gguf"
    )
    p.add_argument("--served-model-name", default=None, help="the API's model id (default --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000, help="0: the OS picks one (logged)")
    p.add_argument("--max-batch", type=positive_int, default=32, help="rows decoded together")
    p.add_argument(
        "--quantize",
        choices=models.quant.FORMATS,
        default=None,
        help="block-quantize the linear layers for decoding (models.quantize)",
    )
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None, help=KV_DTYPE_HELP)
    p.add_argument("--max-seq-len", type=positive_int, default=2048, help="prompt + completion")
    p.add_argument("--page-size", type=positive_int, default=16)
    p.add_argument(
        "--num-pages",
        type=positive_int,
        default=None,
        help="KV pool pages (default: max-batch requests of max-seq-len / 4 tokens)",
    )
    p.add_argument("--max-prefill-tokens", type=positive_int, default=512)
    p.add_argument("--max-queue", type=positive_int, default=256, help="choices in flight")
    p.add_argument(
        "--graceful-timeout", type=nonnegative_number, default=30.0, help="seconds, on SIGTERM"
    )
    p.add_argument(
        "--draft",
        choices=sorted(DRAFTS),
        default=None,
        help="speculation inside the engine (default: none)",
    )
    p.add_argument(
        "--draft-model",
        type=model_arg,
        default=None,
        help="a smaller model of the same vocabulary drafts inside the engine (name, dir or .gguf)",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=positive_int,
        default=None,
        help=f"k, at most {MAX_K} (default: chosen from measured step costs)",
    )
    p.add_argument(
        "--logprobs-mode",
        choices=LOGPROBS_MODES,
        default="raw",
        help="what logprobs report: the model's distribution (raw) or the sampled one",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="listen at once, without compiling every engine step first (Engine.warmup): each "
        "step shape then compiles inside the first request that needs it",
    )
    p.add_argument(
        "--mesh",
        type=mesh_shape,
        default=None,
        metavar="DATA,MODEL",
        help="shard the model over a (data, model) mesh of all devices: of every process under "
        "python -m decoding.launch, process 0 serving, the others stepping with it",
    )
    return p


# A distributed server's idle worker steps this often: the other processes wait in its steps.
IDLE_STEP_S = 0.5


# uvicorn's exit status when it cannot start (uvicorn.config.STARTUP_FAILURE).
STARTUP_FAILURE = 3


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every check that needs no model, so that a bad command line fails in seconds (exit 2)
    rather than after loading one."""
    if args.draft is not None and args.draft_model is not None:
        parser.error("--draft and --draft-model are two drafts: give one")
    if args.draft_model is not None and args.mesh is not None:
        parser.error("--draft-model runs on one process: drop --mesh")
    if args.num_draft_tokens is not None and args.draft is None and args.draft_model is None:
        parser.error("--num-draft-tokens needs --draft or --draft-model")
    if args.num_draft_tokens is not None and args.num_draft_tokens > MAX_K:
        parser.error(f"--num-draft-tokens must be at most {MAX_K}, got {args.num_draft_tokens}")
    if (args.draft or "").startswith(("medusa", "eagle")):
        medusa = args.draft.startswith("medusa")
        shipped = SHIPPED_MEDUSA if medusa else SHIPPED_EAGLE
        if (medusa_heads_for if medusa else eagle_head_for)(args.model) is None:
            parser.error(
                f"--draft {args.draft}: no shipped {'Medusa heads' if medusa else 'EAGLE head'} "
                f"for --model {args.model} (they ship for {', '.join(sorted(shipped.values()))})"
            )
        if args.mesh is not None:
            parser.error(f"--draft {args.draft} runs on one process: drop --mesh")
    if args.max_seq_len < 2:
        parser.error("--max-seq-len must be >= 2 (a prompt token and one more), got 1")
    if args.page_size > args.max_seq_len:
        parser.error(
            f"--page-size {args.page_size} is larger than --max-seq-len {args.max_seq_len}"
        )
    if args.num_pages is not None and args.max_batch > args.num_pages:
        # Every running row writes into a page of its own: rows past num_pages never run.
        parser.error(f"--max-batch {args.max_batch} is larger than --num-pages {args.num_pages}")
    if args.mesh is not None:
        if args.quantize is not None:  # models.shard places float kernels only
            parser.error("--quantize does not combine with --mesh")
        if math.prod(args.mesh) != jax.device_count():
            parser.error(f"--mesh {args.mesh} must hold all {jax.device_count()} devices")
        if args.draft is not None and args.num_draft_tokens is None:
            parser.error("--mesh with --draft needs --num-draft-tokens (the same k everywhere)")
    if args.mesh is None or jax.process_index() == 0:  # the other processes do not listen
        problem = check_bindable(args.host, args.port)
        if problem is not None:
            parser.error(problem)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return serve(parser, args)
    except KeyboardInterrupt:  # Ctrl-C while loading, or uvicorn's re-raised SIGINT after it
        logging.getLogger("decoding.serve").info("interrupted")
        return 130


def serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Loads the model, builds the engine and runs uvicorn until it stops -> exit status."""
    model, tokenizer = load_model(parser, args)
    if args.mesh is not None:
        model = models.shard(model, jax.make_mesh(args.mesh, ("data", "model")))
    max_seq_len = min(args.max_seq_len, model.config.max_position)
    num_pages = args.num_pages or args.max_batch * pages_for(
        max(max_seq_len // 4, 1), args.page_size
    )
    # Sharded (--mesh), each device holds a part of the pool: the whole-pool check is for one.
    problem = None if args.mesh else kv_pool_problem(model.config, num_pages, args.page_size)
    if problem is not None:
        default = "" if args.num_pages else f" (the default for --max-batch {args.max_batch})"
        parser.error(problem + default)
    draft = DRAFTS[args.draft](args.model) if args.draft else None
    if args.draft_model is not None:
        try:
            draft = models.pretrained(args.draft_model)[0]
        except (OSError, ValueError) as e:
            parser.error(f"--draft-model {args.draft_model}: {e}")
    try:
        engine = (Engine if args.mesh is None else DistributedEngine)(
            model,
            max_batch=args.max_batch,
            num_pages=num_pages,
            page_size=args.page_size,
            max_prefill_tokens=args.max_prefill_tokens,
            max_seq_len=max_seq_len,
            draft=draft,
            num_draft_tokens=args.num_draft_tokens,
            logprobs_mode=args.logprobs_mode,
        )
    except ValueError as e:  # a draft model that cannot draft for this one (vocabulary, length)
        if args.draft_model is None:
            raise
        parser.error(f"--draft-model {args.draft_model}: {e}")
    log = logging.getLogger("decoding.serve")
    if not args.no_warmup:  # every process of a --mesh run compiles the same steps in order
        log.info("warming up: compiling every engine step (--no-warmup skips this)")
        log.info("warmed up in %.1f s", engine.warmup())
    if args.mesh is not None and not engine.is_leader:
        engine.serve_followers()  # until process 0's server stops
        return 0
    defaults = generation_defaults(model_path(args.model))
    log.info("sampling defaults for omitted fields: %s", defaults)
    app = create_app(
        engine,
        tokenizer,
        model_name=args.served_model_name or args.model,
        max_queue=args.max_queue,
        defaults=defaults,
        idle_step_s=None if args.mesh is None else IDLE_STEP_S,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        timeout_graceful_shutdown=args.graceful_timeout,
        log_level="info",
    )
    server = uvicorn.Server(config)
    try:
        server.run()  # returns after a graceful shutdown; re-raises a SIGINT it handled
    except Exception as e:
        if server.started:
            raise
        # uvicorn exits 3 itself on an OSError at startup; anything else would escape as a
        # traceback. The app's lifespan has stopped the engine thread either way.
        log.error("the server did not start: %s: %s", type(e).__name__, e)
    return 0 if server.started else STARTUP_FAILURE


if __name__ == "__main__":
    persistent_compilation_cache()
    sys.exit(main())
