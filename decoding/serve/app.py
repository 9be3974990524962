"""The OpenAI-compatible HTTP API over one engine worker (FastAPI).

Routes: ``POST /v1/chat/completions`` (the model's chat template, stopping at its end-of-turn
token), ``POST /v1/completions`` (a string, a list of strings, token ids or lists of them),
``GET /v1/models``, ``GET /health``, ``GET /metrics``. Streaming is server-sent events in
OpenAI's chunk format ending ``data: [DONE]``; ``stream_options.include_usage`` adds a last
chunk with ``usage`` and no choices.

Every error is OpenAI's error object: 400 for malformed JSON, a field of the wrong type or out
of range, an unsupported setting, a prompt that does not fit the context, an unknown model
(``param`` names the field); 429 when the queue is full; 404/405 for unknown routes; 503 while
the engine is not running; 500 for a failure of one request, which fails that request alone.
A client that disconnects aborts its request (its pages return to the pool before the next
engine step).

Log-probabilities (chat ``logprobs``/``top_logprobs``, completions ``logprobs``) come from the
engine (``Engine.submit(logprobs=n)``), formatted by ``decoding.serve.logprobs``; they cover the
tokens whose text the choice holds: not the end-of-turn / EOS token, nor tokens after the one
that completed a stop string. A stream's chunks carry the records of their own tokens (a
chunk may carry records and no text while a character or a possible stop string is held back).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from decoding.chat import encode_prompt, turn_end_id
from decoding.engine import Engine
from decoding.sampling import SEED_LIMIT, SamplingConfig
from decoding.serve.defaults import OPENAI
from decoding.serve.logprobs import LogprobFormatter
from decoding.serve.metrics import CONTENT_TYPE, Metrics
from decoding.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
)
from decoding.serve.text import ChoiceText
from decoding.serve.worker import Worker
from models.tokenizer import Tokenizer

log = logging.getLogger("decoding.serve")
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks for a gone client


class Server:
    """The state behind the routes: the engine's worker, the tokenizer, the served name."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        max_queue: int,
        defaults: dict | None = None,
        idle_step_s: float | None = None,
    ):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        # Sampling fields a request leaves out (``decoding.serve.defaults``).
        self.defaults = {**OPENAI, **(defaults or {})}
        self.metrics = Metrics()
        self.worker = Worker(
            engine, max_queue=max_queue, observer=self.metrics, idle_step_s=idle_step_s
        )
        self.metrics.worker = self.worker
        self.created = int(time.time())
        P = engine.page_size
        # The longest request (prompt + new tokens) the engine accepts (``Engine.submit``).
        self.context = min(engine.max_seq_len, engine.allocator.num_pages * P + 1)
        self.chat_eos = turn_end_id(tokenizer) if tokenizer.chat_template else None
        self.logprobs = LogprobFormatter(tokenizer)

    # ----------------------------------------------------------------------------- prompts

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(
                400,
                f"model {name!r} is not served here; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], int | None]:
        if self.chat_eos is None:
            raise ApiError(400, f"model {self.model_name!r} has no chat template", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise ApiError(
                400, f"the chat template rejected the messages: {e}", param="messages"
            ) from e
        return ids, self.chat_eos

    def completion_prompt(self, prompt: str | list[int]) -> tuple[list[int], int | None]:
        config = self.engine.config
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt must not be empty", param="prompt")
            return encode_prompt(prompt, self.tokenizer, config)
        bad = [t for t in prompt if not 0 <= t < config.vocab_size]
        if bad:
            raise ApiError(
                400,
                f"prompt has token ids outside [0, {config.vocab_size}): {bad[:5]}",
                param="prompt",
            )
        _, eos_id = encode_prompt("", self.tokenizer, config)
        return list(prompt), eos_id

    def budget(self, prompt: list[int], max_new: int | None, param: str, field: str) -> int:
        """``max_new`` checked against the context, or (None) all the context leaves."""
        if len(prompt) >= self.context:
            raise ApiError(
                400,
                f"the prompt is {len(prompt)} tokens; this server's context is "
                f"{self.context} tokens (prompt + completion)",
                param=param,
                code="context_length_exceeded",
            )
        if max_new is None:
            return self.context - len(prompt)
        if len(prompt) + max_new > self.context:
            raise ApiError(
                400,
                f"{field} {max_new} + the prompt's {len(prompt)} tokens exceeds this "
                f"server's context of {self.context} tokens",
                param=field,
                code="context_length_exceeded",
            )
        return max_new

    def sampling(self, req) -> SamplingConfig:
        """The request's settings, each field it leaves out from ``self.defaults``."""
        d = self.defaults

        def get(name):
            value = getattr(req, name)
            return d[name] if value is None else value

        return SamplingConfig(
            temperature=get("temperature"),
            top_k=max(get("top_k"), 0),
            top_p=get("top_p"),
            min_p=get("min_p"),
        )

    # ----------------------------------------------------------------------------- generation

    async def generate(
        self, prompts, eos_id, req, max_new: list[int], counts: list[int]
    ) -> AsyncIterator[tuple[int, str, str | None, list | None]]:
        """Yields ``(choice index, text piece, finish_reason or None, logprobs)``; choice ``i``
        continues ``prompts[i // n]`` and ``counts[i]`` counts its tokens. ``logprobs``: None
        unless the request asked, else ``[(TokenLogprob, offset of the token's text in the
        choice's text)]`` of the piece's tokens. Leaving early (a disconnect, an exception)
        aborts the choices still running."""
        n, stops, sampling = req.n, req.stop_strings(), self.sampling(req)
        seed = secrets.randbits(32) if req.seed is None else req.seed
        k = len(prompts) * n
        if self.worker.full(k):
            raise ApiError(
                429,
                f"the server's queue is full ({self.worker.max_queue} choices); retry later",
                type="requests",
                code="rate_limit_exceeded",
            )
        if not self.worker.alive:
            raise ApiError(503, "the engine is not running", type="server_error")
        queue: asyncio.Queue = asyncio.Queue()
        handles = [
            self.worker.submit(
                queue,
                i,
                prompts[i // n],
                max_new[i // n],
                sampling=sampling,
                eos_id=eos_id,
                seed=(seed + i) % SEED_LIMIT,
                logprobs=req.num_logprobs(),
            )
            for i in range(k)
        ]
        texts = [ChoiceText(self.tokenizer, stops) for _ in range(k)]
        last = [None] * k
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts) * n)
        live = k
        try:
            while live:
                i, kind, payload = await queue.get()
                handle = handles[i]
                if handle.closed:
                    continue
                if kind == "error":
                    self.worker.finished(handle)
                    if isinstance(payload, ValueError):  # the engine refused the request
                        raise ApiError(400, str(payload)) from payload
                    raise payload
                if kind == "tokens":
                    tokens, records = payload
                    counts[i] += len(tokens)
                    last[i] = tokens[-1]
                    if records is None:
                        piece, entries = texts[i].push(tokens), None
                    else:
                        piece, entries = _push_with_logprobs(texts[i], tokens, records, eos_id)
                    if texts[i].stopped:
                        self.worker.abort(handle)
                        live -= 1
                        self.metrics.finished.labels("stop").inc()
                        yield i, piece, "stop", entries
                    elif piece or entries:
                        yield i, piece, None, entries
                    continue
                self.worker.finished(handle)  # done
                live -= 1
                reason = "stop" if eos_id is not None and last[i] == eos_id else "length"
                self.metrics.finished.labels(reason).inc()
                yield i, texts[i].flush(), reason, None
        finally:
            for handle in handles:
                self.worker.abort(handle)


def _push_with_logprobs(text: ChoiceText, tokens, records, eos_id) -> tuple[str, list]:
    """Pushes ``tokens`` one by one -> (the text piece, ``[(record, text offset)]`` of the
    tokens whose text the choice holds: up to the one completing a stop string, never EOS)."""
    piece, entries = "", []
    for token, record in zip(tokens, records, strict=True):
        if text.stopped:
            break
        if token != eos_id:
            entries.append((record, len(text.text)))
        piece += text.push([token])
    return piece, entries


def _logprobs(server: Server, chat: bool, entries: list | None):
    """A choice's ``logprobs`` object for ``entries`` (None when the request did not ask)."""
    if entries is None:
        return None
    records = [r for r, _ in entries]
    if chat:
        return {"content": server.logprobs.chat(records)}
    return server.logprobs.completion(records, [offset for _, offset in entries])


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return dict(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _until_disconnected(request: Request, coro):
    """Awaits ``coro``; cancels it (aborting its requests) if the client goes away first."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ApiError(499, "the client disconnected")
    finally:
        task.cancel()


async def _respond(server: Server, request: Request, req, chat: bool):
    req.check_unsupported()
    server.check_model(req.model)
    if chat:
        prompt, eos_id = server.chat_prompt(req)
        prompts, param = [prompt], "messages"
    else:
        encoded = [server.completion_prompt(p) for p in req.prompts()]
        prompts, param = [p for p, _ in encoded], "prompt"
        eos_id = encoded[0][1]
    if req.ignore_eos:
        eos_id = None
    field = "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"
    max_new = [server.budget(p, req.max_new_tokens(), param, field) for p in prompts]
    prompt_tokens = sum(len(p) for p in prompts)
    kind = "chat.completion" if chat else "text_completion"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = dict(id=rid, object=kind, created=int(time.time()), model=server.model_name)
    endpoint = request.url.path
    k = len(prompts) * req.n
    counts = [0] * k
    if req.stream:
        events = server.generate(prompts, eos_id, req, max_new, counts)
        # Run checks that raise before the response starts (queue full, engine down).
        first = await anext(events)
        return StreamingResponse(
            _stream(server, head, events, first, chat, req, prompt_tokens, counts, endpoint),
            media_type="text/event-stream",
        )

    asked = req.num_logprobs() is not None

    async def collect():
        texts, reasons = [""] * k, [None] * k
        entries = [[] if asked else None for _ in range(k)]
        events = server.generate(prompts, eos_id, req, max_new, counts)
        async for i, piece, reason, part in events:
            texts[i] += piece
            reasons[i] = reason or reasons[i]
            if part:
                entries[i] += part
        return texts, reasons, entries

    texts, reasons, entries = await _until_disconnected(request, collect())
    logprobs = [_logprobs(server, chat, e) for e in entries]
    if chat:
        choices = [
            dict(
                index=i,
                message=dict(role="assistant", content=texts[i]),
                logprobs=logprobs[i],
                finish_reason=reasons[i],
            )
            for i in range(k)
        ]
    else:
        choices = [
            dict(index=i, text=texts[i], logprobs=logprobs[i], finish_reason=reasons[i])
            for i in range(k)
        ]
    server.metrics.requests.labels(endpoint, "200").inc()
    return dict(
        **head, choices=choices, usage=_usage(prompt_tokens, sum(counts)), system_fingerprint=None
    )


async def _stream(server, head, events, first, chat, req, prompt_tokens, counts, endpoint):
    kind = "chat.completion.chunk" if chat else "text_completion"
    usage = req.stream_options is not None and req.stream_options.include_usage
    extra = {"usage": None} if usage else {}

    def chunk(i, piece, reason, entries=None, role=False):
        logprobs = _logprobs(server, chat, entries) if entries else None
        if chat:
            delta = {"role": "assistant", "content": piece} if role else {}
            if (piece or entries) and not role:
                delta["content"] = piece
            choice = dict(index=i, delta=delta, logprobs=logprobs, finish_reason=reason)
        else:
            choice = dict(index=i, text=piece, logprobs=logprobs, finish_reason=reason)
        return _sse({**head, "object": kind, "choices": [choice], **extra})

    try:
        if chat:
            for i in range(len(counts)):
                yield chunk(i, "", None, role=True)
        pending = [first]
        while True:
            for i, piece, reason, entries in pending:
                if piece or reason or entries:
                    yield chunk(i, piece, reason, entries)
            pending = [await anext(events)]
    except StopAsyncIteration:
        pass
    except Exception as e:  # the response has started: the error goes in the stream
        log.exception("a streaming request failed")
        server.metrics.requests.labels(endpoint, "500").inc()
        yield _sse(error_body(f"{type(e).__name__}: {e}", type="server_error"))
        yield "data: [DONE]\n\n"
        return
    finally:
        await events.aclose()
    if usage:
        yield _sse(
            {**head, "object": kind, "choices": [], "usage": _usage(prompt_tokens, sum(counts))}
        )
    server.metrics.requests.labels(endpoint, "200").inc()
    yield "data: [DONE]\n\n"


def create_app(
    engine: Engine,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    max_queue: int = 256,
    defaults: dict | None = None,
    idle_step_s: float | None = None,
) -> FastAPI:
    """The FastAPI app serving ``engine``; its worker thread runs for the app's lifespan (so
    stopping uvicorn, e.g. on SIGTERM, aborts what is left and ends with no page held).
    ``idle_step_s``: for a ``decoding.distributed.DistributedEngine`` (the server on process
    0), step it at least this often while idle, so the other processes are not left waiting in
    its broadcast (see :class:`~decoding.serve.worker.Worker`)."""
    server = Server(
        engine,
        tokenizer,
        model_name=model_name,
        max_queue=max_queue,
        defaults=defaults,
        idle_step_s=idle_step_s,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.worker.start()
        try:
            yield
        finally:
            stats = server.worker.close()
            log.info(
                "engine stopped: %d pages held, %d running, %d waiting",
                stats["pages_used"],
                stats["running"],
                stats["waiting"],
            )

    app = FastAPI(title="pallas-attn OpenAI-compatible server", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        server.metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            message, param = f"malformed JSON: {err.get('msg')}", None
        else:
            where = ".".join(loc)
            message = f"{where}: {err.get('msg')}" if where else str(err.get("msg"))
            param = loc[0] if loc else None
        server.metrics.requests.labels(request.url.path, "400").inc()
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def failure(request, exc: Exception):
        log.exception("request failed")
        message = f"{type(exc).__name__}: {exc}"
        server.metrics.requests.labels(request.url.path, "500").inc()
        return JSONResponse(error_body(message, type="server_error"), status_code=500)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await _respond(server, request, req, chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await _respond(server, request, req, chat=False)

    @app.get("/v1/models")
    async def list_models():
        card = dict(
            id=server.model_name,
            object="model",
            created=server.created,
            owned_by="pallas-attn",
            max_model_len=server.context,
        )
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if not server.worker.alive:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    return app
