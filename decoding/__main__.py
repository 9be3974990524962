"""Command line: ``python -m decoding "def fibonacci(n):" --max-new-tokens 200``
(``--speculative code-draft|prompt-lookup|early-exit:L|medusa|medusa+lookup|medusa-tree
[--num-draft-tokens K]``).

Prints the prompt with its continuation, then one stats line (prefill ms, decode tokens/s).
Bad arguments give an argparse usage error (exit status 2), never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

import models
from decoding.drafts import EarlyExit, PromptLookup
from decoding.generate import generate
from decoding.medusa import LOOKUP_NGRAM, Medusa
from decoding.sampling import SamplingConfig, check_seed
from decoding.speculative import speculative_generate
from decoding.tree import TreeSpec
from models.pretrained import SHIPPED, checkpoint_arg


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {value}")
    return value


def _seed(text: str) -> int:
    try:
        return check_seed(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int in [0, 2**32), got {text!r}") from None


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


SPECULATIVE = ("code-draft", "prompt-lookup", "medusa", "medusa+lookup", "medusa-tree")


def _speculative(text: str) -> str:
    """One of :data:`SPECULATIVE` or ``early-exit:L`` (L >= 1)."""
    kind, _, layers = text.partition(":")
    if text in SPECULATIVE or (kind == "early-exit" and layers.isdigit() and int(layers) >= 1):
        return text
    raise argparse.ArgumentTypeError(
        f"expected one of {', '.join(SPECULATIVE)} or early-exit:L with L >= 1, got {text!r}"
    )


def _draft(spec: str):
    """The ``speculative_generate`` draft for a ``--speculative`` value (``medusa``: the
    shipped code-target-medusa heads as a chain; ``medusa+lookup``: that chain with prompt
    lookup where the last LOOKUP_NGRAM tokens occurred before; ``medusa-tree``: as
    ``TreeSpec.default(4)``)."""
    if spec == "code-draft":
        return models.pretrained("code-draft")[0]
    if spec == "prompt-lookup":
        return PromptLookup()
    if spec.startswith("medusa"):
        heads = models.pretrained("code-target-medusa")[0]
        if spec == "medusa-tree":
            return Medusa(heads, tree=TreeSpec.default(heads.num_heads))
        return Medusa(heads, lookup_ngram=LOOKUP_NGRAM if spec == "medusa+lookup" else None)
    return EarlyExit(num_layers=int(spec.partition(":")[2]))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m decoding",
        description="Generate a continuation of PROMPT with a KV-cache decoder.",
    )
    parser.add_argument("prompt", help="text to continue")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=200, metavar="N")
    parser.add_argument("--temperature", type=_float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=_float, default=1.0, help="1.0 = off")
    parser.add_argument("--min-p", type=_float, default=0.0, help="0.0 = off")
    parser.add_argument("--seed", type=_seed, default=0, help="an int in [0, 2**32)")
    parser.add_argument(
        "--model",
        type=checkpoint_arg,
        default=SHIPPED[0],
        help=f"a shipped model ({', '.join(SHIPPED)}) or a Hugging Face checkpoint directory",
    )
    parser.add_argument("--cache", choices=("paged", "contiguous"), default="paged")
    parser.add_argument(
        "--page-size",
        type=_positive_int,
        default=16,
        metavar="P",
        help="positions per page (capped at what the request can use)",
    )
    parser.add_argument(
        "--speculative",
        type=_speculative,
        default=None,
        metavar="{code-draft,prompt-lookup,early-exit:L,medusa,medusa+lookup,medusa-tree}",
        help="speculative decoding with this draft (same output distribution, fewer target calls)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=_positive_int,
        default=None,
        metavar="K",
        help="tokens drafted per step (default: the draft kind's best measured)",
    )
    return parser


def load(name: str):
    """(model, tokenizer) for a shipped model name or a checkpoint directory: the directory's
    own tokenizer when it has ``tokenizer_config.json``, else ``models.ByteTokenizer``.

    Raises OSError or ValueError for a checkpoint that cannot be loaded.
    """
    model = models.load_model(name)
    if name not in SHIPPED and os.path.exists(os.path.join(name, "tokenizer_config.json")):
        import transformers

        return model, transformers.AutoTokenizer.from_pretrained(name)
    return model, models.ByteTokenizer()


def encode_prompt(prompt: str, tokenizer, config) -> tuple[list[int], int | None]:
    """(token ids of ``prompt``, the id to stop at) for a model with ``config``.

    The checkpoint's own ``bos_id`` / ``eos_id`` come first; a ``ByteTokenizer``'s are used only
    where the checkpoint names none and they fit its vocabulary. ValueError when the byte
    tokenizer does not fit the checkpoint (V < 256). A Hugging Face tokenizer adds its own
    special tokens.
    """
    V = config.vocab_size
    if not isinstance(tokenizer, models.ByteTokenizer):
        eos_id = config.eos_id if config.eos_id is not None else tokenizer.eos_token_id
        return tokenizer.encode(prompt), eos_id
    if V < 256:
        raise ValueError(
            f"the byte tokenizer (ids 0-255) does not fit this checkpoint (vocab_size {V}) and "
            "the directory has no tokenizer_config.json"
        )

    def special(checkpoint_id, byte_id):
        if checkpoint_id is not None:
            return checkpoint_id
        return byte_id if byte_id < V else None

    bos_id = special(config.bos_id, tokenizer.bos_id)
    ids = tokenizer.encode(prompt)
    return ([bos_id] + ids if bos_id is not None else ids), special(config.eos_id, tokenizer.eos_id)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        sampling = SamplingConfig(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p
        )
    except ValueError as e:
        parser.error(str(e))
    if not args.prompt:
        parser.error("prompt must not be empty")
    try:
        model, tokenizer = load(args.model)
        ids, eos_id = encode_prompt(args.prompt, tokenizer, model.config)
    except (OSError, ValueError) as e:
        parser.error(f"--model {args.model}: {e}")
    common = dict(
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        eos_id=eos_id,
        seed=args.seed,
        cache=args.cache,
        page_size=args.page_size,
    )
    if args.num_draft_tokens is not None and args.speculative is None:
        parser.error("--num-draft-tokens needs --speculative")
    try:
        if args.speculative is None:
            res = generate(model, [ids], **common)
        else:
            draft = _draft(args.speculative)
            k = args.num_draft_tokens
            res = speculative_generate(model, draft, [ids], num_draft_tokens=k, **common)
    except ValueError as e:
        parser.error(str(e))
    new = res.tokens[0]
    text = tokenizer.decode([t for t in new if t != eos_id])
    print(args.prompt + text)
    s = res.stats
    spec = ""
    if args.speculative is not None:
        spec = (
            f" | {args.speculative}, k={s['num_draft_tokens']}: acceptance "
            f"{s['acceptance_rate']:.2f}, {s['tokens_per_target_call']:.2f} tokens/target call"
        )
    print(
        f"[{len(new)} tokens | prefill {1e3 * s['prefill_s']:.1f} ms | decode "
        f"{s['decode_tokens_per_s']:.1f} tok/s | {s['tokens_per_s']:.1f} tok/s overall{spec} | "
        f"{args.cache} cache]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
