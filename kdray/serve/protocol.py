"""OpenAI request models, error bodies and server-sent events.

Requests are validated strictly (a string where a number belongs is an error, not a conversion) and
every failure becomes an :class:`APIError` whose message and ``param`` name the offending field.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_N = 16  # choices per request
SSE_DONE = "data: [DONE]\n\n"
_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 500: "server_error", 503: "server_overloaded"}


class APIError(Exception):
    """An error answered as ``{"error": {message, type, param, code}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = _ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 that says why it is not one."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON in the request body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    return data


def _field(loc: tuple) -> str:
    """``("messages", 0, "content")`` -> ``messages[0].content``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validate(model: type[BaseModel], data: dict):
    """``model`` built from ``data``; the first validation error becomes a 400 naming its field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        name = _field(err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        got = f" (got {json.dumps(err['input'])[:80]})" if "input" in err and err["type"] != "missing" else ""
        raise APIError(400, f"{name}: {msg}{got}", param=name, code="invalid_value") from None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        """An explicit ``null`` means "the default", as OpenAI clients use it."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(_Strict):
    include_usage: bool = False


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int and t >= 0 for t in value)


class GenerationRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # -1 (vLLM's "off") and 0 both disable it
    seed: int | None = None
    stop: list[str] = []
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False  # kdray / vLLM extension: token ids beside the text
    logprobs: Any = None
    top_logprobs: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        v = [v] if isinstance(v, str) else v
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            raise ValueError("must be a string or a list of non-empty strings")
        return v

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _unsupported(cls, v: Any) -> Any:
        if v not in (None, False, 0):
            raise ValueError("log probabilities are not supported by kdray yet; leave the field out")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either."""

    prompt: list[str | list[int]]
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        v = [v] if isinstance(v, str) or _is_token_ids(v) else v
        if not isinstance(v, list) or not v or not all((isinstance(p, str) and p) or _is_token_ids(p) for p in v):
            raise ValueError("must be a non-empty string, a non-empty list of token ids (integers >= 0), "
                             "or a non-empty list of either")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported; leave it out or set it to false")
        return v


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        """Content given as ``[{"type": "text", "text": ...}, ...]`` is joined into one string."""
        if isinstance(v, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in v):
                raise ValueError("content parts must all be {\"type\": \"text\", \"text\": <string>}; "
                                 "kdray models read text only")
            return "".join(p["text"] for p in v)
        return v


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _completion_tokens(self) -> ChatCompletionRequest:
        """The newer ``max_completion_tokens`` name wins over ``max_tokens`` when both are given."""
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
