"""OpenAI request models, error bodies and server-sent events.

Requests are validated strictly (a string where a number belongs is an error, not a conversion), every
number is bounded, and every failure becomes an :class:`APIError` whose message and ``param`` name the
offending field.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kdray.engine.request import MAX_SEED, MAX_TOKENS, MAX_TOP_K

MAX_N = 16  # choices per request
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_JSON_DEPTH = 64  # nesting of arrays and objects in a request body
SSE_DONE = "data: [DONE]\n\n"
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


class APIError(Exception):
    """An error answered as ``{"error": {message, type, param, code}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, type: str | None = None):  # noqa: A002 - OpenAI's name
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 that says why it is not one (malformed, NaN or Infinity,
    an integer of more than 4300 digits, nested deeper than ``MAX_JSON_DEPTH``, text that is not Unicode)."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        what = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise APIError(400, f"malformed JSON in the request body: {what}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type(data).__name__}", code="invalid_json")
    _check_tree(data)
    return data


def _check_tree(data: dict):
    """Refuse nesting deeper than ``MAX_JSON_DEPTH`` and strings holding lone UTF-16 surrogates (``"\\ud800"``
    is valid JSON but no text), naming where they are."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError:
                name = where.encode(errors="backslashreplace").decode()  # the path may hold the surrogate
                raise APIError(400, f"{name}: holds a lone UTF-16 surrogate, which is not text; send valid Unicode",
                               param=name, code="invalid_value") from None
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                top = where.split(".")[0].split("[")[0]
                raise APIError(400, f"{top}: nests arrays or objects deeper than {MAX_JSON_DEPTH} levels",
                               param=top, code="invalid_json")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str) or isinstance(item, (str, dict, list)):  # numbers need no look
                    inner = f"{where}[{key}]" if isinstance(key, int) else (f"{where}.{key}" if where else key)
                    stack += [(key, inner, depth), (item, inner, depth + 1)]


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
        got = f" (got {_brief(err['input'])})" if "input" in err and err["type"] != "missing" else ""
        raise APIError(400, f"{name}: {msg}{got}", param=name, code="invalid_value") from None


def _brief(value: Any) -> str:
    """A short rendering of a bad value for an error message (a container is described, not printed)."""
    if isinstance(value, (dict, list)):
        return f"{'an object' if isinstance(value, dict) else 'an array'} of {len(value)} items"
    if isinstance(value, int) and value.bit_length() > 64:
        return f"a {value.bit_length()}-bit integer"
    return json.dumps(value)[:80]


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
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)  # -1 (vLLM's "off") and 0 both disable it
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: list[str] = Field([], max_length=MAX_STOP)
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
        if not isinstance(v, list) or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in v):
            raise ValueError(f"must be a string or a list of strings, each of 1 to {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _seeds_fit(self) -> GenerationRequest:
        """Choice ``j`` samples with ``seed + j``: every one must fit the engine's 63 bits."""
        if self.seed is not None and self.seed + self.n - 1 > MAX_SEED:
            raise APIError(400, f"seed: with n={self.n}, seed + n - 1 must be at most 2^63 - 1 = {MAX_SEED}",
                           param="seed", code="invalid_value")
        return self

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
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)

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
