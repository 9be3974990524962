"""OpenAI's request bodies as pydantic models, and its error object.

Types are strict (``"0.5"`` is not a temperature; an int is a valid float), ranges are OpenAI's,
and fields this server does not know are accepted and ignored, as OpenAI's own server and
vLLM's do, so clients that send extra fields keep working. ``top_k`` and ``min_p`` are extras
in vLLM's convention (``top_k`` -1 or 0 disables), as is ``ignore_eos`` (generate
``max_tokens`` tokens whatever the model says: for benchmarks). Fields whose behaviour is not implemented
(penalties, ``echo``, ``best_of``, ``suffix``) are typed and range-checked, and a value other
than their no-op default is a 400 naming the field, never silently ignored.

Log-probabilities: chat's ``logprobs: true`` with ``top_logprobs`` 0 .. 20 (``top_logprobs``
without ``logprobs: true`` is a 400, as OpenAI's), completions' ``logprobs`` 0 .. 20 (OpenAI's
legacy bound is 5; 20, the engine's ``MAX_LOGPROBS``, as vLLM allows).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from decoding.sampling import MAX_LOGPROBS

MAX_N = 16  # choices per request
MAX_STOP = 16  # stop strings per request (OpenAI allows 4)

Probability = Annotated[float, Field(ge=0.0, le=1.0)]


class ApiError(Exception):
    """An HTTP error with OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Probability | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    user: str | None = None
    ignore_eos: bool = False

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise ApiError(400, "stop strings must not be empty", param="stop")
        return stops

    def check_unsupported(self) -> None:
        """400 for a setting this server would otherwise silently ignore."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported by this server", param=name)
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options needs stream: true", param="stream_options")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    def num_logprobs(self) -> int | None:
        """None (no logprobs), else the alternatives wanted per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: (
        str
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)]
    )
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    suffix: str | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise ApiError(400, "echo is not supported by this server", param="echo")
        if self.best_of not in (None, self.n):
            raise ApiError(400, "best_of other than n is not supported", param="best_of")
        if self.suffix:
            raise ApiError(400, "suffix is not supported by this server", param="suffix")

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts: texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()
