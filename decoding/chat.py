"""Streaming text out of the engine, and multi-turn chat that keeps the conversation cached.

* :func:`stream`: submits one request to an :class:`~decoding.engine.Engine` and yields its text
  as it is generated, a piece as soon as its bytes are complete (``models.StreamDecoder``).
* :func:`encode_prompt`: a plain prompt's ids and stop id under a checkpoint's special-token rules.
* :class:`ChatSession`: a conversation. Each turn's prompt is the conversation's tokens so far,
  the earlier replies exactly as they were generated, followed by the new turn rendered with the
  tokenizer's chat template. The engine's prefix cache still holds the earlier turns' pages, so a
  turn prefills only its own tokens (and the partial page before them).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from decoding.engine import Engine
from decoding.sampling import SamplingConfig
from models.stream_decoder import StreamDecoder
from models.tokenizer import ByteTokenizer, Tokenizer

# Special tokens that end an assistant turn in the chat templates of common model families; the
# first one a template names (and the vocabulary holds) is where a chat reply stops.
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


def turn_end_id(tokenizer: Tokenizer) -> int | None:
    """The token id that ends an assistant turn: the first of :data:`TURN_END_TOKENS` that the
    chat template names and the tokenizer encodes as one special id, else ``eos_id``."""
    template = tokenizer.chat_template or ""
    for text in TURN_END_TOKENS:
        if text in template:
            ids = tokenizer.encode(text)
            if len(ids) == 1 and ids[0] in tokenizer.special_ids:
                return ids[0]
    return tokenizer.eos_id


def encode_prompt(prompt: str, tokenizer, config) -> tuple[list[int], int | None]:
    """(token ids of ``prompt``, the id to stop at) for a model with ``config``.

    A real tokenizer adds BOS when its checkpoint asks for it (``add_bos``). For the
    ``ByteTokenizer``, the checkpoint's own ``bos_id`` / ``eos_id`` come first, the tokenizer's
    are used only where the checkpoint names none and they fit its vocabulary; ValueError when
    the byte tokenizer does not fit the checkpoint (V < 256).
    """
    V = config.vocab_size
    if not isinstance(tokenizer, ByteTokenizer):
        eos_id = config.eos_id if config.eos_id is not None else tokenizer.eos_id
        return tokenizer.encode(prompt, add_bos=tokenizer.add_bos), eos_id
    if V < 256:
        raise ValueError(
            f"the byte tokenizer (ids 0-255) does not fit this checkpoint (vocab_size {V}) and "
            "the directory has no tokenizer.json"
        )

    def special(checkpoint_id, byte_id):
        if checkpoint_id is not None:
            return checkpoint_id
        return byte_id if byte_id < V else None

    bos_id = special(config.bos_id, tokenizer.bos_id)
    ids = tokenizer.encode(prompt)
    return ([bos_id] + ids if bos_id is not None else ids), special(config.eos_id, tokenizer.eos_id)


def stream(
    engine: Engine,
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    stop_id: int | None = None,
    seed: int = 0,
    stats: dict | None = None,
    out_ids: list[int] | None = None,
) -> Iterator[str]:
    """Yields the text of one request's continuation of ``prompt_ids`` as it is generated.

    ``stop_id`` ends the request (its text is not yielded: special tokens are skipped). When
    given, ``out_ids`` receives the generated ids (``stop_id`` included) and ``stats`` the
    request's ``prompt_tokens``, ``prefilled_tokens`` (what the prefix cache did not hold),
    ``new_tokens``, ``ttft_s`` (submit to first token, prefill included) and ``decode_tokens_per_s``.
    Closing the generator early (or an exception in the consumer) aborts the request; its result
    is not left in the engine either way.
    """
    ids = [] if out_ids is None else out_ids
    before = engine.stats()["prefill_tokens"]
    t0 = time.perf_counter()
    rid = engine.submit(prompt_ids, max_new_tokens, sampling=sampling, eos_id=stop_id, seed=seed)
    decoder = StreamDecoder(tokenizer)
    first = None
    finished = False
    try:
        while engine.busy and not finished:
            new = engine.step().get(rid, [])
            if new and first is None:
                first = time.perf_counter()
            ids.extend(new)
            finished = len(ids) >= max_new_tokens or (stop_id is not None and stop_id in new)
            if piece := decoder.push(new):
                yield piece
        if tail := decoder.flush():
            yield tail
    finally:
        engine.abort(rid)  # a running request is cancelled; a finished one's result dropped
    if stats is not None:
        end = time.perf_counter()
        stats.update(
            prompt_tokens=len(prompt_ids),
            prefilled_tokens=engine.stats()["prefill_tokens"] - before,
            new_tokens=len(ids),
            ttft_s=(first or end) - t0,
            decode_tokens_per_s=(len(ids) - 1) / (end - first) if first and end > first else 0.0,
        )


class ChatSession:
    """A conversation with a chat model over an :class:`Engine` (see the module docstring).

    ``send(text)`` streams the reply to one user turn; ``messages`` is the conversation so far
    (``{"role", "content"}`` dicts), ``stats`` the last turn's (see :func:`stream`).
    """

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        system: str | None = None,
        max_new_tokens: int = 256,
        sampling: SamplingConfig | None = None,
        seed: int = 0,
    ):
        if tokenizer.chat_template is None:
            raise ValueError("the tokenizer has no chat template")
        self.engine, self.tokenizer = engine, tokenizer
        self.system, self.max_new_tokens, self.sampling = system, max_new_tokens, sampling
        self.seed = seed
        self.stop_id = turn_end_id(tokenizer)
        self.stats: dict = {}
        self.reset()

    def reset(self) -> None:
        """Forgets the conversation (its pages stay in the prefix cache until evicted)."""
        self.messages: list[dict] = []
        if self.system is not None:
            self.messages.append({"role": "system", "content": self.system})
        self._ids: list[int] = []  # the conversation's tokens: prompts and replies as generated
        self._text = ""  # their text (special tokens included)

    def _prompt(self, messages: list[dict]) -> list[int]:
        """The tokens of ``messages`` + the generation prompt: the conversation's own tokens
        followed by the new turn, when the template renders the conversation as a prefix of the
        new text (else the whole text encoded afresh)."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        if self._ids and text.startswith(self._text):
            return self._ids + self.tokenizer.encode(text[len(self._text) :])
        return self.tokenizer.encode(text)

    def send(self, text: str) -> Iterator[str]:
        """Streams the reply to the user turn ``text``; the conversation grows by both turns once
        the reply is complete (an interrupted reply is dropped)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt = self._prompt(messages)
        prompt_text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        out: list[int] = []
        pieces: list[str] = []
        for piece in stream(
            self.engine,
            self.tokenizer,
            prompt,
            max_new_tokens=self.max_new_tokens,
            sampling=self.sampling,
            stop_id=self.stop_id,
            seed=self.seed + len(self.messages),
            stats=self.stats,
            out_ids=out,
        ):
            pieces.append(piece)
            yield piece
        self.messages = [*messages, {"role": "assistant", "content": "".join(pieces)}]
        self._ids = prompt + out
        self._text = prompt_text + self.tokenizer.decode(out, skip_special_tokens=False)
