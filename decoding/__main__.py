"""Command line: chat with a model, or continue a prompt, streaming the text as it is generated.

    python -m decoding --chat "What is the capital of France?"      # the default model, SmolLM2
    python -m decoding --interactive                                  # a multi-turn chat
    python -m decoding --model path/to/model.gguf "a plain prompt"
    python -m decoding --model code-target "def fibonacci(n):" --speculative prompt-lookup

``--model`` takes an installed or shipped name, a Hugging Face checkpoint directory or a
``.gguf`` file. ``--chat`` applies the model's chat template and stops at the template's end of
turn; ``--interactive`` keeps the conversation in the paged cache between turns, so each turn
prefills only its own tokens. Text streams through the continuous-batching engine; with
``--speculative``, ``--cache contiguous`` or ``--mesh`` (a model sharded over all devices, of
every process under ``python -m decoding.launch``) the continuation is printed when complete. A stats
line goes to stderr. Bad arguments are usage errors (exit 2) naming the flag, never a traceback;
Ctrl-C stops quietly (exit 130) with what was generated on the screen.
"""

from __future__ import annotations

import argparse
import math
import sys

import jax
import jax.numpy as jnp

import models
from decoding import cli
from decoding.chat import ChatSession, encode_prompt, stream, turn_end_id
from decoding.drafts import EarlyExit, PromptLookup
from decoding.eagle import Eagle
from decoding.engine import Engine
from decoding.generate import generate
from decoding.medusa import LOOKUP_NGRAM, Medusa
from decoding.paging import pages_for
from decoding.sampling import SamplingConfig
from decoding.speculative import speculative_generate
from decoding.tree import TreeSpec
from models.pretrained import (
    DEFAULT_MODEL,
    NAMES,
    SHIPPED_EAGLE,
    SHIPPED_MEDUSA,
    eagle_head_for,
    medusa_heads_for,
    model_arg,
)
from models.sharding import mesh_shape

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


SPECULATIVE = (
    "code-draft",
    "prompt-lookup",
    "medusa",
    "medusa+lookup",
    "medusa-tree",
    "eagle",
    "eagle+lookup",
)


def _speculative(text: str) -> str:
    """One of :data:`SPECULATIVE` or ``early-exit:L`` (L >= 1)."""
    kind, _, layers = text.partition(":")
    if text in SPECULATIVE or (kind == "early-exit" and layers.isdigit() and int(layers) >= 1):
        return text
    raise argparse.ArgumentTypeError(
        f"expected one of {', '.join(SPECULATIVE)} or early-exit:L with L >= 1, got {text!r}"
    )


def _draft(spec: str, model: str):
    """The ``speculative_generate`` draft for a ``--speculative`` value (``medusa``: the
    shipped heads trained on ``model``, ``models.pretrained.medusa_heads_for``, as a chain;
    ``medusa+lookup``: that chain with prompt lookup where the last LOOKUP_NGRAM tokens
    occurred before; ``medusa-tree``: as ``TreeSpec.default(4)``; ``eagle``: the shipped EAGLE
    head trained on ``model``; ``eagle+lookup``: it with prompt lookup, as ``medusa+lookup``)."""
    if spec.startswith("eagle"):
        head = models.pretrained(eagle_head_for(model))[0]
        return Eagle(head, lookup_ngram=LOOKUP_NGRAM if spec == "eagle+lookup" else None)
    if spec == "code-draft":
        return models.pretrained("code-draft")[0]
    if spec == "prompt-lookup":
        return PromptLookup()
    if spec.startswith("medusa"):
        heads = models.pretrained(medusa_heads_for(model))[0]
        if spec == "medusa-tree":
            return Medusa(heads, tree=TreeSpec.default(heads.num_heads))
        return Medusa(heads, lookup_ngram=LOOKUP_NGRAM if spec == "medusa+lookup" else None)
    return EarlyExit(num_layers=int(spec.partition(":")[2]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m decoding",
        description="Chat with a model or continue a prompt, streaming the text.",
    )
    parser.add_argument("prompt", nargs="?", help="text to continue (with --chat: the question)")
    parser.add_argument(
        "--model",
        type=model_arg,
        default=DEFAULT_MODEL,
        help=f"{', '.join(NAMES)}, a Hugging Face checkpoint directory or a .gguf file "
        f"(default {DEFAULT_MODEL})",
    )
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument(
        "--interactive", action="store_true", help="a multi-turn chat on stdin (/reset, /exit)"
    )
    parser.add_argument("--system", default=None, metavar="TEXT", help="a chat's system message")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument(
        "--quantize",
        choices=models.quant.FORMATS,
        default=None,
        help="block-quantize the linear layers (models.quantize): fewer bytes read per token",
    )
    parser.add_argument("--kv-dtype", choices=cli.KV_DTYPES, default=None, help=cli.KV_DTYPE_HELP)
    parser.add_argument("--max-new-tokens", type=cli.positive_int, default=256, metavar="N")
    parser.add_argument("--temperature", type=cli.number, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=cli.number, default=1.0, help="1.0 = off")
    parser.add_argument("--min-p", type=cli.number, default=0.0, help="0.0 = off")
    parser.add_argument("--seed", type=cli.seed, default=0, help="an int in [0, 2**32)")
    parser.add_argument(
        "--context",
        type=cli.positive_int,
        default=8192,
        metavar="T",
        help="--interactive: the longest conversation, in tokens (capped at the model's)",
    )
    parser.add_argument(
        "--cache",
        choices=("paged", "contiguous"),
        default="paged",
        help="paged: streamed through the engine; contiguous: one generate call",
    )
    parser.add_argument(
        "--page-size",
        type=cli.positive_int,
        default=16,
        metavar="P",
        help="positions per page (capped at what the request can use)",
    )
    parser.add_argument(
        "--speculative",
        type=_speculative,
        default=None,
        metavar="{" + ",".join((*SPECULATIVE[:2], "early-exit:L", *SPECULATIVE[2:])) + "}",
        help="speculative decoding with this draft (same output distribution, fewer target calls)",
    )
    parser.add_argument(
        "--mesh",
        type=mesh_shape,
        default=None,
        metavar="DATA,MODEL",
        help="shard the model over a (data, model) mesh of all devices (of every process under "
        "python -m decoding.launch); one generate call, printed by process 0",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=cli.positive_int,
        default=None,
        metavar="K",
        help="tokens drafted per step (default: the draft kind's best measured)",
    )
    return parser


def _is_utf8(text: str) -> bool:
    """Whether ``text`` (from argv or stdin, where undecodable bytes become surrogates) is text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_arguments(parser, args) -> SamplingConfig:
    try:
        sampling = SamplingConfig(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p
        )
    except ValueError as e:
        parser.error(str(e))
    if args.interactive:
        if args.speculative is not None or args.cache != "paged":
            parser.error(
                "--interactive streams through the paged engine: drop --speculative/--cache"
            )
    elif args.prompt is None:
        parser.error("a prompt is required (or --interactive)")
    elif not args.prompt:
        parser.error("prompt must not be empty")
    for flag, text in (("prompt", args.prompt), ("--system", args.system)):
        if text is not None and not _is_utf8(text):
            parser.error(f"{flag} is not valid UTF-8 text")
    if args.mesh is not None:
        if args.quantize is not None:  # models.shard places float kernels only
            parser.error("--quantize does not combine with --mesh")
        if math.prod(args.mesh) != jax.device_count():
            parser.error(f"--mesh {args.mesh} must hold all {jax.device_count()} devices")
        if args.interactive:
            parser.error("--interactive streams through one process's engine: drop --mesh")
    if args.num_draft_tokens is not None and args.speculative is None:
        parser.error("--num-draft-tokens needs --speculative")
    if (args.speculative or "").startswith("medusa") and medusa_heads_for(args.model) is None:
        parser.error(
            f"--speculative {args.speculative}: no shipped Medusa heads for --model "
            f"{args.model} (heads ship for {', '.join(sorted(SHIPPED_MEDUSA.values()))})"
        )
    if (args.speculative or "").startswith("eagle") and eagle_head_for(args.model) is None:
        parser.error(
            f"--speculative {args.speculative}: no shipped EAGLE head for --model {args.model} "
            "(one ships "
            f"for {', '.join(sorted(SHIPPED_EAGLE.values()))})"
        )
    if args.system is not None and not (args.chat or args.interactive):
        parser.error("--system needs --chat or --interactive")
    return sampling


def _engine(model, args, max_seq_len: int) -> Engine:
    max_seq_len = min(max_seq_len, model.config.max_position)
    P = min(args.page_size, max_seq_len)
    return Engine(
        model,
        max_batch=1,
        num_pages=pages_for(max_seq_len, P) + 1,
        page_size=P,
        max_seq_len=max_seq_len,
    )


def _print_stats(stats: dict, extra: str = "") -> None:
    print(
        f"[{stats['new_tokens']} tokens | prefill {stats['prefilled_tokens']} of "
        f"{stats['prompt_tokens']} prompt tokens, first token {1e3 * stats['ttft_s']:.0f} ms | "
        f"decode {stats['decode_tokens_per_s']:.1f} tok/s{extra}]",
        file=sys.stderr,
    )


def _interactive(session: ChatSession, first: str | None) -> int:
    print("Chat: /reset forgets the conversation, /exit (or Ctrl-D) ends it.", file=sys.stderr)
    pending = first
    while True:
        if pending is None:
            try:
                pending = input("> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
            except UnicodeDecodeError:
                pending = "\udcff"  # reported below like any other undecodable input
        text, pending = pending.strip(), None
        if not _is_utf8(text):
            print("[that line is not valid UTF-8 text]", file=sys.stderr)
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            continue
        if not text:
            continue
        try:
            for piece in session.send(text):
                print(piece, end="", flush=True)
        except ValueError as e:  # the conversation outgrew --context
            print(f"\n[{e}; /reset starts a new conversation]", file=sys.stderr)
            continue
        print(flush=True)
        _print_stats(session.stats)


def _complete(model, args, ids, eos_id, sampling):
    """One generate / speculative_generate call -> (new tokens, stats line extra)."""
    common = dict(
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        eos_id=eos_id,
        seed=args.seed,
        cache=args.cache,
        page_size=args.page_size,
    )
    if args.speculative is None:
        res = generate(model, [ids], **common)
    else:
        draft = _draft(args.speculative, args.model)
        res = speculative_generate(
            model, draft, [ids], num_draft_tokens=args.num_draft_tokens, **common
        )
    s = res.stats
    extra = ""
    if args.speculative is not None:
        extra = (
            f" | {args.speculative}, k={s['num_draft_tokens']}: acceptance "
            f"{s['acceptance_rate']:.2f}, {s['tokens_per_target_call']:.2f} tokens/target call"
        )
    stats = dict(
        new_tokens=len(res.tokens[0]),
        prefilled_tokens=len(ids),
        prompt_tokens=len(ids),
        ttft_s=s["prefill_s"],
        decode_tokens_per_s=s["decode_tokens_per_s"],
    )
    return res.tokens[0], stats, extra


def run(parser, args) -> int:
    sampling = _check_arguments(parser, args)
    model, tokenizer = cli.load_model(parser, args, dtype=DTYPES[args.dtype])
    if args.mesh is not None:
        try:
            model = models.shard(model, jax.make_mesh(args.mesh, ("data", "model")))
        except (TypeError, ValueError) as e:
            parser.error(f"--mesh {args.mesh}: {e}")
    chat = args.chat or args.interactive
    if chat and tokenizer.chat_template is None:
        parser.error(f"--chat: the model {args.model} has no chat template")
    if args.interactive:
        engine = _engine(model, args, args.context)
        session = ChatSession(
            engine,
            tokenizer,
            system=args.system,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            seed=args.seed,
        )
        return _interactive(session, args.prompt)
    try:
        if chat:
            messages = [] if args.system is None else [{"role": "system", "content": args.system}]
            ids = tokenizer.apply_chat_template(
                [*messages, {"role": "user", "content": args.prompt}]
            )
            eos_id = turn_end_id(tokenizer)
        else:
            ids, eos_id = encode_prompt(args.prompt, tokenizer, model.config)
        if len(ids) + args.max_new_tokens > model.config.max_position:
            raise ValueError(
                f"prompt length {len(ids)} + max_new_tokens {args.max_new_tokens} exceeds the "
                f"model's max_position {model.config.max_position}"
            )
        if eos_id is not None and not 0 <= eos_id < model.config.vocab_size:
            eos_id = None
    except ValueError as e:
        parser.error(f"--model {args.model}: {e}")
    if args.mesh is not None and jax.process_index() != 0:  # every process runs the program
        _complete(model, args, ids, eos_id, sampling)  # the output is process 0's to print
        return 0
    if not chat:
        print(args.prompt, end="", flush=True)
    if args.speculative is None and args.cache == "paged" and args.mesh is None:
        engine = _engine(model, args, len(ids) + args.max_new_tokens)
        stats = {}
        for piece in stream(
            engine,
            tokenizer,
            ids,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            stop_id=eos_id,
            seed=args.seed,
            stats=stats,
        ):
            print(piece, end="", flush=True)
        print(flush=True)
        _print_stats(stats, " | paged engine")
        return 0
    try:
        new, stats, extra = _complete(model, args, ids, eos_id, sampling)
    except ValueError as e:
        parser.error(str(e))
    print(tokenizer.decode([t for t in new if t != eos_id]), flush=True)
    _print_stats(stats, extra + f" | {args.cache} cache")
    return 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return run(parser, args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    cli.persistent_compilation_cache()
    sys.exit(main())
